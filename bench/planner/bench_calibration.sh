#!/usr/bin/env bash
# Predicted vs measured step time on this machine for four local layouts of the default model
# (recipes/default.toml: dim 256, 4 layers, seq 128, global batch 16, 4 micro-batches):
# 1 rank; dp2; pp2 (1F1B); pp2×dp2×tp2 (the recipe's own, 8 ranks); and bench_bubble.sh's
# balanced pp2 model (dim 256, 8 layers, 8 heads, global batch 16, 8 micro-batches). For each:
# `plan --calibrate`
# (probe with that layout's ranks, its own cache dir), the planner's step time for the layout
# (`--explain 0`), then training STEPS steps; measured = median `step_time_s` of steps 3.. in
# metrics.jsonl, median over RUNS runs. Also prints the uncalibrated prediction (the guesses).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-10}
bin=build/apps/titan3d
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export XDG_CACHE_HOME=$work/cache
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# The planner's step, in seconds, from --explain's "tokens/s/device = G · T / step / world = X".
predicted() { "$bin" plan recipes/default.toml "$@" --top 1 --explain 0 |
  sed -n 's/^tokens\/s\/device = [0-9]* · [0-9]* \/ \([0-9.e+-]*\) \(m\?s\) .*/\1 \2/p' |
  awk '{ print ($2 == "ms") ? $1 / 1e3 : $1 }'; }
printf '%-22s %6s %12s %12s %12s %8s\n' layout ranks "guess (s)" "calib. (s)" "measured (s)" "error"
row=0
balanced="model.n_layers=8 model.n_kv_heads=8 train.micro_batches=8"
for layout in "1 1 1" "1 2 1" "2 1 1" "2 2 2" "2 1 1 $balanced"; do
  read -r pp dp tp extra <<<"$layout"
  row=$((row + 1))
  sets=(--set parallel.pp="$pp" --set parallel.dp="$dp" --set parallel.tp="$tp"
        --set run.dir="$work/run")
  label="pp${pp}·dp${dp}·tp${tp}"
  if [ -n "$extra" ]; then
    label="$label balanced"
    for kv in $extra; do sets+=(--set "$kv"); done
  fi
  guess=$(predicted "${sets[@]}")
  "$bin" plan recipes/default.toml "${sets[@]}" --calibrate --top 1 > "$work/cal" 2>&1 \
    || { cat "$work/cal"; exit 1; }
  calib=$(predicted "${sets[@]}")
  steps_s=()
  for i in $(seq "$runs"); do
    "$bin" train recipes/default.toml "${sets[@]}" --set train.steps="$steps" \
      --set train.val_every=0 --set run.dir="$work/train$row-$i" > "$work/log" 2>&1 \
      || { tail "$work/log"; exit 1; }
    steps_s+=("$(tail -n +3 "$work/train$row-$i/metrics.jsonl" |
      sed -n 's/.*"step_time_s": \([0-9.e+-]*\).*/\1/p' | median)")
  done
  measured=$(printf '%s\n' "${steps_s[@]}" | median)
  awk -v l="$label" -v n=$((pp * dp * tp)) -v g="$guess" -v c="$calib" \
      -v m="$measured" 'BEGIN {
    printf "%-22s %6d %12.3f %12.3f %12.3f %+7.0f%%\n", l, n, g, c, m, 100 * (c - m) / m }'
done
