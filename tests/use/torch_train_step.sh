#!/usr/bin/env bash
# docs/training-math.md is what titan3d computes: torch_train_step.py rebuilds the first steps of
# two tiny fp32 runs in float64 PyTorch from that page's formulas alone (initialisation, sampler
# windows, mean loss over global_batch · seq_len, global norm, clip, lr schedule, decay set,
# AdamW, validation loss) and compares every step's loss, lr, grad_norm and val_loss with
# metrics.jsonl and every snapshot's parameters and AdamW moments. Both runs use grouped-query
# attention (common.sh's tiny), clip some steps and not others (grad_clip between the steps'
# norms) and a weight decay large enough to show in the parameters:
#  1. random sampler, untied LM head, 2 micro-batches, one rank; warm-up of 2 then the cosine;
#     validation after steps 3 and 6;
#  2. sequential sampler, tied embeddings, dp = 2; no warm-up (the cosine from step 0).
# and two mixtures of experts from docs/moe.md (routing, gates, capacity, shared experts, the
# selection bias and its update, the auxiliary loss; metrics' expert load, drops and bias range;
# the snapshots' biases bit for bit):
#  3. run 1's settings with block 0 dense and 4 routed experts (2 per token) and a shared expert in
#     blocks 1-2, softmax router, the selection bias (rate 1e-2: it moves every step) and the
#     auxiliary loss over 2 micro-batches;
#  4. run 2's dp = 2 (no warm-up), with expert parallelism (ep = 2: each rank holds 2 of the 4
#     experts), every block a mixture: sigmoid router, unnormalised gates scaled by 2.5, the bias,
#     and a capacity factor of 1 that drops slots on each rank.
# and a Qwen2.5-shaped dense run with Llama 3's head and RoPE (docs/training-math.md's biases,
# head_dim and scaled frequencies):
#  5. run 2's dp = 2 and tied embeddings, q/k/v biases (zero at init, outside the decay set),
#     head_dim 24 over dim 64 and 4 heads, llama3 RoPE scaling over a pretraining context of 16;
#     the lr stable for 2 steps, then a sqrt decay over the last 3 (train.decay_steps, lr_decay).
# and a Qwen3-MoE-shaped one (the page's per-head q/k norms, docs/moe.md's router):
#  6. run 2's dp = 2 (untied) on tp = 2 and ep = 2, q/k norms (ones at init, outside the decay
#     set) with head_dim 24, block 0 dense, then 4 routed experts (2 per token), no shared
#     expert, softmax router with unnormalised gates, no selection bias. train.seed 2 and
#     grad_clip 2.1 (step 2 clipped, the others not): seed 1's first gradient has an o_proj
#     element of 6e-9, near AdamW's eps, where the fp32 first step's g / (|g| + eps) moves that
#     weight by 0.14·lr more than float64's (the effect TOL_PARAM_MAX allows 0.05 for) and the
#     runs drift apart past the tolerances; measured, not a formula's difference.
# and a Qwen2-MoE-shaped one (docs/moe.md's sigmoid gate on the shared expert):
#  7. run 3's mixture (block 0 dense, 4 routed experts, a shared expert, the selection bias) with
#     q/k/v biases and model.shared_expert_gate, on dp = 2 and tp = 2 with sequence parallelism:
#     the gate's initialisation (by its name, std 0.02), its place in the decay set and its
#     gradient summed over tp as docs/moe.md says. grad_clip 2.05: the norms (1.8 to 2.5) of
#     some steps are clipped, of others not.
# Skips loudly (exit 77) when Debian's python3-torch or python3-h5py is missing.
set -u
py=/usr/bin/python3
if ! "$py" -c 'import torch, h5py' 2>/dev/null; then
  echo "SKIPPED (loudly): torch or h5py is not installed for $py; apt-get install python3-torch python3-h5py to run this check"
  exit 77
fi
source "$(dirname "$0")/common.sh"
# Pinned: the replay is float64 against fp32 OpenBLAS GEMMs; every step a full snapshot.
pinned=(--set train.precision=fp32 --set hardware.gemm=openblas --set train.weight_decay=0.5
        --set train.grad_clip=1.7 --set snapshot.every=1 --set snapshot.full_every=1
        --set snapshot.keep=100 --set run.log_level=warn)

# replay NAME: the PyTorch rebuild of run NAME, its output indented.
replay() {
  "$py" "$(dirname "$0")/torch_train_step.py" "$work/$1" >"$work/$1.txt" 2>&1
  local rc=$?
  sed 's/^/  /' "$work/$1.txt"
  return $rc
}

"$titan3d" train "${tiny[@]}" "${pinned[@]}" --set train.steps=6 --set train.warmup_steps=2 \
  --set train.micro_batches=2 --set train.val_every=3 --set run.dir="$work/random" \
  >"$work/random.log" 2>&1
check "[ \$? -eq 0 ]" "train 6 steps: random sampler, untied, 2 micro-batches" || cat "$work/random.log"
check "replay random" "PyTorch rebuilds run 1 from docs/training-math.md"

"$titan3d" train "${tiny[@]}" "${pinned[@]}" --set train.steps=5 --set train.warmup_steps=0 \
  --set train.val_every=0 --set data.sampler=sequential --set model.tie_embeddings=true \
  --set parallel.dp=2 --set run.dir="$work/sequential" >"$work/sequential.log" 2>&1
check "[ \$? -eq 0 ]" "train 5 steps: sequential sampler, tied embeddings, dp2" || cat "$work/sequential.log"
check "replay sequential" "PyTorch rebuilds run 2 from docs/training-math.md"

moe=(--set model.n_experts=4 --set model.experts_per_token=2 --set model.moe_ffn_dim=32
     --set model.router_bias_rate=1e-2)
"$titan3d" train "${tiny[@]}" "${pinned[@]}" "${moe[@]}" --set train.steps=6 --set train.warmup_steps=2 \
  --set train.micro_batches=2 --set train.val_every=3 --set model.n_layers=3 --set model.dense_layers=1 \
  --set model.n_shared_experts=1 --set model.router_aux_coef=1e-2 --set run.dir="$work/moe_softmax" \
  >"$work/moe_softmax.log" 2>&1
check "[ \$? -eq 0 ]" "train 6 steps: MoE, softmax router, shared expert, bias and auxiliary loss" ||
  cat "$work/moe_softmax.log"
check "replay moe_softmax" "PyTorch rebuilds run 3 from docs/training-math.md and docs/moe.md"

"$titan3d" train "${tiny[@]}" "${pinned[@]}" "${moe[@]}" --set train.steps=5 --set train.warmup_steps=0 \
  --set train.val_every=0 --set parallel.dp=2 --set parallel.ep=2 --set model.router_score=sigmoid \
  --set model.router_norm_topk=false --set model.router_scale=2.5 --set model.capacity_factor=1.0 \
  --set run.dir="$work/moe_sigmoid" >"$work/moe_sigmoid.log" 2>&1
check "[ \$? -eq 0 ]" "train 5 steps: MoE on dp2 ep2, sigmoid router, scaled gates, capacity" ||
  cat "$work/moe_sigmoid.log"
check "replay moe_sigmoid && grep -q 'dropped_slots [1-9]' $work/moe_sigmoid.txt" \
  "PyTorch rebuilds run 4 from docs/training-math.md and docs/moe.md, dropped slots included"
"$titan3d" train "${tiny[@]}" "${pinned[@]}" --set train.steps=5 --set train.warmup_steps=0 \
  --set train.val_every=0 --set model.tie_embeddings=true --set parallel.dp=2 \
  --set model.qkv_bias=true --set model.head_dim=24 --set model.rope_scaling=llama3 \
  --set model.rope_factor=8.0 --set model.rope_original_seq_len=16 --set train.lr_decay=sqrt \
  --set train.decay_steps=3 --set run.dir="$work/qwen25" >"$work/qwen25.log" 2>&1
check "[ \$? -eq 0 ]" "train 5 steps: q/k/v biases, head_dim 24, llama3 RoPE, tied, dp2, stable then sqrt decay" ||
  cat "$work/qwen25.log"
check "replay qwen25" "PyTorch rebuilds run 5 (Qwen2.5-shaped) from docs/training-math.md"
"$titan3d" train "${tiny[@]}" "${pinned[@]}" --set train.steps=5 --set train.warmup_steps=0 \
  --set train.val_every=0 --set model.qk_norm=true --set model.head_dim=24 --set model.n_layers=3 \
  --set model.dense_layers=1 --set model.n_experts=4 --set model.experts_per_token=2 \
  --set model.moe_ffn_dim=32 --set model.router_norm_topk=false --set parallel.dp=2 \
  --set parallel.tp=2 --set parallel.ep=2 --set train.seed=2 --set train.grad_clip=2.1 \
  --set run.dir="$work/qwen3_moe" >"$work/qwen3_moe.log" 2>&1
check "[ \$? -eq 0 ]" "train 5 steps: q/k norms, head_dim 24, MoE without shared experts, dp2 tp2 ep2" ||
  cat "$work/qwen3_moe.log"
check "replay qwen3_moe" "PyTorch rebuilds run 6 (Qwen3-MoE-shaped) from docs/training-math.md and docs/moe.md"
"$titan3d" train "${tiny[@]}" "${pinned[@]}" "${moe[@]}" --set train.steps=5 --set train.warmup_steps=0 \
  --set train.val_every=0 --set model.n_layers=3 --set model.dense_layers=1 \
  --set model.n_shared_experts=1 --set model.qkv_bias=true --set model.shared_expert_gate=true \
  --set parallel.dp=2 --set parallel.tp=2 --set parallel.sequence_parallel=true \
  --set train.grad_clip=2.05 --set run.dir="$work/qwen2_moe" >"$work/qwen2_moe.log" 2>&1
check "[ \$? -eq 0 ]" "train 5 steps: q/k/v biases, gated shared expert, dp2 tp2 with SP" ||
  cat "$work/qwen2_moe.log"
check "replay qwen2_moe" "PyTorch rebuilds run 7 (Qwen2-MoE-shaped) from docs/training-math.md and docs/moe.md"
exit $fail
