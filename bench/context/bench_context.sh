#!/usr/bin/env bash
# Context parallelism on a long sequence: the same model and global batch trained on 2 ranks as
# cp = 2 (each rank holds half of every sequence) and as dp = 2 (each rank holds half of the
# sequences), plus one rank. Prints per layout the median tokens/s over steps 3.. and then over RUNS
# interleaved runs, the cp group's wait share (cp_comm_share), and the per-rank activation bytes
# each run reported. cp buys activation memory per rank (what lets a sequence that does not fit one
# rank train at all); it costs key/value all-gathers that dp does not pay.
# Usage: bench/context/bench_context.sh [extra --set ...]   (RUNS, STEPS, SEQ, DIM, LAYERS)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-8} seq=${SEQ:-1024} dim=${DIM:-256} layers=${LAYERS:-4}
[ -s data/fortunes_train.bin ] || bash scripts/get_data.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# train NAME [--set ...]: prints "tokens/s cp_share activation_bytes" (medians over steps 3..)
train() {
  local name=$1; shift
  build/apps/titan3d train recipes/tiny.toml --set model.dim="$dim" --set model.n_layers="$layers" \
    --set model.n_heads=8 --set model.n_kv_heads=2 --set model.seq_len="$seq" \
    --set train.global_batch=2 --set train.micro_batches=1 --set train.steps="$steps" \
    --set train.val_every=0 --set data.path=data/fortunes_train.bin --set data.val_fraction=0 \
    --set hardware.hbm_gib=4 --set hardware.threads_per_rank=1 --set run.dir="$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { tail "$work/$name.log" >&2; exit 1; }
  local m=$work/$name/metrics.jsonl
  echo "$(tail -n +3 "$m" | sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' | median)" \
       "$(tail -n +3 "$m" | sed -n 's/.*"cp_comm_share": \([0-9.e+-]*\).*/\1/p' | median)" \
       "$(cat "$work/$name"/logs/rank*.log | sed -n 's/.*memory bytes: .*activations \([0-9]*\).*/\1/p' | sort -n | tail -1)"
}
declare -A tok share act
for i in $(seq "$runs"); do
  for layout in one cp2 dp2; do
    case $layout in
      one) args=() ;;
      cp2) args=(--set parallel.cp=2) ;;
      dp2) args=(--set parallel.dp=2) ;;
    esac
    read -r t s a < <(train "$layout$i" "${args[@]}" "$@")
    tok[$layout]+="$t " share[$layout]+="$s " act[$layout]=$a
    echo "run $i $layout: $t tok/s, cp share $s, activations $a bytes per rank"
  done
done
echo "model: dim $dim, $layers layers, 8 heads (2 kv), seq $seq, global batch 2, fp32, 1 thread per rank; load $(cut -d' ' -f1-3 /proc/loadavg)"
for layout in one cp2 dp2; do
  printf '%-4s median %8.0f tok/s, cp_comm_share %s, activations %s bytes per rank\n' "$layout" \
    "$(tr ' ' '\n' <<<"${tok[$layout]}" | grep . | median)" \
    "$(tr ' ' '\n' <<<"${share[$layout]}" | grep . | median)" "${act[$layout]}"
done
