#!/usr/bin/env bash
# The families past LLaMA's own that import maps exactly: Qwen3 (Qwen3ForCausalLM: per-head q/k RMSNorm, head_dim 24 while hidden_size / num_attention_heads
# is 16, untied and tied), Qwen3-MoE (Qwen3MoeForCausalLM: a dense first block as
# mlp_only_layers [0], 4 experts, no shared expert, norm_topk_prob true and false) and Qwen2-MoE
# (Qwen2MoeForCausalLM: q/k/v biases, a shared expert behind a nonzero sigmoid gate), written by
# numpy from the families' definitions (safetensors_tool.py qwen3, qwen3_moe, qwen2_moe) and
# imported:
#  - titan3d eval in fp32, on one rank and on tp2, equals PyTorch's float64 forward of the
#    definition (torch_eval.py) within 1e-6 relative;
#  - the re-export's tensors are the written ones bit for bit, in the same family;
#  - greedy generate (the KV-cache decoder) appends the tokens PyTorch's greedy decoding does;
#  - the import fine-tunes 20 fp32 steps on 1 rank and on pp2×dp2×tp2 (and ep2 for the MoE; with
#    and without sequence parallelism for Qwen2-MoE) with the same losses within 1e-5 relative
#    (import.sh's Llama 3.x tolerance);
#  - the Qwen2-MoE fine-tune also under zb_h1 (the gate's gradient in W) and with every block
#    recomputed; Qwen3, Qwen3-MoE and Qwen2-MoE fine-tune 20 steps in bf16 on pp2×dp2×tp2 (ep2)
#    within 1e-3 of the 1-rank bf16 losses (docs/parallelism.md's bf16 layout tolerance);
#  - config keys titan3d cannot represent are exit 2 naming the file and the key;
#  - a Mistral (MistralForCausalLM, sliding_window null) imports as LLaMA's block: eval within
#    1e-6 of PyTorch's, greedy tokens equal, exported back as LlamaForCausalLM with the same tensors
#    bit for bit; a sliding window is refused naming it.
# Skips loudly (exit 77) when Debian's python3-torch is missing.
set -u
py=/usr/bin/python3
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "SKIPPED (loudly): torch is not installed for $py; apt-get install python3-torch to run this check"
  exit 77
fi
source "$(dirname "$0")/common.sh"
st() { "$py" "$(dirname "$0")/safetensors_tool.py" "$@"; }
head -c 20100 "$corpus" >"$work/part.txt"

for model in "qwen3" "qwen3 tied" "qwen3_moe" "qwen3_moe unnormalised"; do
  name=${model// /_}
  case $model in
    qwen3) what="Qwen3 (untied)" ;;
    "qwen3 tied") what="Qwen3 (tied)" ;;
    qwen3_moe) what="Qwen3-MoE (norm_topk_prob true)" ;;
    *) what="Qwen3-MoE (norm_topk_prob false)" ;;
  esac
  hf=$work/$name
  read -ra writer <<<"$model"
  st "${writer[0]}" "$hf" "${writer[@]:1}"
  check_family "$hf" "$name" "$what" 'of width 24'
done

# Fine-tunes: 20 fp32 steps of an import on 1 rank and on 8 ranks, the same losses.
tune() {  # IMPORT NAME [--set ...]: 20 steps of $work/IMPORT_imp into $work/NAME
  local from=$1 name=$2
  shift 2
  "$titan3d" resume "$work/${from}_imp/step_00000000.h5" --set train.steps=20 --set hardware.gemm=openblas \
    --set snapshot.every=0 --set run.log_level=warn --set run.dir="$work/$name" "$@" >"$work/$name.log" 2>&1
}
eight=(--set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2)
tune qwen3 q3ft1
check "[ \$? -eq 0 ]" "fine-tune the Qwen3 import on 1 rank" || cat "$work/q3ft1.log"
tune qwen3 q3ft8 "${eight[@]}"
check "[ \$? -eq 0 ] && same_losses $work/q3ft8/metrics.jsonl $work/q3ft1/metrics.jsonl 1e-5" \
  "the Qwen3 fine-tune on pp=2 dp=2 tp=2 has the 1-rank losses (q/k norms' gradients summed over tp)" ||
  cat "$work/q3ft8.log"
tune qwen3_moe m3ft1
check "[ \$? -eq 0 ]" "fine-tune the Qwen3-MoE import on 1 rank" || cat "$work/m3ft1.log"
tune qwen3_moe m3ft8 "${eight[@]}" --set parallel.ep=2
check "[ \$? -eq 0 ] && same_losses $work/m3ft8/metrics.jsonl $work/m3ft1/metrics.jsonl 1e-5" \
  "the Qwen3-MoE fine-tune on pp=2 dp=2 tp=2 ep=2 has the 1-rank losses" || cat "$work/m3ft8.log"

# Qwen2-MoE as Qwen's own checkpoints are: nonzero q/k/v biases and a nonzero sigmoid gate on the
# shared expert (model.qkv_bias, model.shared_expert_gate); the same checks, and a fine-tune on
# pp2×dp2×tp2×ep2 with the 1-rank losses (the gate's gradient summed over tp where the math needs).
st qwen2_moe "$work/qwen2_moe"
check_family "$work/qwen2_moe" qwen2_moe "Qwen2-MoE (gated shared expert, q/k/v biases)" \
  'model.shared_expert_gate = true'
tune qwen2_moe m2ft1
check "[ \$? -eq 0 ]" "fine-tune the Qwen2-MoE import on 1 rank" || cat "$work/m2ft1.log"
tune qwen2_moe m2ft8 "${eight[@]}" --set parallel.ep=2
check "[ \$? -eq 0 ] && same_losses $work/m2ft8/metrics.jsonl $work/m2ft1/metrics.jsonl 1e-5" \
  "the Qwen2-MoE fine-tune on pp=2 dp=2 tp=2 ep=2 has the 1-rank losses" || cat "$work/m2ft8.log"
tune qwen2_moe m2ft8sp "${eight[@]}" --set parallel.ep=2 --set parallel.sequence_parallel=true
check "[ \$? -eq 0 ] && same_losses $work/m2ft8sp/metrics.jsonl $work/m2ft1/metrics.jsonl 1e-5" \
  "the Qwen2-MoE fine-tune on pp=2 dp=2 tp=2 ep=2 with sequence parallelism has the 1-rank losses" ||
  cat "$work/m2ft8sp.log"
# The gate's weight gradient left to W (zero-bubble: from the dz B kept), and recomputed blocks.
tune qwen2_moe m2zb --set parallel.pp=2 --set parallel.tp=2 --set parallel.schedule=zb_h1 \
  --set train.micro_batches=4
check "[ \$? -eq 0 ] && same_losses $work/m2zb/metrics.jsonl $work/m2ft1/metrics.jsonl 1e-5" \
  "the Qwen2-MoE fine-tune on pp=2 tp=2 under zb_h1 has the 1-rank losses" || cat "$work/m2zb.log"
tune qwen2_moe m2ck "${eight[@]}" --set parallel.ep=2 --set train.activation_checkpoint=full
check "[ \$? -eq 0 ] && same_losses $work/m2ck/metrics.jsonl $work/m2ft1/metrics.jsonl 1e-5" \
  "the Qwen2-MoE fine-tune on pp=2 dp=2 tp=2 ep=2 with every block recomputed has the 1-rank losses" ||
  cat "$work/m2ck.log"

# bf16 fine-tunes (train.precision = bf16, oneDNN's bf16 GEMMs): 20 steps on pp2×dp2×tp2 (ep2 for
# the MoE) within 1e-3 relative of the 1-rank bf16 run, the layout tolerance docs/parallelism.md
# states for bf16. Skipped on a CPU whose oneDNN has no bf16 GEMM (no AVX-512).
bf16=(--set train.precision=bf16 --set hardware.gemm=onednn)
if tune qwen3 bf16probe "${bf16[@]}" --set train.steps=1; then
  for model in qwen3 qwen3_moe qwen2_moe; do
    ep=()
    [ "$model" != qwen3 ] && ep=(--set parallel.ep=2)
    tune "$model" "${model}_bf1" "${bf16[@]}"
    check "[ \$? -eq 0 ]" "fine-tune the $model import in bf16 on 1 rank" || cat "$work/${model}_bf1.log"
    tune "$model" "${model}_bf8" "${bf16[@]}" "${eight[@]}" "${ep[@]}"
    check "[ \$? -eq 0 ] && same_losses $work/${model}_bf8/metrics.jsonl $work/${model}_bf1/metrics.jsonl 1e-3" \
      "the $model bf16 fine-tune on pp=2 dp=2 tp=2 ${ep[*]:+ep=2 }has the 1-rank bf16 losses (1e-3)" ||
      cat "$work/${model}_bf8.log"
  done
else
  grep -q "oneDNN cannot run" "$work/bf16probe.log" || { echo "FAIL: bf16 probe"; cat "$work/bf16probe.log"; fail=1; }
  echo "SKIPPED (loudly): no bf16 GEMM on this CPU: the bf16 fine-tunes are not checked"
fi

# Refusals: exit 2 naming config.json and the key.
refuse_set() {  # MODEL KEY VALUE: MODEL's config.json with KEY set to VALUE (added if absent)
  rm -rf "$work/bad" "$work/badout"
  mkdir -p "$work/bad"
  ln -s "$work/$1/model.safetensors" "$work/bad/"
  "$py" -c 'import json, sys; c = json.load(open(sys.argv[1])); c[sys.argv[2]] = json.loads(sys.argv[3]); json.dump(c, open(sys.argv[4], "w"))' \
    "$work/$1/config.json" "$2" "$3" "$work/bad/config.json"
  "$titan3d" import "$work/bad" --out "$work/badout" >"$work/r.log" 2>&1
  check "[ \$? -eq 2 ] && grep -q 'config.json: \`$2\`' $work/r.log" "$1: refused naming the file: $2 = $3" || cat "$work/r.log"
}
refuse_set qwen3 use_sliding_window true
refuse_set qwen3 layer_types '["full_attention", "sliding_attention"]'
refuse_set qwen3 attention_bias true
refuse_set qwen3 rope_scaling '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}'
refuse_set qwen3 some_new_key 1
refuse_set qwen3_moe mlp_only_layers '[1]'
refuse_set qwen3_moe decoder_sparse_step 2
refuse_set qwen3_moe shared_expert_intermediate_size 32

# Mistral: LLaMA's block without a sliding window.
st mistral "$work/mistral"
"$titan3d" import "$work/mistral" --out "$work/mistral_imp" >"$work/mistral_imp.log" 2>&1
check "[ \$? -eq 0 ]" "import a Mistral (sliding_window null)" || cat "$work/mistral_imp.log"
snap=$work/mistral_imp/step_00000000.h5
"$py" "$(dirname "$0")/torch_eval.py" "$work/mistral" "$work/part.txt" >"$work/mistral_torch.json" 2>"$work/torch.err"
"$titan3d" eval "$snap" --data "$work/part.txt" --json "$work/mistral_eval.json" >"$work/eval.log" 2>&1
check "rel_close \$(json_loss $work/mistral_eval.json) \$(json_loss $work/mistral_torch.json) 1e-6" \
  "Mistral: titan3d eval (fp32) equals PyTorch's forward of the definition (rel 1e-6)" || cat "$work/torch.err" "$work/eval.log"
"$titan3d" export "$snap" --out "$work/mistral_out" >/dev/null 2>&1
check "st same $work/mistral/model.safetensors $work/mistral_out/model.safetensors && grep -q '\"LlamaForCausalLM\"' $work/mistral_out/config.json" \
  "Mistral: exported as LlamaForCausalLM, the tensors the file's bit for bit"
"$titan3d" generate "$snap" --prompt "The " --max-tokens 24 --temperature 0 >"$work/gen.txt" 2>"$work/gen.err"
"$py" "$(dirname "$0")/torch_eval.py" "$work/mistral" --greedy "The " 24 >"$work/greedy.json" 2>"$work/torch.err"
check "greedy_agrees $work/gen.txt $work/greedy.json 'The '" \
  "Mistral: greedy generate equals PyTorch's greedy tokens of the definition" || cat "$work/gen.err" "$work/torch.err"
refuse_set mistral sliding_window 4096
exit $fail
