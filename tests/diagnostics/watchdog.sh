#!/usr/bin/env bash
# The hang watchdog: a rank that skips a collective (test-only fault switch T3D_FAULT, see
# parallel/fault.h) makes the job end within parallel.timeout_s with a message naming the
# operation and group, exit code 3; a rank that dies makes the job end at once, with a message
# naming the rank.
set -u
titan3d=$1
source "$(dirname "$0")/../e2e/lib.sh"
require_corpus
make_work_dir
common=(--set data.path="$corpus" --set parallel.dp=2 --set parallel.timeout_s=5
        --set train.steps=20 --set train.val_every=0 --set run.max_restarts=0)
fail=0

# Operation 2 on dp_cp (the gradient reduction's group: dp and cp flattened) is step 2's gradient
# all-reduce.
start=$(date +%s)
out=$(T3D_FAULT=skip:1:dp_cp:2 timeout 120 "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" \
      --set run.dir="$work/skip" 2>&1); rc=$?
took=$(( $(date +%s) - start ))
if [ $rc -eq 3 ] && [ $took -lt 60 ] &&
   grep -qE 'watchdog: world rank [01] waited more than 5 s \(parallel.timeout_s\) in (gradient )?all_reduce on group `(dp_cp|world)` \(members world ranks \{0,1\}\)' <<<"$out"; then
  echo "ok   skipped collective: watchdog aborted after ${took}s: $(grep -m1 'watchdog:' <<<"$out" | sed 's/.*watchdog:/watchdog:/')"
else
  echo "FAIL skipped collective: rc=$rc after ${took}s"; echo "$out" | tail -20; fail=1
fi

start=$(date +%s)
out=$(T3D_FAULT=die:1:dp_cp:2 timeout 120 "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" \
      --set run.dir="$work/die" 2>&1); rc=$?
took=$(( $(date +%s) - start ))
if [ $rc -ne 0 ] && [ $took -lt 30 ] && grep -qE 'rank 1\b.*(died|killed|signal)' <<<"$out"; then
  echo "ok   dead rank: the job ended after ${took}s (rc $rc): $(grep -m1 -E 'rank 1\b.*(died|killed|signal)' <<<"$out")"
else
  echo "FAIL dead rank: rc=$rc after ${took}s"; echo "$out" | tail -20; fail=1
fi
# A stopped rank (SIGSTOP) is named by the launcher, which reads each rank's state, before the
# other ranks' watchdogs fire, and the job ends with exit 3; a one-rank job, where no other rank
# waits, is ended too. stop_rank RANKS RANK: runs the job, stops RANK once training runs.
stop_rank() {
  local ranks=$1 victim=$2 dir=$work/stop$1 start pid took
  start=$(date +%s)
  T3D_FAULT= timeout 120 "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" \
    --set parallel.dp="$ranks" --set train.steps=100000 --set parallel.timeout_s=4 \
    --set run.dir="$dir" >"$work/stop$ranks.out" 2>&1 &
  local job=$!
  for _ in $(seq 120); do
    [ -s "$dir/pids/rank$victim.pid" ] && grep -q "step " "$work/stop$ranks.out" && break
    sleep 0.5
  done
  pid=$(cut -d" " -f1 "$dir/pids/rank$victim.pid")
  kill -STOP "$pid"
  wait $job; rc=$?
  kill -KILL "$pid" 2>/dev/null  # in case the job did not end it
  took=$(( $(date +%s) - start ))
  out=$(cat "$work/stop$ranks.out")
  if [ $rc -eq 3 ] && [ $took -lt 60 ] &&
     grep -q "^titan3d: stall watchdog: rank $victim (pid $pid) is stopped" <<<"$out"; then
    echo "ok   rank $victim of $ranks stopped: exit 3 after ${took}s: $(grep -m1 'stall watchdog' <<<"$out")"
  else
    echo "FAIL rank $victim of $ranks stopped: rc=$rc after ${took}s"; echo "$out" | grep -v "step " | tail -10; fail=1
  fi
}
stop_rank 4 2
stop_rank 1 0
exit $fail
