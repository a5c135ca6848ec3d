#!/usr/bin/env bash
# Mixtures of experts (docs/moe.md), end to end on a tiny model: block 0 dense, blocks 1-3 with 4
# routed experts (2 per token) and a shared expert, the selection bias and the auxiliary loss.
#  1. The loss falls; each step counts every token slot once per block (routed_slots), also
#     with activation checkpointing and with 4 micro-batches.
#  2. Layout parity over 50 steps: the 1-rank run against dp2, dp2 with ZeRO-3, pp2 (1f1b, zb_h1
#     and zb_v, which defer every weight gradient of a block to W, interleaved), pp2 ×
#     dp2 with ZeRO-1, 4 micro-batches, tp2 with and without sequence parallelism, pp2 × dp2 × tp2 with SP and ZeRO-1: the same losses within 1e-5 relative
#     (fp32: only the order of additions differs, and no token changes its experts); activation
#     checkpointing, and zb_h1 against 1f1b (losses and gradient norms): the same bits. cp2 against 1 rank without the auxiliary loss. bf16 (stored
#     activations, and bf16 GEMMs where the CPU has them): pp2 × dp2 against 1 rank within 1e-3.
#  3. The auxiliary loss of step 1 is the same whatever the micro-batches and pp (a 1/micro-batch
#     factor would show), and the selection bias moves (aux-loss-free balancing).
#  4. Snapshots: resume bit for bit on the same layout, also through a chain of incremental
#     snapshots, and onto dp2 within the parity tolerance.
#  5. eval and generate run on a MoE snapshot; export / import in Mixtral's layout and, with shared
#     experts and a dense block, in Qwen2-MoE's, bit-exact both ways in fp32 and bf16; export
#     refused (naming the key) for what neither holds, import for a Qwen2-MoE whose biases or
#     shared-expert gate are not zero; bad MoE keys exit 2 naming them.
#  6. A capacity factor: dp2 (1 micro-batch) against 1 rank (2 micro-batches: the same rows per
#     micro-batch, so the same slots drop), tp2 with SP and pp2 against 1 rank, all within the
#     parity tolerance; activation checkpointing gives the same bits; a tight capacity drops slots
#     (dropped_slots) and the model still learns.
#  7. Seeing it: per-layer imbalance and idle experts, the bias range, the end-of-run table; a
#     router without balancing that leaves experts idle makes the trainer warn and selfcheck flag
#     the layer, and a balanced run passes.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
steps=50
common=(--set data.path="$corpus" "${tiny_moe[@]}" --set train.micro_batches=2
        --set train.steps=$steps --set hardware.gemm=openblas)
within() {  # within NAME REFERENCE RTOL
  printf '%-26s' "$1:"
  compare_losses "$work/$1/metrics.jsonl" "$work/$2/metrics.jsonl" "$3" || fail=1
}

# --- 1. The reference; it learns and counts each slot once. ---
run reference --set snapshot.every=25
first=$(losses "$work/reference/metrics.jsonl" | head -1)
last=$(losses "$work/reference/metrics.jsonl" | tail -1)
check "awk -v a=$first -v b=$last 'BEGIN { exit !(b < a - 1.0) }'" "the MoE model learns: loss $first -> $last"
slots=$((8 * 32 * 2))
check "[ \"\$(field $work/reference/metrics.jsonl routed_slots | sort -u)\" = $slots ]" \
  "every step routes global_batch·seq_len·K = $slots slots per block"
check "field $work/reference/metrics.jsonl aux_loss | awk '\$1 <= 0 { bad = 1 } END { exit bad }'" \
  "aux_loss is reported and positive"
# Where a step makes the host wait (on a GPU each drains the stream; counted alike here): per MoE
# block and micro-batch its routing and its auxiliary loss's value (3 blocks × 2 micro-batches ×
# 2), then the losses, the gradient norm's sums and the router biases once each: 15.
check "[ \"\$(field $work/reference/metrics.jsonl host_waits | sort -u)\" = 15 ]" \
  "each step makes the host wait 15 times: the routing and aux value per block and micro-batch, 3 more"

# --- 2. Layout parity. ---
run recompute --set train.activation_checkpoint=full
check "diff <(losses $work/reference/metrics.jsonl) <(losses $work/recompute/metrics.jsonl) > /dev/null" \
  "activation checkpointing: the same losses, bit for bit (the recompute routes alike)"
check "[ \"\$(field $work/recompute/metrics.jsonl routed_slots | sort -u)\" = $slots ]" \
  "activation checkpointing: each slot counted once (recomputes not counted)"
check "[ \"\$(field $work/recompute/metrics.jsonl host_waits | sort -u)\" = 15 ]" \
  "activation checkpointing: the recompute reuses the kept routing, no wait more (15 a step)"
for layout in "dp2 --set parallel.dp=2" \
              "dp2_zero3 --set parallel.dp=2 --set parallel.zero=3" \
              "pp2_1f1b --set parallel.pp=2" \
              "pp2_zb_h1 --set parallel.pp=2 --set parallel.schedule=zb_h1" \
              "pp2_zb_v --set parallel.pp=2 --set parallel.schedule=zb_v" \
              "pp2_interleaved --set parallel.pp=2 --set parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2" \
              "pp2_dp2_zero1 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=1" \
              "micro4 --set train.micro_batches=4" \
              "tp2 --set parallel.tp=2" \
              "tp2_sp --set parallel.tp=2 --set parallel.sequence_parallel=true" \
              "pp2_dp2_tp2_sp_zero1 --set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.zero=1"; do
  # shellcheck disable=SC2086
  run $layout
  within "${layout%% *}" reference 1e-5
done
# W adds each micro-batch's weight gradients (a MoE block's router and experts' too) in the order
# 1F1B's whole backward does, on the same stages: the same bits.
steps_of() { losses "$work/$1/metrics.jsonl"; field "$work/$1/metrics.jsonl" grad_norm; }
check "diff <(steps_of pp2_zb_h1) <(steps_of pp2_1f1b) > /dev/null" \
  "zb_h1: the losses and gradient norms of 1f1b, bit for bit"
check "[ \"\$(field $work/micro4/metrics.jsonl routed_slots | sort -u)\" = $slots ]" \
  "4 micro-batches: each slot counted once"
run reference_noaux --set model.router_aux_coef=0
run cp2 --set model.router_aux_coef=0 --set parallel.cp=2
within cp2 reference_noaux 1e-5
choose_bf16 "${common[@]}"
# bf16 rounds values that fp32 only reorders, and 50 steps of Adam carry the difference along:
# the dense model's own pp2 × dp2 against 1 rank (run here, without experts) sets the bar.
run bf16 "${bf16[@]}"
run bf16_pp2_dp2 "${bf16[@]}" --set parallel.pp=2 --set parallel.dp=2
dense=(--set model.n_experts=0)
run dense_bf16 "${bf16[@]}" "${dense[@]}"
run dense_bf16_pp2_dp2 "${bf16[@]}" "${dense[@]}" --set parallel.pp=2 --set parallel.dp=2
worst() { compare_losses "$work/$1/metrics.jsonl" "$work/$2/metrics.jsonl" 1 | sed -n 's/.*difference \([^ ]*\) .*/\1/p'; }
moe_worst=$(worst bf16_pp2_dp2 bf16) dense_worst=$(worst dense_bf16_pp2_dp2 dense_bf16)
check "awk -v m=$moe_worst -v d=$dense_worst 'BEGIN { exit !(m <= (2 * d > 1e-3 ? 2 * d : 1e-3)) }'" \
  "bf16 pp2 × dp2 against 1 rank over $steps steps: MoE $moe_worst, within max(1e-3, 2 × the dense model's $dense_worst)"
check "awk -v a=$first -v b=\$(losses $work/bf16/metrics.jsonl | tail -1) 'BEGIN { exit !(b < a - 1.0) }'" \
  "bf16: the MoE model learns"

# --- 3. The auxiliary loss does not depend on the split; the bias moves. ---
aux1() { field "$work/$1/metrics.jsonl" aux_loss | head -1; }
for other in micro4 pp2_1f1b pp2_dp2_zero1; do
  check "awk -v a=$(aux1 reference) -v b=$(aux1 $other) 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0 && d <= 1e-6 * a) }'" \
    "step 1's aux loss: $other $(aux1 $other) = 1 rank $(aux1 reference)"
done
bias=$(h5dump -d "/model/model.layers.2.mlp.router.bias" \
  "$work/reference/snapshots/step_00000050/rank00000.h5" 2>/dev/null | grep -m1 '(0):')
check "echo '$bias' | grep -qE '[1-9]'" "the selection bias moved from 0 (block 2: $bias)"

# --- 4. Snapshots. ---
run resumed --set snapshot.resume="$work/reference/snapshots/step_00000025.h5"
check "diff <(losses $work/reference/metrics.jsonl | tail -25) <(losses $work/resumed/metrics.jsonl) > /dev/null" \
  "resumed at step 25 on the same layout: steps 26-50 bit for bit"
run resumed_dp2 --set parallel.dp=2 --set snapshot.resume="$work/reference/snapshots/step_00000025.h5"
grep '"loss": ' "$work/reference/metrics.jsonl" | tail -25 > "$work/reference_26_50.jsonl"
printf '%-26s' "resumed_dp2:"
compare_losses "$work/resumed_dp2/metrics.jsonl" "$work/reference_26_50.jsonl" 1e-5 || fail=1

# Incremental snapshots (full at step 2, incremental at 4 and 6) keep the experts and the selection
# bias (state, not a parameter) as they change: a resume through the chain 6 -> 4 -> 2 is bit
# for bit, losses, bias range and final parameters and moments (a bias restored from step 2 or 4,
# or not at all, would change the bias range and the routing).
run chain --set train.steps=8 --set snapshot.every=2 --set snapshot.full_every=3 \
  --set snapshot.incremental_min_unchanged=0
check "[ \"\$(field $work/chain/metrics.jsonl snapshot_incremental | tr -dc 01)\" = 0110 ]" \
  "MoE snapshots at steps 2, 4, 6, 8: full, incremental, incremental, full"
"$titan3d" resume "$work/chain/snapshots/step_00000006.h5" --set run.dir="$work/chain.r" \
  --set snapshot.dir="$work/chain.r/snapshots" > "$work/chain.r.log" 2>&1
rc=$?
steps_with_bias() {  # steps_with_bias RUN: "loss bias_min bias_max" of each step
  paste -d' ' <(losses "$work/$1/metrics.jsonl") <(field "$work/$1/metrics.jsonl" router_bias_min) \
    <(field "$work/$1/metrics.jsonl" router_bias_max)
}
same_state() { h5diff "$work/chain/snapshots/step_00000008.h5" "$work/chain.r/snapshots/step_00000008.h5" "$1" "$1" > /dev/null; }
check "[ $rc -eq 0 ] && diff <(steps_with_bias chain | tail -2) <(steps_with_bias chain.r) && same_state /model && same_state /optim" \
  "resumed through the incremental chain: steps 7-8 (losses, bias range), parameters and moments bit for bit" ||
  tail -5 "$work/chain.r.log"

# --- 5. Using it; refusals. ---
snap=$work/reference/snapshots/step_00000050.h5
"$titan3d" eval "$snap" --batches 2 > "$work/eval.out" 2>&1
check "[ $? -eq 0 ] && grep -q loss $work/eval.out" "eval runs on a MoE snapshot" || tail -3 "$work/eval.out"
"$titan3d" generate "$snap" --prompt "The " --max-tokens 20 --seed 1 > "$work/gen.out" 2>&1
check "[ $? -eq 0 ] && [ \$(wc -c < $work/gen.out) -ge 20 ]" "generate runs on a MoE snapshot" || tail -3 "$work/gen.out"
"$titan3d" export "$snap" --out "$work/export" > "$work/export.out" 2>&1
rc=$?
check "[ $rc -eq 2 ] && grep -q 'model.router_bias_rate' $work/export.out" \
  "export refuses a MoE no Hugging Face family can hold (a selection bias), naming the key (rc $rc)"
# Each Hugging Face family: export, import, export again: the same bytes (fp32 and bf16); the
# import evaluates as the original (PyTorch's blocks agree: use_torch_crosscheck).
st() { /usr/bin/python3 "$repo/tests/use/safetensors_tool.py" "$@"; }
json_loss() { sed -E 's/.*"loss": ([^,}]+).*/\1/' "$1"; }
round_trip() {  # round_trip RUN FAMILY: RUN's step-10 snapshot exported as FAMILY into $work/RUN_hf_*
  local snap=$work/$1/snapshots/step_00000010.h5 dtype
  for dtype in fp32 bf16; do
    "$titan3d" export "$snap" --dtype $dtype --out "$work/$1_hf_$dtype" > /dev/null 2>&1 &&
      "$titan3d" import "$work/$1_hf_$dtype" --out "$work/$1_imp_$dtype" > "$work/$1_imp_$dtype.log" 2>&1 &&
      "$titan3d" export "$work/$1_imp_$dtype/step_00000000.h5" --dtype $dtype --out "$work/$1_hf2_$dtype" > /dev/null 2>&1
    check "[ \$? -eq 0 ] && st same $work/$1_hf_$dtype/model.safetensors $work/$1_hf2_$dtype/model.safetensors" \
      "$2 round trip ($dtype): export∘import∘export is bit-exact" || cat "$work/$1_imp_$dtype.log"
  done
  "$titan3d" eval "$snap" --data "$corpus" --batches 4 --json "$work/$1_e1.json" > /dev/null 2>&1
  "$titan3d" eval "$work/$1_imp_fp32/step_00000000.h5" --data "$corpus" --batches 4 --json "$work/$1_e2.json" > /dev/null 2>&1
  local original imported
  original=$(json_loss "$work/$1_e1.json") imported=$(json_loss "$work/$1_e2.json")
  check "[ -n '$original' ] && [ '$original' = '$imported' ]" \
    "the imported $2's eval equals the original's ($original, $imported)"
}
# One micro-batch, as the import records: eval then runs the same GEMM shapes on both.
run mixtral --set model.n_shared_experts=0 --set model.dense_layers=0 --set model.router_bias_rate=0 \
  --set train.steps=10 --set snapshot.every=10 --set train.micro_batches=1
round_trip mixtral Mixtral
check "grep -q '\"model_type\": \"mixtral\"' $work/mixtral_hf_fp32/config.json && grep -q '\"num_local_experts\": 4' $work/mixtral_hf_fp32/config.json" \
  "the export is Mixtral's config"
# Qwen2-MoE's layout for the shared experts and the dense first block (no selection bias); its
# zero biases and gates are imported as the model without them, a nonzero one as the model with
# them (model.qkv_bias, model.shared_expert_gate), said in the import's notes.
run qwen2 --set model.router_bias_rate=0 --set model.router_norm_topk=false --set train.steps=10 \
  --set snapshot.every=10 --set train.micro_batches=1
round_trip qwen2 Qwen2-MoE
check "grep -q '\"model_type\": \"qwen2_moe\"' $work/qwen2_hf_fp32/config.json && grep -q '\"mlp_only_layers\": \[0\]' $work/qwen2_hf_fp32/config.json && grep -q '\"norm_topk_prob\": false' $work/qwen2_hf_fp32/config.json" \
  "the export is Qwen2-MoE's config (block 0 dense, unnormalised gates)"
for part in self_attn.q_proj.bias mlp.shared_expert_gate.weight; do
  mkdir -p "$work/qbad_$part" && cp "$work/qwen2_hf_fp32/config.json" "$work/qbad_$part/"
  st set "$work/qwen2_hf_fp32/model.safetensors" "$work/qbad_$part/model.safetensors" "model.layers.1.$part" 3 0.5
  "$titan3d" import "$work/qbad_$part" --out "$work/qbad_imp_$part" > "$work/qbad_$part.log" 2>&1
  rc=$?
  option=$([ "$part" = self_attn.q_proj.bias ] && echo model.qkv_bias || echo model.shared_expert_gate)
  check "[ $rc -eq 0 ] && grep -q '$option = true' $work/qbad_$part.log" \
    "import takes a Qwen2-MoE whose $part is not zero as $option = true (rc $rc)" || cat "$work/qbad_$part.log"
done
refused() {  # refused KEY [--set ...]: exit 2 naming KEY
  local key=$1; shift
  "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir="$work/refused" "$@" \
    > "$work/refused.log" 2>&1
  local rc=$?
  check "[ $rc -eq 2 ] && grep -q '$key' $work/refused.log" "refused, naming $key: $* (rc $rc)" ||
    tail -3 "$work/refused.log"
}
refused model.experts_per_token --set model.experts_per_token=5
refused model.dense_layers --set model.dense_layers=4
refused model.router_score --set model.router_score=relu
refused parallel.tp --set parallel.tp=2 --set model.moe_ffn_dim=33
refused model.router_aux_coef --set parallel.cp=2
refused model.n_experts --set model.n_experts=-1
refused model.capacity_factor --set model.capacity_factor=-0.5
# Another top-k on resume: allowed (no tensor changes), and said once, naming the key.
"$titan3d" resume "$snap" --set model.experts_per_token=1 --set train.steps=51 \
  --set run.dir="$work/topk1" --set run.log_level=warn > "$work/topk1.log" 2>&1
check "[ \$? -eq 0 ] && [ \$(grep -c 'another model function: model.experts_per_token: 2 in the snapshot, 1 in this run' $work/topk1.log) -eq 1 ]" \
  "a resume with another experts_per_token runs and says so once" || tail -3 "$work/topk1.log"

# --- 6. Capacity factor. ---
# Rows per micro-batch: 8 / 2 = 4 sequences on 1 rank, 8 / (2 · 1) on dp2 with 1 micro-batch.
cap=(--set model.capacity_factor=1)
run cap "${cap[@]}"
check "field $work/cap/metrics.jsonl dropped_slots | awk '\$1 <= 0 { bad = 1 } END { exit bad || NR != $steps }'" \
  "capacity 1: every step drops slots (dropped_slots > 0)"
check "! diff <(losses $work/reference/metrics.jsonl) <(losses $work/cap/metrics.jsonl) > /dev/null" \
  "capacity 1: the losses differ from the dropless run's"
for layout in "cap_dp2 --set parallel.dp=2 --set train.micro_batches=1" \
              "cap_tp2_sp --set parallel.tp=2 --set parallel.sequence_parallel=true" \
              "cap_pp2 --set parallel.pp=2"; do
  # shellcheck disable=SC2086
  run $layout "${cap[@]}"
  within "${layout%% *}" cap 1e-5
done
step1_load() {  # step1_load RUN: step 1's load fields (summed over dp, gathered over pp)
  head -1 "$work/$1/metrics.jsonl" | grep -oE '"(dropped_slots|expert_imbalance_layer_[0-9]+|idle_experts_layer_[0-9]+)": [^,}]*'
}
check "[ \"\$(step1_load cap_dp2)\" = \"\$(step1_load cap)\" ] && [ \"\$(step1_load cap_pp2)\" = \"\$(step1_load cap)\" ]" \
  "step 1's dropped slots and per-layer load: dp2 and pp2 report 1 rank's"
run cap_recompute "${cap[@]}" --set train.activation_checkpoint=full
check "diff <(losses $work/cap/metrics.jsonl) <(losses $work/cap_recompute/metrics.jsonl) > /dev/null" \
  "capacity with activation checkpointing: the same losses, bit for bit (the same slots drop)"
# Capacity 0.5: ceil(0.5 · 128 · 2 / 4) = 32 slots per expert of a micro-batch's 256, so at least
# 128 drop per micro-batch and block: 256 per step.
run cap_tight --set model.capacity_factor=0.5
check "field $work/cap_tight/metrics.jsonl dropped_slots | awk '\$1 < 256 { bad = 1 } END { exit bad || NR != $steps }'" \
  "capacity 0.5: each step drops at least 256 slots per block"
tight_last=$(losses "$work/cap_tight/metrics.jsonl" | tail -1)
check "awk -v a=$first -v b=$tight_last 'BEGIN { exit !(b < a - 1.0) }'" \
  "capacity 0.5: the model still learns: loss $first -> $tight_last"

# --- 7. Seeing it. ---
line=$(grep '"loss"' "$work/reference/metrics.jsonl" | tail -1)
for key in expert_imbalance_layer_1 expert_imbalance_layer_3 idle_experts_layer_1 \
           idle_experts_layer_3 router_bias_min router_bias_max dropped_slots; do
  check "grep -q '\"$key\": [0-9.e-]' <<<'$line'" "metrics.jsonl reports $key"
done
check "! grep -q 'expert_imbalance_layer_0' <<<'$line'" "no per-layer load for the dense block 0"
check "awk -v lo=\$(field $work/reference/metrics.jsonl router_bias_min | tail -1) -v hi=\$(field $work/reference/metrics.jsonl router_bias_max | tail -1) 'BEGIN { exit !(lo < 0 && hi > 0 && hi <= 50 * 1e-3) }'" \
  "the router bias range spreads around 0 within rate · steps"
# The largest per-layer imbalance is the model's expert_imbalance, at every step.
largest_layer_is_model() {
  /usr/bin/python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "expert_imbalance" in m and m["expert_imbalance"] != max(
            v for k, v in m.items() if k.startswith("expert_imbalance_layer_")):
        sys.exit(1)
PY
}
check "largest_layer_is_model $work/reference/metrics.jsonl" \
  "expert_imbalance is the largest expert_imbalance_layer_<l> at every step"
check "grep -q '\"expert_imbalance_max\": [0-9]' $work/reference/summary.json" \
  "the end-of-run table (summary.json) shows the load imbalance"
# 8 experts, 1 per token, no balancing: the routers collapse within a few steps, experts go idle.
run collapsed --set model.router_bias_rate=0 --set model.router_aux_coef=0 --set model.n_experts=8 \
  --set model.experts_per_token=1
check "grep -qE 'MoE layer [1-3] \(20 steps since step [0-9]+\): some of its experts got no token' $work/collapsed.log" \
  "a router that leaves experts idle for 20 steps: the trainer warns" ||
  field "$work/collapsed/metrics.jsonl" idle_experts_layer_1 | tr '\n' ' '
selfcheck() {  # selfcheck NAME [--set ...]: titan3d selfcheck on that run's recipe
  local name=$1; shift
  "$titan3d" selfcheck "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir="$work/$name" \
    "$@" --quick > "$work/$name.selfcheck" 2>&1
}
selfcheck collapsed --set model.router_bias_rate=0 --set model.router_aux_coef=0 \
  --set model.n_experts=8 --set model.experts_per_token=1
check "[ $? -eq 0 ] && grep -E '^experts +run +50 steps +WARN +MoE layers? [1-3] \([0-9]+ steps since step [0-9]+\).*got no token' $work/collapsed.selfcheck" \
  "selfcheck on the collapsed run flags its layer (a warning, exit 0)" || tail -5 "$work/collapsed.selfcheck"
selfcheck reference
check "[ $? -eq 0 ] && grep -E '^experts +run +50 steps +OK +no MoE layer had idle experts' $work/reference.selfcheck" \
  "selfcheck on the balanced run: experts OK" || grep -E '^experts' "$work/reference.selfcheck"
exit $fail
