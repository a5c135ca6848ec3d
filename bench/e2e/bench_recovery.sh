#!/usr/bin/env bash
# The cost of a failure (docs/resilience.md): a self-launched job (dp = 2, the bench model unless
# set otherwise) is killed (SIGKILL of one rank) once its training is under way, FAULTS times per
# run, for each snapshot interval in EVERY; the restart loop brings it back. Reported per interval
# (medians over the faults):
#   detect   the kill until the launcher logged the incident (mpirun noticed the dead rank)
#   restart  the incident until the relaunched rank 0 logged its first step again
#   lost     steps done again (after the snapshot the restart resumed)
#   goodput  the launcher's figure for the whole run: step time that counts over wall time
# Usage: bench/e2e/bench_recovery.sh        (EVERY="5 20 80" FAULTS=3 STEPS=400 by default)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
bin=build/apps/titan3d
every_list=${EVERY:-5 20 80} faults=${FAULTS:-3} steps=${STEPS:-400}
[ -s data/fortunes.txt ] || bash scripts/get_data.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=(--set model.dim=${DIM:-256} --set model.n_layers=${LAYERS:-4} --set model.n_heads=8
       --set model.seq_len=${SEQ:-128} --set train.global_batch=8)
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
now() { date +%s.%N; }
last_step() { sed -n 's/^{"step": \([0-9]*\),.*/\1/p' "$1" 2>/dev/null | tail -1; }

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), family $(lscpu | sed -n 's/^CPU family: *//p') model $(lscpu | sed -n 's/^Model: *//p') ($(nproc) CPUs); $faults SIGKILLs per run of $steps steps"
printf '%-16s %10s %10s %10s %10s %12s\n' "snapshot.every" "step (s)" "detect (s)" "restart (s)" "lost steps" "goodput"
for every in $every_list; do
  dir=$work/every$every
  log=$work/every$every.log
  "$bin" train recipes/tiny.toml --set data.path=data/fortunes.txt "${model[@]}" --set parallel.dp=2 \
    --set train.steps=$steps --set train.val_every=0 --set train.log_every=100000 \
    --set snapshot.every=$every --set snapshot.keep=2 --set run.dir="$dir" \
    --max-restarts $((faults + 1)) > "$log" 2>&1 &
  job=$!
  : > "$work/detect" ; : > "$work/restart"
  for f in $(seq 1 "$faults"); do
    # Kill somewhere in the middle of each remaining stretch of the run.
    target=$(( steps * f / (faults + 1) ))
    until [ "$(last_step "$dir/metrics.jsonl")" -ge "$target" ] 2>/dev/null; do sleep 0.05; done
    before=$(grep -c 'titan3d: incident' "$log" || true)
    t0=$(now)
    kill -KILL "$(cut -d" " -f1 "$dir/pids/rank1.pid")"
    until [ "$(grep -c 'titan3d: incident' "$log" || true)" -gt "$before" ]; do sleep 0.01; done
    t1=$(now)
    lines=$(wc -l < "$dir/metrics.jsonl")
    until [ "$(wc -l < "$dir/metrics.jsonl")" -gt "$lines" ]; do sleep 0.01; done
    t2=$(now)
    awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }' >> "$work/detect"
    awk -v a="$t1" -v b="$t2" 'BEGIN { print b - a }' >> "$work/restart"
  done
  wait $job
  step_s=$(sed -n 's/.*"step_time_s": \([0-9.e+-]*\).*/\1/p' "$dir/metrics.jsonl" | median)
  lost=$(sed -n 's/.*"lost_steps": \([0-9]*\).*/\1/p' "$dir/incidents.jsonl" | median)
  goodput=$(grep -oE '^ +goodput +[0-9.]+%' "$log" | awk '{ print $2 }')  # the end-of-run row
  printf '%-16s %10.4f %10.2f %10.2f %10s %12s\n' "$every" "$step_s" "$(median < "$work/detect")" \
    "$(median < "$work/restart")" "$lost" "${goodput:-?}"
done
