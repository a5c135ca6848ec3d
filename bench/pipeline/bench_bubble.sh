#!/usr/bin/env bash
# Measured pipeline bubble per schedule against the textbook (p-1)/(m+p-1): pp = 2 ranks (one per
# core, so no oversubscription blurs the idle time), a balanced model (vocab 256: the head is
# ~0.1 block), m micro-batches. The measured figure is `pp_wait_share` from metrics.jsonl: the
# share of the step a rank spent waiting on its pipeline peers (idle + transfer), mean over ranks,
# median over steps 3.. and over RUNS runs. SCHEDULES="zb_h1 zb_v" picks a subset.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-10} m=${MICRO:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
schedules=(${SCHEDULES:-gpipe 1f1b zb_h1 interleaved_1f1b zb_v})
# Rounds outside, schedules inside: load from other jobs drifts over minutes, and alternating
# spreads it over every schedule alike instead of penalising whichever ran in a busy spell.
for i in $(seq "$runs"); do
  for schedule in "${schedules[@]}"; do
    extra=()
    [ "$schedule" = interleaved_1f1b ] && extra=(--set parallel.virtual_stages=2)
    build/apps/titan3d train recipes/tiny.toml --set model.dim=256 --set model.n_layers=8 \
      --set model.n_heads=8 --set model.seq_len=128 --set train.global_batch=$((2 * m)) \
      --set train.micro_batches="$m" --set train.steps="$steps" --set train.val_every=0 \
      --set parallel.pp=2 --set parallel.schedule="$schedule" "${extra[@]}" \
      --set run.dir="$work/$schedule$i" > "$work/log" 2>&1 || { tail "$work/log"; exit 1; }
    f=$work/$schedule$i/metrics.jsonl
    tail -n +3 "$f" | sed -n 's/.*"pp_wait_share": \([0-9.e-]*\).*/\1/p' | median >> "$work/$schedule.share"
    tail -n +3 "$f" | sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' | median >> "$work/$schedule.tok"
  done
done
printf '%-18s %10s %10s %12s  %s\n' schedule measured textbook tokens/s "per run"
for schedule in "${schedules[@]}"; do
  v=1; [ "$schedule" = interleaved_1f1b ] && v=2
  awk -v s="$schedule" -v b="$(median < "$work/$schedule.share")" \
      -v t="$(median < "$work/$schedule.tok")" -v m="$m" -v v="$v" \
      -v runs="$(awk '{ printf "%s%.1f", (NR > 1 ? " " : ""), 100 * $1 }' "$work/$schedule.share")" 'BEGIN {
    p = 2; textbook = (p - 1) / (v * m + p - 1)
    if (s == "zb_h1") textbook_s = "< 1f1b"
    else if (s == "zb_v") textbook_s = "< zb_h1"  # a generated table: no closed form
    else textbook_s = sprintf("%.1f%%", 100 * textbook)
    printf "%-18s %9.1f%% %10s %12.0f  %s\n", s, 100 * b, textbook_s, t, runs }'
done
