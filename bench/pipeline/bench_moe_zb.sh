#!/usr/bin/env bash
# A mixture-of-experts pipeline under a zero-bubble schedule, this tree's titan3d against another
# build (BASELINE=path/to/titan3d), interleaved in every round: pp = 2 ranks (one per core), a MoE
# model (block 0 dense, 8 routed experts, 2 per token, one shared expert), m micro-batches.
# Prints per binary the median over steps 3.. and then over RUNS rounds of tokens/s and of
# pp_wait_share (the share of the step a rank waited on its pipeline peer, mean over ranks), and
# the largest activation bytes a rank logged (the W rows a split backward keeps are in them).
# SCHEDULE=zb_h1 (default) or zb_v; EP=2 adds parallel.dp = parallel.ep = 2 (4 ranks).
# BASELINE_SCHEDULE runs the baseline under another schedule (default: SCHEDULE); with
# BASELINE=build/apps/titan3d it compares two schedules of one build side by side.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-8} m=${MICRO:-8} schedule=${SCHEDULE:-zb_h1} ep=${EP:-1}
baseline_schedule=${BASELINE_SCHEDULE:-$schedule}
baseline=${BASELINE:?BASELINE=path/to/titan3d of the build to compare with}
[ -s data/fortunes_train.bin ] || bash scripts/get_data.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
field() { tail -n +3 "$1" | sed -n "s/.*\"$2\": \\([0-9.e+-]*\\).*/\\1/p" | median; }  # steps 3..
for i in $(seq "$runs"); do
  for who in this baseline; do
    bin=build/apps/titan3d sched=$schedule
    [ "$who" = baseline ] && bin=$baseline sched=$baseline_schedule
    dir=$work/$who$i
    "$bin" train recipes/tiny.toml --set model.dim=256 --set model.n_layers=8 \
      --set model.n_heads=8 --set model.seq_len=128 --set model.n_experts=8 \
      --set model.experts_per_token=2 --set model.n_shared_experts=1 --set model.moe_ffn_dim=256 \
      --set model.dense_layers=1 --set train.global_batch=$((2 * ep * m)) \
      --set train.micro_batches="$m" --set train.steps="$steps" --set train.val_every=0 \
      --set train.precision=fp32 --set data.path=data/fortunes_train.bin \
      --set data.val_fraction=0 --set snapshot.every=0 --set parallel.pp=2 \
      --set parallel.dp="$ep" --set parallel.ep="$ep" --set parallel.schedule="$sched" \
      --set run.dir="$dir" > "$work/log" 2>&1 || { tail "$work/log"; exit 1; }
    field "$dir/metrics.jsonl" tokens_per_s >> "$work/$who.tok"
    field "$dir/metrics.jsonl" pp_wait_share >> "$work/$who.wait"
    cat "$dir"/logs/rank*.log | sed -n 's/.*memory bytes: .* activations \([0-9]*\) .*/\1/p' |
      sort -n | tail -1 >> "$work/$who.act"
  done
done
printf '%-9s %10s %14s %16s  %s\n' binary tokens/s pp_wait_share activations "tokens/s per round"
for who in this baseline; do
  printf '%-9s %10.0f %13.1f%% %16s  %s\n' "$who" "$(median < "$work/$who.tok")" \
    "$(median < "$work/$who.wait" | awk '{ print 100 * $1 }')" "$(sort -n "$work/$who.act" | tail -1)" \
    "$(tr '\n' ' ' < "$work/$who.tok")"
done
