#!/usr/bin/env bash
# titan3d vs PyTorch (Debian's python3-torch) training the same LLaMA configuration on the same
# data with the same threads, fp32: tokens/s of each (median over steps, then over RUNS runs,
# interleaved so both see the same machine), their ratio, and titan3d's MFU.
#
# Both get OpenBLAS's SkylakeX kernels (titan3d picks them itself; PyTorch through the environment)
# and PyTorch passive OpenMP waiting: its OpenMP pool and OpenBLAS's otherwise spin against each
# other on two cores. Usage: bench/e2e/bench_vs_pytorch.sh [extra titan3d --set ...]
# BASELINE=/path/to/an/older/titan3d also runs that binary, interleaved, for a side-by-side.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
export runs=${RUNS:-3}
steps=${STEPS:-12} threads=${THREADS:-2}
dim=${DIM:-512} layers=${LAYERS:-8} heads=${HEADS:-8} seq=${SEQ:-256} batch=${BATCH:-8}
python=/usr/bin/python3  # Debian's interpreter: it sees python3-torch
$python -c "import torch" 2>/dev/null || { echo "needs Debian's python3-torch: apt-get install python3-torch"; exit 1; }
[ -s data/fortunes_train.bin ] || bash scripts/get_data.sh
coretype=${OPENBLAS_CORETYPE:-$("$repo/build/apps/titan3d" keys >/dev/null && echo SkylakeX)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# titan3d RUN_NAME [--set ...]: trains, then prints "tokens/s mfu" (medians over steps 3..).
titan3d() {
  local name=$1; shift
  local bin=build/apps/titan3d
  [ "${name:0:1}" = b ] && bin=$BASELINE
  "$bin" train recipes/tiny.toml --set model.dim="$dim" --set model.n_layers="$layers" \
    --set model.n_heads="$heads" --set model.n_kv_heads="$heads" --set model.seq_len="$seq" \
    --set train.global_batch="$batch" --set train.micro_batches=1 --set train.steps="$steps" \
    --set train.val_every=0 --set data.path=data/fortunes_train.bin --set data.val_fraction=0 \
    --set hardware.hbm_gib=8 --set run.dir="$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { tail "$work/$name.log" >&2; exit 1; }
  local metrics=$work/$name/metrics.jsonl
  echo "$(tail -n +3 "$metrics" | sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' | median)" \
       "$(tail -n +3 "$metrics" | sed -n 's/.*"mfu": \([0-9.e+-]*\).*/\1/p' | median)"
}
t_tok=() t_mfu=() d_tok=() d_mfu=() p_tok=() bt_tok=() bd_tok=()
for i in $(seq "$runs"); do
  # One rank with all the threads, as PyTorch runs...
  read -r tok mfu < <(titan3d "t$i" --set hardware.threads_per_rank="$threads" "$@")
  t_tok+=("$tok") t_mfu+=("$mfu")
  # ...and the same threads as single-threaded data-parallel ranks, titan3d's own way to use cores.
  read -r tok mfu < <(titan3d "d$i" --set parallel.dp="$threads" --set hardware.threads_per_rank=1 "$@")
  d_tok+=("$tok") d_mfu+=("$mfu")
  if [ -n "${BASELINE:-}" ]; then
    read -r tok mfu < <(titan3d "bt$i" --set hardware.threads_per_rank="$threads" "$@")
    bt_tok+=("$tok")
    read -r tok mfu < <(titan3d "bd$i" --set parallel.dp="$threads" --set hardware.threads_per_rank=1 "$@")
    bd_tok+=("$tok")
    echo "run $i: baseline 1 rank ${bt_tok[-1]} tok/s, dp=$threads ${bd_tok[-1]} tok/s"
  fi
  OPENBLAS_CORETYPE=$coretype OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$threads \
    $python bench/e2e/llama_torch.py --dim "$dim" --n_layers "$layers" --n_heads "$heads" \
    --n_kv_heads "$heads" --seq_len "$seq" --batch "$batch" --steps "$steps" --threads "$threads" \
    > "$work/p$i.json"
  p_tok+=("$(sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' "$work/p$i.json")")
  echo "run $i: titan3d 1 rank ${t_tok[-1]} tok/s (MFU ${t_mfu[-1]}), dp=$threads ${d_tok[-1]} tok/s" \
       "(MFU ${d_mfu[-1]}), PyTorch ${p_tok[-1]} tok/s"
done
med() { printf '%s\n' "$@" | median; }
echo "model: dim $dim, $layers layers, $heads heads, seq $seq, batch $batch, vocab 256, fp32, $threads threads"
echo "PyTorch: $(cat "$work/p1.json")"
awk -v t="$(med "${t_tok[@]}")" -v d="$(med "${d_tok[@]}")" -v p="$(med "${p_tok[@]}")" \
    -v tm="$(med "${t_mfu[@]}")" -v dm="$(med "${d_mfu[@]}")" -v n="$threads" 'BEGIN {
  printf "median tokens/s over %s runs:\n", ENVIRON["runs"]
  printf "  PyTorch (1 process, %d threads)          %7.0f\n", n, p
  printf "  titan3d (1 rank, %d BLAS threads)        %7.0f  %.2fx PyTorch, MFU %.1f%%\n", n, t, t / p, 100 * tm
  printf "  titan3d (dp=%d ranks, 1 thread each)      %7.0f  %.2fx PyTorch, MFU %.1f%%\n", n, d, d / p, 100 * dm }'
if [ -n "${BASELINE:-}" ]; then
  awk -v t="$(med "${bt_tok[@]}")" -v d="$(med "${bd_tok[@]}")" -v p="$(med "${p_tok[@]}")" -v n="$threads" 'BEGIN {
  printf "  baseline (1 rank, %d BLAS threads)       %7.0f  %.2fx PyTorch\n", n, t, t / p
  printf "  baseline (dp=%d ranks, 1 thread each)     %7.0f  %.2fx PyTorch\n", n, d, d / p }'
fi
