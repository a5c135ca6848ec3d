#!/usr/bin/env bash
# Never losing a run (runtime/supervise/supervisor.h, runtime/launch/stop_signal.h), self-launched, 2 ranks:
#  1. Ranks killed with SIGKILL at random moments, three times (one of them while a snapshot is
#     being written): the job restarts by itself from its newest snapshot and finishes; every
#     step's loss and the final parameters are bit-identical to an uninterrupted run.
#  2. A hung rank (SIGSTOP): the stall watch kills it after parallel.timeout_s and the job
#     restarts and finishes, again bit-identical.
#  3. A deterministic crash (T3D_FAULT=die_at_step): stopped after the first repeat, saying so.
#  4. SIGTERM to the launcher (preemption): every rank snapshots the step it is in, exits 75, no
#     rank is left; `snapshot.resume = latest` then finishes the straight run's losses.
#  4b. The same stop signal to several processes of the job at once, as a scheduler sends it
#     (run.max_restarts = 2): to mpirun alone, which then exits 1; to the launcher and one rank,
#     which gets it twice (its own and the forwarded one); to the launcher, mpirun and every rank.
#     Each time: exit 75 with the snapshot of the step reached, and no restart.
#  4c. SIGTERM to mpirun alone while steps take 1.5 s, with run.stop_grace_s = 6 (Open MPI's
#     wait before SIGKILL): the same.
#  5. SIGINT to the launcher's process group, as Ctrl-C sends it: every rank ends promptly (exit
#     130), none is left, the console gives one account (interrupted after step N with its
#     snapshot committed: no "preempted", no exit 75) and that snapshot resumes.
#  6. Elastic shrink's resume: a dp2 snapshot continued on dp1 with the same global_batch (twice
#     the micro-batches) gives the dp2 run's losses within fp32 tolerance.
# The end-of-run rows of a supervised run (apps/perf_report.h) give the restarts (1.).
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
# Every fault below comes by step ~810 (the kills), ~400 (the rest): 1000 steps leave each
# restart well over 100 steps to continue bit for bit.
steps=1000
recipe=(train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set parallel.dp=2
        --set train.steps=$steps --set train.val_every=0 --set train.log_every=100000
        --set snapshot.every=10 --set snapshot.keep=2 --set parallel.timeout_s=4)
alive() { pgrep -f "run.dir=$work/$1( |$)" > /dev/null || pgrep -f "$work/$1/restart.toml" > /dev/null; }

"$titan3d" "${recipe[@]}" --set run.dir="$work/straight" > "$work/straight.log" 2>&1 ||
  { echo "FAIL: the straight run exited $?"; tail "$work/straight.log"; exit 1; }

# --- 1. Three SIGKILLs at random moments, one during a snapshot write. ---
"$titan3d" "${recipe[@]}" --set run.dir="$work/killed" --max-restarts 5 > "$work/killed.log" 2>&1 &
job=$!
RANDOM=7
at=0
for kill in 1 2 3; do
  at=$((at + 120 + RANDOM % 150))  # past the previous kill: progress between failures
  wait_for_step killed $at || { echo "FAIL: the killed run never reached step $at"; break; }
  if [ $kill = 2 ]; then  # while a shard is being written (its temp file exists)
    for _ in $(seq 1 2000); do compgen -G "$work/killed/snapshots/*/*.tmp" > /dev/null && break; done
  fi
  victim=$(((RANDOM + kill) % 2))  # both ranks among the victims
  kill -KILL "$(rank_pid killed $victim)" 2>/dev/null
  echo "killed rank $victim near step $(last_step "$work/killed/metrics.jsonl")"
  sleep 1
done
wait $job; rc=$?
check "[ $rc -eq 0 ]" "the killed run finished by itself (rc $rc)" || tail -20 "$work/killed.log"
check "[ \$(grep -c '\"action\": \"restart' $work/killed/incidents.jsonl) -eq 3 ]" \
  "incidents.jsonl records three restarts"
check "grep -q 'died: signal 9' $work/killed/incidents.jsonl && grep -q 'goodput' $work/killed.log" \
  "incidents name the signal; the end reports the goodput"
same_as_straight killed "3 kills"
check "grep -qE '^ +restarts +3\$' $work/killed.log && grep -qE '^ +goodput +[0-9.]+% ' $work/killed.log && grep -q '\"supervision\": {\"restarts\": 3,' $work/killed/summary.json" \
  "the end-of-run table has the restarts (3) and the goodput, and so has summary.json"

# --- 2. A hung rank. ---
"$titan3d" "${recipe[@]}" --set run.dir="$work/hung" > "$work/hung.log" 2>&1 &
job=$!
wait_for_step hung 400 && kill -STOP "$(rank_pid hung 1)"
wait $job; rc=$?
check "[ $rc -eq 0 ] && grep -q 'hung' $work/hung/incidents.jsonl" \
  "a stopped rank is killed by the stall watch and the job restarts (rc $rc)" || tail -20 "$work/hung.log"
same_as_straight hung "SIGSTOP"

# --- 3. A deterministic crash. ---
T3D_FAULT=die_at_step:1:50 "$titan3d" "${recipe[@]}" --set run.dir="$work/crash" > "$work/crash.log" 2>&1
rc=$?
check "[ $rc -ne 0 ] && grep -q 'deterministic failure' $work/crash.log && [ \$(grep -c . $work/crash/incidents.jsonl) -eq 2 ]" \
  "a crash at the same step twice stops after the first repeat (rc $rc)" || { tail -5 "$work/crash.log"; cat "$work/crash/incidents.jsonl"; }

# --- 4. Preemption: SIGTERM to the launcher. ---
"$titan3d" "${recipe[@]}" --set run.dir="$work/preempt" > "$work/preempt.log" 2>&1 &
job=$!
wait_for_step preempt 300 && kill -TERM $job
wait $job; rc=$?
stopped=$(last_step "$work/preempt/metrics.jsonl")
check "[ $rc -eq 75 ] && [ -f $work/preempt/snapshots/step_$(printf %08d "${stopped:-0}").h5 ]" \
  "SIGTERM: exit 75 with the snapshot of the step it stopped at ($stopped)" || tail -5 "$work/preempt.log"
sleep 1
check "! alive preempt" "no rank left after the preemption"
"$titan3d" "${recipe[@]}" --set run.dir="$work/preempt" --set snapshot.resume=latest \
  >> "$work/preempt.log" 2>&1 || { echo "FAIL: continuing the preempted run exited $?"; fail=1; }
same_as_straight preempt "preempted and continued"

# --- 4b. One preemption signal to several processes of the job at once. ---
mpirun_pid() { pgrep -f "^mpirun .*run.dir=$work/$1( |\$)"; }
for to in mpirun "launcher rank1" "launcher mpirun ranks"; do
  run=preempt_${to// /_}
  "$titan3d" "${recipe[@]}" --set run.dir="$work/$run" --max-restarts 2 > "$work/$run.log" 2>&1 &
  job=$!
  wait_for_step "$run" 50
  case $to in
    mpirun) kill -TERM "$(mpirun_pid "$run")" ;;
    "launcher rank1") kill -TERM $job "$(rank_pid "$run" 1)" ;;
    *) kill -TERM $job "$(mpirun_pid "$run")" "$(rank_pid "$run" 0)" "$(rank_pid "$run" 1)" ;;
  esac
  wait $job; rc=$?
  stopped=$(last_step "$work/$run/metrics.jsonl")
  check "[ $rc -eq 75 ] && [ -f $work/$run/snapshots/step_$(printf %08d "${stopped:-0}").h5 ] && [ ! -e $work/$run/incidents.jsonl ]" \
    "SIGTERM to the $to: exit 75 with the snapshot of the step it stopped at ($stopped), no restart (rc $rc)" ||
    { grep -v '\] snapshot step' "$work/$run.log" | tail -5; cat "$work/$run/incidents.jsonl" 2>/dev/null; }
done

# --- 4c. SIGTERM to mpirun alone while a step takes longer than Open MPI's own SIGKILL delay (1 s),
# with run.stop_grace_s = 6: exit 75 with the step's snapshot. ---
run=preempt_slow_step
T3D_FAULT=slow_step:1:1500 "$titan3d" "${recipe[@]}" --set run.dir="$work/$run" --set run.stop_grace_s=6 \
  --max-restarts 2 > "$work/$run.log" 2>&1 &
job=$!
wait_for_step "$run" 2 && kill -TERM "$(mpirun_pid "$run")"
wait $job; rc=$?
stopped=$(last_step "$work/$run/metrics.jsonl")
check "[ $rc -eq 75 ] && [ -f $work/$run/snapshots/step_$(printf %08d "${stopped:-0}").h5 ] && [ ! -e $work/$run/incidents.jsonl ]" \
  "SIGTERM to mpirun during 1.5 s steps (stop grace 6 s): exit 75 with the snapshot of the step it stopped at ($stopped), no restart (rc $rc)" ||
  { tail -5 "$work/$run.log"; cat "$work/$run/incidents.jsonl" 2>/dev/null; }

# --- 5. Ctrl-C: SIGINT to the launcher's process group (job control gives the job its own). ---
set -m
"$titan3d" "${recipe[@]}" --set run.dir="$work/interrupt" > "$work/interrupt.log" 2>&1 &
job=$!
set +m
wait_for_step interrupt 300 && kill -INT -- -$job
start=$SECONDS
wait $job; rc=$?
sleep 1
check "[ $rc -eq 130 ] && [ $((SECONDS - start)) -le 10 ] && ! alive interrupt" \
  "SIGINT: every rank ends promptly, none left (rc $rc)" || tail -5 "$work/interrupt.log"
stopped=$(grep -o 'interrupted (Ctrl-C[^)]*): stopped after step [0-9]* with its snapshot committed' \
  "$work/interrupt.log" | grep -o '[0-9]* with' | grep -o '[0-9]*')
check "[ -n '$stopped' ] && [ '$stopped' = \"\$(last_step $work/interrupt/metrics.jsonl)\" ] && [ -f $work/interrupt/snapshots/step_$(printf %08d "${stopped:-0}").h5 ] && ! grep -qiE 'preempt|exit 75|died|ending every rank' $work/interrupt.log" \
  "SIGINT: one account, interrupted after the last step logged (${stopped:-none}) with its snapshot committed" ||
  grep -v '\] snapshot step' "$work/interrupt.log" | tail -5
"$titan3d" "${recipe[@]}" --set run.dir="$work/interrupt" --set snapshot.resume=latest \
  >> "$work/interrupt.log" 2>&1 || { echo "FAIL: resuming after SIGINT exited $?"; fail=1; }
same_as_straight interrupt "interrupted and resumed"

# --- 6. A dp2 snapshot resumed on dp1, global_batch kept. ---
small=(train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=60
       --set train.val_every=0 --set snapshot.every=30 --set train.global_batch=8)
"$titan3d" "${small[@]}" --set parallel.dp=2 --set train.micro_batches=1 \
  --set run.dir="$work/dp2" > "$work/dp2.log" 2>&1 || { echo "FAIL: the dp2 run exited $?"; fail=1; }
"$titan3d" resume "$work/dp2/snapshots/step_00000030.h5" --set parallel.dp=1 \
  --set train.micro_batches=2 --set run.dir="$work/dp1" > "$work/dp1.log" 2>&1 ||
  { echo "FAIL: resuming the dp2 snapshot on dp1 exited $?"; fail=1; }
after30() { counted_losses "$1" | awk -F'[ ,]' '$2 > 30'; }
after30 "$work/dp1/metrics.jsonl" > "$work/dp1.losses"
after30 "$work/dp2/metrics.jsonl" > "$work/dp2.losses"
check "grep -q 'resharded: .* -> ' $work/dp1.log && [ \$(grep -c . $work/dp1.losses) -eq 30 ]" \
  "the dp2 snapshot resumed on dp1 (resharded), steps 31-60 logged" || tail -5 "$work/dp1.log"
printf 'dp2 snapshot continued on dp1 with 2 micro-batches vs dp2: '
compare_losses "$work/dp1.losses" "$work/dp2.losses" 1e-5 || fail=1
exit $fail
