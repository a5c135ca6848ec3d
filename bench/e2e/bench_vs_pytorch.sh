#!/usr/bin/env bash
# titan3d vs PyTorch (Debian's python3-torch) training the same LLaMA configuration on the same
# data with the same threads, fp32: tokens/s of each (median over steps, then over RUNS runs,
# interleaved so both see the same machine), their ratio, and titan3d's MFU.
#
# Both get OpenBLAS's SkylakeX kernels (titan3d picks them itself; PyTorch through the environment)
# and PyTorch passive OpenMP waiting: its OpenMP pool and OpenBLAS's otherwise spin against each
# other on two cores. Usage: bench/e2e/bench_vs_pytorch.sh [extra titan3d --set ...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-12} threads=${THREADS:-2}
dim=${DIM:-512} layers=${LAYERS:-8} heads=${HEADS:-8} seq=${SEQ:-256} batch=${BATCH:-8}
python=/usr/bin/python3  # Debian's interpreter: it sees python3-torch
$python -c "import torch" 2>/dev/null || { echo "needs Debian's python3-torch: apt-get install python3-torch"; exit 1; }
[ -s data/fortunes_train.bin ] || bash scripts/get_data.sh
coretype=${OPENBLAS_CORETYPE:-$("$repo/build/apps/titan3d" keys >/dev/null && echo SkylakeX)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
t_tok=() t_mfu=() p_tok=()
for i in $(seq "$runs"); do
  build/apps/titan3d train recipes/tiny.toml --set model.dim="$dim" --set model.n_layers="$layers" \
    --set model.n_heads="$heads" --set model.n_kv_heads="$heads" --set model.seq_len="$seq" \
    --set train.global_batch="$batch" --set train.micro_batches=1 --set train.steps="$steps" \
    --set train.val_every=0 --set data.path=data/fortunes_train.bin --set data.val_fraction=0 \
    --set hardware.hbm_gib=8 --set hardware.threads_per_rank="$threads" \
    --set run.dir="$work/t$i" "$@" > "$work/t$i.log" 2>&1 || { tail "$work/t$i.log"; exit 1; }
  metrics=$work/t$i/metrics.jsonl
  t_tok+=("$(tail -n +3 "$metrics" | sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' | median)")
  t_mfu+=("$(tail -n +3 "$metrics" | sed -n 's/.*"mfu": \([0-9.e+-]*\).*/\1/p' | median)")
  OPENBLAS_CORETYPE=$coretype OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$threads \
    $python bench/e2e/llama_torch.py --dim "$dim" --n_layers "$layers" --n_heads "$heads" \
    --n_kv_heads "$heads" --seq_len "$seq" --batch "$batch" --steps "$steps" --threads "$threads" \
    > "$work/p$i.json"
  p_tok+=("$(sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' "$work/p$i.json")")
  echo "run $i: titan3d ${t_tok[-1]} tok/s (MFU ${t_mfu[-1]}), PyTorch ${p_tok[-1]} tok/s"
done
t=$(printf '%s\n' "${t_tok[@]}" | median)
p=$(printf '%s\n' "${p_tok[@]}" | median)
m=$(printf '%s\n' "${t_mfu[@]}" | median)
echo "model: dim $dim, $layers layers, $heads heads, seq $seq, batch $batch, vocab 256, fp32, $threads threads"
echo "PyTorch: $(cat "$work/p1.json")"
awk -v t="$t" -v p="$p" -v m="$m" 'BEGIN {
  printf "median tokens/s: titan3d %.0f, PyTorch %.0f, ratio %.2fx; titan3d MFU %.1f%%\n", t, p, t / p, 100 * m }'
