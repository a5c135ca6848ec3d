#!/usr/bin/env bash
# A job's snapshots are its own lineage (runtime/train/snapshots.h, runtime/supervise/supervisor.h), self-launched,
# 1 rank, each compared with an uninterrupted run (losses and final parameters bit for bit):
#  1. A restart after `resume` goes back to the snapshot the job was started from (with the
#     job's overrides), not to a random initialisation, while the job has no snapshot of its own;
#     incidents.jsonl says so and gives the step it continues from.
#  2. A branch (`resume A/snapshots/step_N.h5 --set run.dir=B`) writes into B/snapshots; A's
#     snapshots stay as they were.
#  3. A fresh run in a run directory that holds an older run's snapshots sets them aside (saying
#     so): its retention keeps its own, and its restart resumes its own, not the older run's
#     higher step; with its newest snapshot damaged, the incident names the older one resumed.
#  4. A supervised job that ends by a failure leaves no lock in its run directory.
#  5. SIGTERM while the supervisor waits to restart: exit 75, not killed by the signal, and
#     incidents.jsonl ends with a stop line after the incident that was to restart.
#  6. SIGUSR1 in the job's first moments (before the ranks are up): exit 75, saying that
#     nothing new was trained to snapshot; no rank killed by the signal.
#  7. SIGKILL of the supervisor: mpirun and the ranks stop too.
#  8. A resume on a data file whose content changed since the snapshot says so.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
base=("$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.val_every=0
      --set train.log_every=100000 --set hardware.gemm=openblas --set run.log_level=warn)
snapshot_hash() {  # snapshot_hash SNAPSHOT: SHA-256 of its exported parameters
  rm -rf "$work/export.tmp"
  "$titan3d" export "$1" --out "$work/export.tmp" > /dev/null 2>&1 &&
    sha256sum < "$work/export.tmp/model.safetensors" | cut -c1-16
}
same_params() {  # same_params SNAPSHOT_A SNAPSHOT_B: both export, to the same bytes
  local a b
  a=$(snapshot_hash "$1") && b=$(snapshot_hash "$2") && [ -n "$a" ] && [ "$a" = "$b" ]
}
same_losses() {  # same_losses RUN_A RUN_B FROM TO: steps FROM..TO bit-identical, all present
  diff <(final_losses "$work/$1/metrics.jsonl" | awk -v a="$3" -v b="$4" '$1 >= a && $1 <= b') \
       <(final_losses "$work/$2/metrics.jsonl" | awk -v a="$3" -v b="$4" '$1 >= a && $1 <= b') > /dev/null &&
    [ "$(final_losses "$work/$2/metrics.jsonl" | awk -v a="$3" -v b="$4" '$1 >= a && $1 <= b' | wc -l)" -eq $(($4 - $3 + 1)) ]
}
snap() { echo "$work/$1/snapshots/step_$(printf %08d "$2").h5"; }

# --- 1. A restart after resume. ---
"$titan3d" train "${base[@]}" --set train.steps=20 --set snapshot.every=20 --set run.dir="$work/origin" \
  > "$work/origin.log" 2>&1 || { echo "FAIL: the origin run exited $?"; tail "$work/origin.log"; exit 1; }
resume=(resume "$(snap origin 20)" --set train.steps=400 --set snapshot.every=400 --set train.lr=2e-3
        --set train.log_every=100000 --set run.log_level=warn)
"$titan3d" "${resume[@]}" --set run.dir="$work/resumed" > "$work/resumed.log" 2>&1 ||
  { echo "FAIL: the uninterrupted resume exited $?"; tail "$work/resumed.log"; exit 1; }
"$titan3d" "${resume[@]}" --set run.dir="$work/killed" --max-restarts 2 > "$work/killed.log" 2>&1 &
job=$!
wait_for_step killed 60 && kill -KILL "$(rank_pid killed)"
echo "killed the rank near step $(last_step "$work/killed/metrics.jsonl")"
wait $job; rc=$?
check "[ $rc -eq 0 ] && grep -q 'restart from .*step_00000020.h5 (step 20' $work/killed/incidents.jsonl" \
  "a resumed job killed before its first snapshot restarts from the snapshot it resumed (rc $rc)" ||
  { tail -5 "$work/killed.log"; cat "$work/killed/incidents.jsonl"; }
check "same_losses resumed killed 21 400" \
  "restart after resume: steps 21-400 bit-identical to the uninterrupted resume (overrides kept)"
check "same_params $(snap killed 400) $(snap resumed 400)" \
  "restart after resume: final parameters bit-identical"

# --- 2. A branch. ---
"$titan3d" train "${base[@]}" --set train.steps=40 --set snapshot.every=10 --set snapshot.keep=3 \
  --set run.dir="$work/a" > "$work/a.log" 2>&1 || { echo "FAIL: run A exited $?"; exit 1; }
before=$(cd "$work/a/snapshots" && find . -type f | sort | xargs sha256sum | sha256sum)
"$titan3d" resume "$(snap a 30)" --set run.dir="$work/b" --set run.log_level=warn > "$work/b.log" 2>&1
rc=$?
after=$(cd "$work/a/snapshots" && find . -type f | sort | xargs sha256sum | sha256sum)
check "[ $rc -eq 0 ] && [ -f $(snap b 40) ] && [ \"$before\" = \"$after\" ]" \
  "a branch writes its snapshots into its own run.dir; A's are untouched (rc $rc)" ||
  { ls "$work/a/snapshots" "$work/b/snapshots"; tail -3 "$work/b.log"; }
check "same_losses a b 31 40 && same_params $(snap b 40) $(snap a 40)" \
  "the branch continues A bit for bit (steps 31-40, final parameters)"

# --- 3. A fresh run over an older run's snapshots, killed and restarted. ---
old=("${base[@]}" --set train.steps=40 --set snapshot.every=20 --set snapshot.keep=3)
fresh=("${base[@]}" --set train.steps=300 --set snapshot.every=50 --set snapshot.keep=2 --set train.seed=7)
"$titan3d" train "${old[@]}" --set train.steps=600 --set snapshot.every=300 --set run.dir="$work/reused" \
  > "$work/reused_old.log" 2>&1 || { echo "FAIL: the older run exited $?"; exit 1; }
"$titan3d" train "${fresh[@]}" --set run.dir="$work/clean" > "$work/clean.log" 2>&1 ||
  { echo "FAIL: the clean run exited $?"; exit 1; }
rm -f "$work/reused/metrics.jsonl"  # the older run's: wait_for_step reads this run's
"$titan3d" train "${fresh[@]}" --set run.dir="$work/reused" --max-restarts 2 > "$work/reused.log" 2>&1 &
job=$!
# Step 100's shard damaged before the kill: the restart skips it for step 50, and the incident
# must say 50, the step it really continues from. The rank is stopped (SIGSTOP) as soon as step
# 100's snapshot is committed, so step 150's cannot be committed before the kill.
for _ in $(seq 1 1200); do [ -f "$(snap reused 100)" ] && break; sleep 0.05; done
pid=$(rank_pid reused) && kill -STOP "$pid" && shard=$work/reused/snapshots/step_00000100/rank00000.h5 &&
  printf '\xde\xad\xbe\xef' | dd of="$shard" bs=1 seek=$(($(stat -c %s "$shard") / 2)) conv=notrunc 2>/dev/null
stopped_at=$(last_step "$work/reused/metrics.jsonl")
check "[ -n \"$stopped_at\" ] && [ \"$stopped_at\" -lt 150 ] && [ ! -e $(snap reused 150) ]" \
  "the rank was stopped between steps 100 and 150 (at step ${stopped_at:-none})"
kill -KILL "$pid"
wait $job; rc=$?
check "grep -q '\"snapshot_step\": 50,' $work/reused/incidents.jsonl && grep -q 'restart from snapshot step 50' $work/reused/incidents.jsonl" \
  "the incident names the step the restart resumes (50: step 100's snapshot is damaged)" || cat "$work/reused/incidents.jsonl"
aside=$(ls -d "$work"/reused/snapshots/set-aside-* 2>/dev/null | head -1)
check "[ $rc -eq 0 ] && grep -rq 'moved them to' $work/reused.log $work/reused/logs && [ -f \"$aside/step_00000600.h5\" ] && [ -f \"$aside/step_00000300.h5\" ]" \
  "the older run's snapshots are set aside, saying where (rc $rc)" || { ls -R "$work/reused/snapshots" | head; tail -5 "$work/reused.log"; }
check "[ ! -e $work/reused/snapshots/step_00000600.h5 ] && [ -f $(snap reused 250) ] && [ -f $(snap reused 300) ]" \
  "retention keeps this run's newest two, not the older run's higher step 600" || ls "$work/reused/snapshots"
check "same_losses clean reused 1 300 && same_params $(snap reused 300) $(snap clean 300)" \
  "the restart resumed this run's own snapshot: losses and parameters as a clean directory's"

check "cat $work/*/incidents.jsonl | awk -F'\"last_step\": |, \"snapshot_step\": |, \"lost_steps' '\$2 + 0 < \$3 + 0 { bad = 1 } END { exit bad }'" \
  "no incident has its last step below the snapshot it resumed from"

# --- 4. No lock left after a failure. ---
T3D_FAULT=die_at_step:0:5 "$titan3d" train "${base[@]}" --set train.steps=10 --set run.dir="$work/died" \
  --max-restarts 0 > "$work/died.log" 2>&1
rc=$?
check "[ $rc -ne 0 ] && [ ! -e $work/died/lock ]" "a job that ended by a failure leaves no lock (rc $rc)" ||
  { ls "$work/died"; tail -3 "$work/died.log"; }

# --- 5. SIGTERM during the restart backoff. ---
T3D_FAULT=die_at_step:0:3 "$titan3d" train "${base[@]}" --set train.steps=10 --set run.dir="$work/backoff" \
  --max-restarts 3 > "$work/backoff.log" 2>&1 &
job=$!
for _ in $(seq 1 300); do grep -q "restart .* in [0-9]* s" "$work/backoff.log" 2>/dev/null && break; sleep 0.1; done
kill -TERM $job
wait $job; rc=$?
check "[ $rc -eq 75 ] && grep -q 'while waiting to restart' $work/backoff.log" \
  "SIGTERM while waiting to restart: exit 75 (rc $rc)" || tail -3 "$work/backoff.log"
check "tail -1 $work/backoff/incidents.jsonl | grep -q '\"event\": \"stop\", \"attempt\": 1, \"signal\": 15, \"exit_code\": 75, .*\"action\": \"stop: signal 15 while waiting to restart'" \
  "incidents.jsonl ends with the stop, after the incident that was to restart" || cat "$work/backoff/incidents.jsonl"

# --- 6. SIGUSR1 before the ranks are up. ---
"$titan3d" train "${base[@]}" --set train.steps=2000 --set snapshot.every=1000 --set run.dir="$work/early" \
  > "$work/early.log" 2>&1 &
job=$!
for _ in $(seq 1 100); do pgrep -f "mpirun.*$work/early" > /dev/null && break; sleep 0.02; done
kill -USR1 $job
wait $job; rc=$?
check "[ $rc -eq 75 ] && ! grep -qE 'exited on signal|died' $work/early.log" \
  "SIGUSR1 in the job's first moments: exit 75, no rank killed by it (rc $rc)" || tail -5 "$work/early.log"

# --- 7. SIGKILL of the supervisor. ---
"$titan3d" train "${base[@]}" --set train.steps=100000 --set run.dir="$work/orphan" > "$work/orphan.log" 2>&1 &
job=$!
wait_for_step orphan 5
kill -KILL $job
gone=0
for _ in $(seq 1 100); do
  pgrep -f "run.dir=$work/orphan" > /dev/null || { gone=1; break; }
  sleep 0.1
done
check "[ $gone -eq 1 ]" "SIGKILL of the supervisor: mpirun and the ranks end within 10 s" ||
  { pgrep -af "$work/orphan"; pkill -KILL -f "run.dir=$work/orphan"; }
# --- 8. The data changed under a snapshot. ---
head -c 400000 "$corpus" > "$work/data.txt"
"$titan3d" train "${base[@]}" --set data.path="$work/data.txt" --set train.steps=4 --set snapshot.every=4 \
  --set run.dir="$work/data_run" > /dev/null 2>&1
echo "one more line" >> "$work/data.txt"
"$titan3d" train "${base[@]}" --set data.path="$work/data.txt" --set train.steps=6 --set snapshot.every=6 \
  --set snapshot.resume=latest --set run.dir="$work/data_run" > "$work/data.log" 2>&1
check "grep -q 'data.path .* changed since' $work/data.log" \
  "a resume on a data file that changed since the snapshot says so" || tail -3 "$work/data.log"
exit $fail
