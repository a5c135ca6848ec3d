#!/usr/bin/env bash
# The loss `titan3d eval` computes equals the one an independent PyTorch LLaMA (torch_eval.py:
# float64, its own safetensors parser, Hugging Face semantics) computes from `titan3d export`'s
# files, within 1e-4 relative: the exported weights, names, shapes and config are the model
# titan3d trained. The snapshot comes from a tp2×pp2 run (resharded into whole tensors) and is
# incremental (a chain of two). The exported files imported back (titan3d import) evaluate to the
# same loss on tp2. Mixtral, Qwen2-MoE and Llama 3.x checkpoints written in Hugging Face's layout
# are checked against PyTorch forwards of their definitions too (below). Skips loudly (exit 77)
# when Debian's python3-torch is missing.
set -u
py=/usr/bin/python3
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "SKIPPED (loudly): torch is not installed for $py; apt-get install python3-torch to run this check"
  exit 77
fi
source "$(dirname "$0")/common.sh"
"$titan3d" train "${tiny[@]}" --set parallel.tp=2 --set parallel.pp=2 --set train.steps=20 \
  --set train.val_every=0 --set snapshot.every=10 --set snapshot.full_every=2 --set snapshot.incremental_min_unchanged=0 \
  --set run.dir="$work/run" >"$work/train.log" 2>&1
check "[ \$? -eq 0 ]" "train tiny on tp2×pp2" || cat "$work/train.log"
snap=$work/run/snapshots/step_00000020.h5
"$titan3d" export "$snap" --out "$work/hf" >"$work/export.log" 2>&1
check "[ \$? -eq 0 ]" "export" || cat "$work/export.log"
# 628 windows: the last batch of `titan3d eval` is partial, its surplus rows ignored.
head -c 20100 "$corpus" >"$work/part.txt"
"$titan3d" eval "$snap" --data "$work/part.txt" --json "$work/eval.json" >"$work/eval.log" 2>&1
check "[ \$? -eq 0 ]" "titan3d eval" || cat "$work/eval.log"
"$py" "$(dirname "$0")/torch_eval.py" "$work/hf" "$work/part.txt" >"$work/torch.json" 2>"$work/torch.err"
check "[ \$? -eq 0 ]" "PyTorch eval of the exported files" || cat "$work/torch.err"
cat "$work/eval.json" "$work/torch.json" | sed 's/^/  /'
check "rel_close \$(json_loss $work/eval.json) \$(json_loss $work/torch.json) 1e-4" \
  "titan3d eval equals PyTorch's loss from the export (rel 1e-4)"
# The same files imported (titan3d import): eval of the imported snapshot on tp2 against PyTorch.
"$titan3d" import "$work/hf" --out "$work/imported" >"$work/import.log" 2>&1
check "[ \$? -eq 0 ]" "import the exported files" || cat "$work/import.log"
"$titan3d" eval "$work/imported/step_00000000.h5" --data "$work/part.txt" --set parallel.tp=2 \
  --json "$work/eval_imported.json" >"$work/eval_imported.log" 2>&1
check "[ \$? -eq 0 ]" "titan3d eval of the imported snapshot (tp2)" || cat "$work/eval_imported.log"
check "rel_close \$(json_loss $work/eval_imported.json) \$(json_loss $work/torch.json) 1e-4" \
  "titan3d eval of the imported model equals PyTorch's loss (rel 1e-4)"
# A mixture of experts in Mixtral's layout (docs/moe.md), trained on pp2 × dp2: the export is
# MixtralForCausalLM, and PyTorch's Mixtral block (torch_eval.py) evaluates it as titan3d does.
moe=(--set model.n_experts=4 --set model.experts_per_token=2 --set model.moe_ffn_dim=64)
"$titan3d" train "${tiny[@]}" "${moe[@]}" --set parallel.pp=2 --set parallel.dp=2 \
  --set train.steps=20 --set train.val_every=0 --set snapshot.every=20 --set run.dir="$work/moe" \
  >"$work/moe_train.log" 2>&1
check "[ \$? -eq 0 ]" "train a tiny Mixtral-style MoE on pp2 × dp2" || cat "$work/moe_train.log"
"$titan3d" export "$work/moe/snapshots/step_00000020.h5" --out "$work/hf_moe" >"$work/moe_export.log" 2>&1
check "[ \$? -eq 0 ] && grep -q MixtralForCausalLM $work/hf_moe/config.json" \
  "export writes Mixtral's config" || cat "$work/moe_export.log"
# torch_agrees NAME SNAPSHOT HF_DIR WHAT: titan3d eval of SNAPSHOT equals torch_eval.py of HF_DIR.
torch_agrees() {
  "$titan3d" eval "$2" --data "$work/part.txt" --json "$work/$1_eval.json" >"$work/$1_eval.log" 2>&1
  "$py" "$(dirname "$0")/torch_eval.py" "$3" "$work/part.txt" >"$work/$1_torch.json" 2>"$work/$1_torch.err"
  check "[ \$? -eq 0 ]" "PyTorch eval of $3" || cat "$work/$1_torch.err"
  cat "$work/$1_eval.json" "$work/$1_torch.json" | sed 's/^/  /'
  check "rel_close \$(json_loss $work/$1_eval.json) \$(json_loss $work/$1_torch.json) 1e-4" "$4 (rel 1e-4)"
}
torch_agrees moe "$work/moe/snapshots/step_00000020.h5" "$work/hf_moe" \
  "titan3d eval of the MoE equals PyTorch's Mixtral loss from the export"
# Shared experts (two experts wide) and a dense first block: the export is Qwen2MoeForCausalLM
# (zero q/k/v biases, zero shared-expert gates over a doubled down projection), and PyTorch's
# Qwen2-MoE block (torch_eval.py: biases added, sigmoid-gated shared expert, mlp_only_layers,
# unnormalised gates) evaluates it as titan3d does.
"$titan3d" train "${tiny[@]}" "${moe[@]}" --set model.n_layers=3 --set model.n_shared_experts=2 \
  --set model.dense_layers=1 --set model.router_norm_topk=false --set model.router_aux_coef=1e-2 \
  --set parallel.pp=2 --set parallel.dp=2 --set train.steps=20 --set train.val_every=0 \
  --set snapshot.every=20 --set run.dir="$work/qwen2" >"$work/qwen2_train.log" 2>&1
check "[ \$? -eq 0 ]" "train a tiny MoE with shared experts and a dense block on pp2 × dp2" ||
  cat "$work/qwen2_train.log"
"$titan3d" export "$work/qwen2/snapshots/step_00000020.h5" --out "$work/hf_qwen2" >"$work/qwen2_export.log" 2>&1
check "[ \$? -eq 0 ] && grep -q Qwen2MoeForCausalLM $work/hf_qwen2/config.json" \
  "export writes Qwen2-MoE's config" || cat "$work/qwen2_export.log"
torch_agrees qwen2 "$work/qwen2/snapshots/step_00000020.h5" "$work/hf_qwen2" \
  "titan3d eval of the MoE equals PyTorch's Qwen2-MoE loss from the export"
# A Mixtral written by an independent writer (numpy, Hugging Face's names), imported.
"$py" "$(dirname "$0")/safetensors_tool.py" mixtral "$work/hf_mixtral"
"$titan3d" import "$work/hf_mixtral" --out "$work/imp_mixtral" >"$work/imp_mixtral.log" 2>&1
check "[ \$? -eq 0 ] && grep -q 'router_aux_loss_coef' $work/imp_mixtral.log" \
  "import a Mixtral written by numpy (saying what it did not take)" || cat "$work/imp_mixtral.log"
torch_agrees mixtral "$work/imp_mixtral/step_00000000.h5" "$work/hf_mixtral" \
  "titan3d eval of the imported Mixtral equals PyTorch's on the writer's files"
# Llama 3.x as released (LlamaForCausalLM, rope_scaling of rope_type llama3, head_dim 24 while
# hidden_size / num_attention_heads is 16), untied and tied, and a Qwen2.5 (Qwen2ForCausalLM: q/k/v
# biases, tied), written by numpy from the families' definitions (safetensors_tool.py llama3,
# qwen2) and imported: titan3d eval in fp32 equals PyTorch's
# float64 forward of that definition (torch_eval.py: transformers' llama3 frequencies) within 1e-6
# relative, on one rank and on tp2; the re-export's tensors are the written ones bit for bit; and
# greedy generate (the KV-cache decoder) appends the tokens PyTorch's greedy decoding does.
for model in "llama3" "llama3 tied" "qwen2"; do
  name=${model// /_}
  case $model in
    llama3) what="Llama 3.x (untied)" ;;
    "llama3 tied") what="Llama 3.x (tied)" ;;
    qwen2) what="Qwen2.5 (q/k/v biases, tied)" ;;
  esac
  hf=$work/$name
  read -ra writer <<<"$model"
  "$py" "$(dirname "$0")/safetensors_tool.py" "${writer[0]}" "$hf" "${writer[@]:1}"
  check_family "$hf" "$name" "$what"
done
exit $fail
