#!/usr/bin/env bash
# The memory tier (snapshot.memory_every; docs/resilience.md "The memory tier"), self-launched,
# 1 host, dp2, the tiny model (a few seconds per run):
#  1. kill -9 of a rank with only memory snapshots since the start (snapshot.every past the
#     end): the restart resumes the memory tier's newest (the incident and the restore line say
#     so) and every step's loss and the final parameters are bit-identical to an uninterrupted run.
#  2. A memory snapshot newer than the disk's (step 100) is preferred; with one of its shards gone (a lost
#     host's RAM, with no buddy copy on one host) the restart falls back to the disk's and says
#     why; bit-identical again.
#  3. No titan3d directory of the job is left in /dev/shm after a clean end, a crash the
#     supervisor gives up on (--max-restarts 0), or Ctrl-C (SIGINT to the launcher).
#  4. A stale directory of the run directory (a job killed with everything) is removed at the next
#     start, which says so; /dev/shm too small: exit 2 with the numbers; a bad value: exit 2
#     naming the key.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
steps=200
recipe=(train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set parallel.dp=2
        --set train.steps=$steps --set train.val_every=0 --set train.log_every=100000
        --set hardware.gemm=openblas --set parallel.timeout_s=4 --set snapshot.memory_every=10)
# tier RUN: the job's memory-tier directory prefix in /dev/shm, from its log line.
tier() { grep -o '/dev/shm/titan3d-[0-9a-f]*-[0-9a-f]*-' "$work/$1.log" | head -1; }
no_tier_left() {  # no_tier_left RUN WHAT
  local t; t=$(tier "$1")
  check "[ -n '$t' ] && ! compgen -G '$t*' > /dev/null" "$2: nothing of the job left in /dev/shm ($t*)"
}
# kill_rank_after RUN STEP: SIGKILL rank 1 once metrics.jsonl logs STEP, then wait until the
# supervisor recorded the incident (every rank is gone, the restart waits its backoff).
kill_rank_after() {
  wait_for_step "$1" "$2" || { echo "FAIL: $1 never reached step $2"; fail=1; return 1; }
  kill -KILL "$(rank_pid "$1" 1)"
  for _ in $(seq 1 200); do [ -s "$work/$1/incidents.jsonl" ] && return 0; sleep 0.05; done
  return 1
}

"$titan3d" "${recipe[@]}" --set snapshot.every=1000 --set run.dir="$work/straight" \
  > "$work/straight.log" 2>&1 || { echo "FAIL: the straight run exited $?"; tail "$work/straight.log"; exit 1; }
check "grep -q 'memory snapshot step 190' $work/straight.log && grep -q 'one host, so the buddy copy adds nothing' $work/straight.log" \
  "memory snapshots every 10 steps; one host: the log says the buddy copy adds nothing" || tail -5 "$work/straight.log"
no_tier_left straight "a clean end"

# --- 1. kill -9 with memory snapshots only. ---
"$titan3d" "${recipe[@]}" --set snapshot.every=1000 --set run.dir="$work/killed" > "$work/killed.log" 2>&1 &
job=$!
kill_rank_after killed 55
wait $job; rc=$?
check "[ $rc -eq 0 ] && grep -q '\"tier\": \"memory\"' $work/killed/incidents.jsonl && grep -q '\"event\": \"restore\", \"tier\": \"memory\", \"snapshot_step\": [1-9]' $work/killed/incidents.jsonl && grep -q 'after step [0-9]*, written on cpu in .* (tier: memory)' $work/killed.log" \
  "kill -9: the restart resumes the memory tier (incident and restore line say so; rc $rc)" ||
  { tail -5 "$work/killed.log"; cat "$work/killed/incidents.jsonl"; }
same_as_straight killed "kill -9, memory tier"
no_tier_left killed "a clean end after a restart"

# --- 2. Memory newer than disk is preferred; with a shard gone, disk, saying why. ---
"$titan3d" "${recipe[@]}" --set snapshot.every=100 --set run.dir="$work/newer" > "$work/newer.log" 2>&1 &
job=$!
kill_rank_after newer 130
wait $job; rc=$?
# restored RUN: "tier snapshot_step disk_step" of the restore line of incidents.jsonl.
restored() {
  sed -n 's/.*"event": "restore", "tier": "\([a-z]*\)", "snapshot_step": \([0-9]*\), "disk_step": \([0-9]*\).*/\1 \2 \3/p' \
    "$work/$1/incidents.jsonl"
}
check "[ $rc -eq 0 ] && restored newer | awk '\$1 == \"memory\" && \$2 > \$3 && \$3 > 0 { ok = 1 } END { exit !ok }'" \
  "memory snapshot newer than the disk's: preferred ($(restored newer); rc $rc)" || cat "$work/newer/incidents.jsonl"
"$titan3d" "${recipe[@]}" --set snapshot.every=100 --set run.dir="$work/lost" > "$work/lost.log" 2>&1 &
job=$!
kill_rank_after lost 130 && rm -f "$(tier lost)"*/step_*/rank00001.h5
wait $job; rc=$?
check "[ $rc -eq 0 ] && restored lost | awk '\$1 == \"disk\" && \$2 == \$3 && \$3 > 0 { ok = 1 } END { exit !ok }' && grep -q '\"why\": \"the memory tier.s step [0-9]* has no living copy of shard step_[0-9]*/rank00001.h5' $work/lost/incidents.jsonl && grep -q 'after step [0-9]*, written on cpu in .* (tier: disk: .*no living copy' $work/lost.log" \
  "a memory snapshot with a shard gone: the restart falls back to the disk's, saying why ($(restored lost); rc $rc)" ||
  { tail -5 "$work/lost.log"; cat "$work/lost/incidents.jsonl"; }
same_as_straight lost "memory tier lost, disk tier"

# --- 3. Never outlives its job. ---
T3D_FAULT=die_at_step:1:35 "$titan3d" "${recipe[@]}" --set run.dir="$work/crash" --max-restarts 0 \
  > "$work/crash.log" 2>&1
rc=$?
check "[ $rc -ne 0 ] && grep -q 'memory snapshot step 30' $work/crash.log" "a crash with restarts off ends the job (rc $rc)"
no_tier_left crash "a crash the supervisor gives up on"
set -m
"$titan3d" "${recipe[@]}" --set snapshot.every=50 --set train.steps=100000 \
  --set run.dir="$work/interrupt" > "$work/interrupt.log" 2>&1 &
job=$!
set +m
wait_for_step interrupt 45 && kill -INT -- -$job
wait $job; rc=$?
check "[ $rc -eq 130 ]" "Ctrl-C: exit 130 (rc $rc)"
no_tier_left interrupt "Ctrl-C"

# --- 4. A stale directory, /dev/shm too small, bad values. ---
stale="$(tier straight)0badc0de-$(hostname)"
mkdir -p "$stale/step_00000010" && touch "$stale/step_00000010.manifest"
T3D_TEST_SHM_AVAILABLE=1000 "$titan3d" "${recipe[@]}" --set run.dir="$work/straight" \
  > "$work/small.log" 2>&1
rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshot.memory_every.*/dev/shm on host .* needs [0-9.]* [KMG]iB .* has 1000 B free' $work/small.log" \
  "/dev/shm too small: exit 2 with the numbers (rc $rc)" || tail -5 "$work/small.log"
check "[ ! -e '$stale' ] && grep -q 'memory tier: removed $stale, left in /dev/shm by a job of this run directory that no longer runs' $work/small.log" \
  "a stale memory tier of the same run directory is removed at the next start, which says so" || tail -5 "$work/small.log"
rm -rf "$stale"
for bad in -1 x 2.5; do
  "$titan3d" "${recipe[@]}" --set snapshot.memory_every=$bad --set run.dir="$work/bad" > "$work/bad.log" 2>&1
  rc=$?
  check "[ $rc -eq 2 ] && grep -q 'snapshot.memory_every' $work/bad.log" \
    "snapshot.memory_every = $bad: exit 2 naming the key (rc $rc)" || tail -3 "$work/bad.log"
done
exit $fail
