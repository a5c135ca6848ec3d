#!/usr/bin/env bash
# `titan3d import` (docs/tokenizers-and-import.md) against `titan3d export` and an independent
# numpy safetensors reader / writer (safetensors_tool.py):
#  - import∘export is bit-exact for fp32 (untied with GQA, and tied), and for a sharded directory
#    (model.safetensors.index.json); the imported model evaluates exactly as the original;
#  - bf16: export --dtype bf16 rounds to nearest even, import widens exactly; F16 likewise;
#  - the imported snapshot fine-tunes with `titan3d resume` on another layout (tp2), starting
#    from the imported weights, not from scratch;
#  - a Llama 3.x (RoPE scaling, explicit head_dim) round-trips bit for bit, sharded in and out
#    (export --max-shard-mb) and in bf16, and fine-tunes on pp2×dp2×tp2 and cp2×dp2×tp2 with the
#    1-rank losses; a Qwen2.5 (q/k/v biases) fine-tunes on cp2×dp2×tp2 likewise; both also in
#    bf16 within 1e-3 of the 1-rank bf16 losses (skipped without bf16 GEMMs);
#  - every config key titan3d cannot represent is exit 2 naming it.
# (The PyTorch cross-check of eval on an imported model is in torch_crosscheck.sh.)
set -u
source "$(dirname "$0")/common.sh"
py=/usr/bin/python3
st() { "$py" "$(dirname "$0")/safetensors_tool.py" "$@"; }

# The original trains on the GEMM an import evaluates with (an import records no measured choice:
# eval runs it on openblas-fp32), so "eval equals" compares the weights, not two kernels' rounding.
"$titan3d" train "${tiny[@]}" --set hardware.gemm=openblas --set train.steps=10 --set train.val_every=0 \
  --set snapshot.every=10 --set run.dir="$work/run" >"$work/train.log" 2>&1
check "[ \$? -eq 0 ]" "train tiny (GQA, untied)" || cat "$work/train.log"
snap=$work/run/snapshots/step_00000010.h5
"$titan3d" export "$snap" --out "$work/hf" >/dev/null 2>&1
"$titan3d" import "$work/hf" --out "$work/imp" >"$work/imp.log" 2>&1
check "[ \$? -eq 0 ] && [ -s $work/imp/step_00000000.h5 ]" "import the export" || cat "$work/imp.log"
sed 's/^/  /' "$work/imp.log"
"$titan3d" export "$work/imp/step_00000000.h5" --out "$work/hf2" >/dev/null 2>&1
check "st same $work/hf/model.safetensors $work/hf2/model.safetensors" "import∘export is bit-exact (fp32)"
check "grep -q '\"num_key_value_heads\": 2' $work/hf2/config.json" "the imported config keeps GQA"
head -c 20100 "$corpus" >"$work/part.txt"
"$titan3d" eval "$snap" --data "$work/part.txt" --json "$work/e1.json" >/dev/null 2>&1
"$titan3d" eval "$work/imp/step_00000000.h5" --data "$work/part.txt" --json "$work/e2.json" >"$work/e2.log" 2>&1
check "[ \"\$(json_loss $work/e1.json)\" = \"\$(json_loss $work/e2.json)\" ]" \
  "the imported model's eval equals the original's ($(json_loss "$work/e1.json"))" || cat "$work/e2.log"

# Sharded: the same tensors in 3 files and an index.
st shard "$work/hf/model.safetensors" "$work/sharded" 3 && cp "$work/hf/config.json" "$work/sharded/"
"$titan3d" import "$work/sharded" --out "$work/imp_sh/step_00000000.h5" >"$work/sh.log" 2>&1
"$titan3d" export "$work/imp_sh/step_00000000.h5" --out "$work/hf_sh" >/dev/null 2>&1
check "grep -q 'from 3 file' $work/sh.log && st same $work/hf/model.safetensors $work/hf_sh/model.safetensors" \
  "a sharded directory imports bit-exactly" || cat "$work/sh.log"

# bf16 out and in; F16 in.
"$titan3d" export "$snap" --out "$work/hf16" --dtype bf16 >/dev/null 2>&1
check "st bf16of $work/hf/model.safetensors $work/hf16/model.safetensors && grep -q bfloat16 $work/hf16/config.json" \
  "export --dtype bf16 rounds every weight to nearest even"
"$titan3d" import "$work/hf16" --out "$work/imp16" >/dev/null 2>&1
"$titan3d" export "$work/imp16/step_00000000.h5" --out "$work/hf16b" >/dev/null 2>&1
check "st widened $work/hf16/model.safetensors $work/hf16b/model.safetensors" "a bf16 import converts exactly"
mkdir -p "$work/hff16" && cp "$work/hf/config.json" "$work/hff16/" && st f16 "$work/hf/model.safetensors" "$work/hff16/model.safetensors"
"$titan3d" import "$work/hff16" --out "$work/impf16" >/dev/null 2>&1
"$titan3d" export "$work/impf16/step_00000000.h5" --out "$work/hff16b" >/dev/null 2>&1
check "st widened $work/hff16/model.safetensors $work/hff16b/model.safetensors" "an fp16 import converts exactly"

# Tied embeddings.
"$titan3d" train "${tiny[@]}" --set model.tie_embeddings=true --set train.steps=2 --set train.val_every=0 \
  --set snapshot.every=2 --set run.dir="$work/tied" >/dev/null 2>&1
"$titan3d" export "$work/tied/snapshots/step_00000002.h5" --out "$work/hft" >/dev/null 2>&1
"$titan3d" import "$work/hft" --out "$work/impt" >"$work/t.log" 2>&1
"$titan3d" export "$work/impt/step_00000000.h5" --out "$work/hft2" >/dev/null 2>&1
check "grep -q 'tied embeddings' $work/t.log && st same $work/hft/model.safetensors $work/hft2/model.safetensors" \
  "tied embeddings import bit-exactly" || cat "$work/t.log"

# Fine-tune the import on tp2: the first loss is the trained model's, far below a fresh start's.
# As the docs' example: run.dir set, snapshot.every not; a GEMM pinned (the import trained none).
"$titan3d" resume "$work/imp/step_00000000.h5" --set train.steps=4 --set parallel.tp=2 \
  --set hardware.gemm=openblas --set run.log_level=warn --set run.dir="$work/ft" >"$work/ft.log" 2>&1
check "[ \$? -eq 0 ]" "resume the import on tp2 (fine-tune)" || cat "$work/ft.log"
check "grep -q 'snapshot.every = 100' $work/imp.log && [ -f $work/ft/snapshots/step_00000004.h5 ] && [ ! runs/hf/snapshots/step_00000004.h5 -nt $work/imp.log ]" \
  "the fine-tune saves its last step into <run.dir>/snapshots (import sets snapshot.every; run.dir is not frozen)" ||
  { ls -R "$work/ft" | head -20; ls runs 2>/dev/null; }
check "! grep -q 'bit-identical' $work/ft.log" \
  "a GEMM set on the fine-tune of an import is not warned about (no run to continue bit for bit)" || cat "$work/ft.log"
loss_at() { grep "\"step\": $2," "$1" | head -1 | sed -E 's/.*"loss": ([^,]+),.*/\1/'; }
fresh=$(loss_at "$work/run/metrics.jsonl" 1); tuned=$(loss_at "$work/ft/metrics.jsonl" 1)
check "[ -n \"$fresh\" ] && [ -n \"$tuned\" ] && awk -v f=$fresh -v t=$tuned 'BEGIN { exit !(t + 0 < f - 0.5) }'" \
  "fine-tuning starts from the imported weights (first loss $tuned, fresh $fresh)"

# Llama 3.x as released (safetensors_tool.py llama3: rope_scaling of rope_type llama3, head_dim 24
# while hidden_size / num_attention_heads is 16): import∘export keeps every tensor bit for bit and
# writes rope_scaling and head_dim back as they were; from 3 shards too; bf16 out and in again
# bit for bit. (Its PyTorch forward and greedy tokens: torch_crosscheck.sh.)
st llama3 "$work/l3"
"$titan3d" import "$work/l3" --out "$work/l3imp" >"$work/l3.log" 2>&1
check "[ \$? -eq 0 ] && grep -q 'of width 24' $work/l3.log && grep -q 'rope_scaling = \"llama3\", rope_factor = 8' $work/l3.log" \
  "import a Llama 3.x (llama3 RoPE scaling, head_dim 24)" || cat "$work/l3.log"
"$titan3d" export "$work/l3imp/step_00000000.h5" --out "$work/l3out" >/dev/null 2>&1
same_config() {  # A B KEY...: config.json A and B have equal values under every KEY
  "$py" -c 'import json, sys; a, b = (json.load(open(f + "/config.json")) for f in sys.argv[1:3]); sys.exit(any(a[k] != b[k] for k in sys.argv[3:]))' "$@"
}
check "st same $work/l3/model.safetensors $work/l3out/model.safetensors && same_config $work/l3 $work/l3out rope_scaling head_dim rope_theta tie_word_embeddings num_key_value_heads" \
  "Llama 3.x: import∘export is bit-exact, rope_scaling and head_dim written back" || cat "$work/l3out/config.json"
st shard "$work/l3/model.safetensors" "$work/l3sh" 3 && cp "$work/l3/config.json" "$work/l3sh/"
"$titan3d" import "$work/l3sh" --out "$work/l3shimp" >"$work/l3sh.log" 2>&1
"$titan3d" export "$work/l3shimp/step_00000000.h5" --out "$work/l3shout" >/dev/null 2>&1
check "grep -q 'from 3 file' $work/l3sh.log && st same $work/l3/model.safetensors $work/l3shout/model.safetensors" \
  "Llama 3.x from 3 shards imports bit-exactly" || cat "$work/l3sh.log"
# Sharded out: export --max-shard-mb writes model-0000i-of-0000N.safetensors and their index,
# which import reads back bit for bit; an export of the other form into that directory is refused.
"$titan3d" export "$work/l3imp/step_00000000.h5" --out "$work/l3shx" --max-shard-mb 0.1 >"$work/l3shx.log" 2>&1
shards=$(ls "$work/l3shx" | grep -c '^model-0000[0-9]-of-0000[0-9].safetensors$')
"$titan3d" import "$work/l3shx" --out "$work/l3shximp" >/dev/null 2>&1
"$titan3d" export "$work/l3shximp/step_00000000.h5" --out "$work/l3shxout" >/dev/null 2>&1
check "[ $shards -gt 2 ] && [ ! -e $work/l3shx/model.safetensors ] && grep -q 'in $shards shards' $work/l3shx.log && st same $work/l3/model.safetensors $work/l3shxout/model.safetensors" \
  "export --max-shard-mb 0.1 writes $shards shards and an index that import reads bit-exactly" || { cat "$work/l3shx.log"; ls "$work/l3shx"; }
"$titan3d" export "$work/l3imp/step_00000000.h5" --out "$work/l3shx" >"$work/o.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'model.safetensors.index.json' $work/o.log && [ ! -e $work/l3shx/model.safetensors ]" \
  "a one-file export over a sharded one is refused" || cat "$work/o.log"
"$titan3d" export "$work/l3imp/step_00000000.h5" --out "$work/l3b" --dtype bf16 >/dev/null 2>&1
"$titan3d" import "$work/l3b" --out "$work/l3bimp" >/dev/null 2>&1
"$titan3d" export "$work/l3bimp/step_00000000.h5" --out "$work/l3b2" --dtype bf16 >/dev/null 2>&1
check "st bf16of $work/l3/model.safetensors $work/l3b/model.safetensors && st same $work/l3b/model.safetensors $work/l3b2/model.safetensors && same_config $work/l3 $work/l3b2 rope_scaling head_dim" \
  "Llama 3.x in bf16: export rounds, import∘export keeps the bf16 bits"

# The Llama 3.x import fine-tunes 20 steps (fp32) on 1 rank and on pp2×dp2×tp2 and cp2×dp2×tp2 with
# the same losses within 1e-5 relative (train_equivalence.sh's fp32 tolerance: only the order of
# additions differs): head_dim 24 split by tp, the scaled RoPE table at cp's positions.
tune() {  # NAME [--set ...]: 20 steps of the import ${tune_from:-$work/l3imp} into $work/NAME
  local name=$1
  shift
  "$titan3d" resume "${tune_from:-$work/l3imp}/step_00000000.h5" --set train.steps=20 --set hardware.gemm=openblas \
    --set snapshot.every=0 --set run.log_level=warn --set run.dir="$work/$name" "$@" >"$work/$name.log" 2>&1
}
tune l3ft1
check "[ \$? -eq 0 ]" "fine-tune the Llama 3.x import on 1 rank" || cat "$work/l3ft1.log"
for layout in "pp=2 dp=2 tp=2" "cp=2 dp=2 tp=2"; do
  sets=()
  for kv in $layout; do sets+=(--set "parallel.$kv"); done
  tune l3ft8 "${sets[@]}"
  check "[ \$? -eq 0 ] && same_losses $work/l3ft8/metrics.jsonl $work/l3ft1/metrics.jsonl 1e-5" \
    "the Llama 3.x fine-tune on $layout has the 1-rank losses" || cat "$work/l3ft8.log"
  rm -rf "$work/l3ft8"
done
# A Qwen2.5 (q/k/v biases, tied; safetensors_tool.py qwen2) likewise on cp2×dp2×tp2: tp splits the
# biases with the heads. (Tied embeddings on pp > 1 need zb_v, which needs 4 layers.)
st qwen2 "$work/q2"
"$titan3d" import "$work/q2" --out "$work/q2imp" >"$work/q2.log" 2>&1
check "[ \$? -eq 0 ]" "import a Qwen2.5 (q/k/v biases, tied)" || cat "$work/q2.log"
tune_from=$work/q2imp tune q2ft1
tune_from=$work/q2imp tune q2ft8 --set parallel.cp=2 --set parallel.dp=2 --set parallel.tp=2
check "same_losses $work/q2ft8/metrics.jsonl $work/q2ft1/metrics.jsonl 1e-5" \
  "the Qwen2.5 fine-tune on cp=2 dp=2 tp=2 has the 1-rank losses" || cat "$work/q2ft8.log"
# Both in bf16 (train.precision = bf16, oneDNN's bf16 GEMMs): the 8-rank fine-tunes within 1e-3 of
# the 1-rank bf16 losses, docs/parallelism.md's bf16 layout tolerance. Skipped on a CPU whose
# oneDNN has no bf16 GEMM (no AVX-512).
bf16=(--set train.precision=bf16 --set hardware.gemm=onednn)
if tune bf16probe "${bf16[@]}" --set train.steps=1; then
  tune l3bf1 "${bf16[@]}"
  tune l3bf8 "${bf16[@]}" --set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2
  check "[ \$? -eq 0 ] && same_losses $work/l3bf8/metrics.jsonl $work/l3bf1/metrics.jsonl 1e-3" \
    "the Llama 3.x bf16 fine-tune on pp=2 dp=2 tp=2 has the 1-rank bf16 losses (1e-3)" ||
    cat "$work/l3bf1.log" "$work/l3bf8.log"
  tune_from=$work/q2imp tune q2bf1 "${bf16[@]}"
  tune_from=$work/q2imp tune q2bf8 "${bf16[@]}" --set parallel.cp=2 --set parallel.dp=2 \
    --set parallel.tp=2
  check "[ \$? -eq 0 ] && same_losses $work/q2bf8/metrics.jsonl $work/q2bf1/metrics.jsonl 1e-3" \
    "the Qwen2.5 bf16 fine-tune on cp=2 dp=2 tp=2 has the 1-rank bf16 losses (1e-3)" ||
    cat "$work/q2bf1.log" "$work/q2bf8.log"
else
  grep -q "oneDNN cannot run" "$work/bf16probe.log" || { echo "FAIL: bf16 probe"; cat "$work/bf16probe.log"; fail=1; }
  echo "SKIPPED (loudly): no bf16 GEMM on this CPU: the bf16 fine-tunes are not checked"
fi

# Refusals: exit 2 naming the key.
refuse_set() {  # KEY VALUE: the export's config.json with KEY's line set to VALUE
  rm -rf "$work/bad" "$work/badout"; mkdir -p "$work/bad"; ln -s "$work/hf/model.safetensors" "$work/bad/"
  sed -E "s|^(  \"$1\": ).*|\1$2,|" "$work/hf/config.json" >"$work/bad/config.json"
  "$titan3d" import "$work/bad" --out "$work/badout" >"$work/r.log" 2>&1
  check "[ \$? -eq 2 ] && grep -q '\`$1\`' $work/r.log" "refused: $1 = $2" || { cat "$work/r.log"; cat "$work/bad/config.json"; }
}
refuse_set rope_scaling '{"rope_type": "yarn", "factor": 2.0}'
refuse_set attention_bias true
refuse_set mlp_bias true
refuse_set hidden_act '"gelu"'
refuse_set model_type '"gemma"'
refuse_set architectures '["MistralForCausalLM"]'
refuse_set head_dim 7
"$titan3d" import "$work/hf" --out "$work/x/model.h5" >"$work/o.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'step_00000000.h5' $work/o.log" "--out FILE.h5 must be DIR/step_00000000.h5" || cat "$work/o.log"
"$titan3d" import "$work/hf" --out "$work/imp" >"$work/o.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'already holds snapshots' $work/o.log" "--out over snapshots is refused" || cat "$work/o.log"
exit $fail
