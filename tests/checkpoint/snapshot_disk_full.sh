#!/usr/bin/env bash
# A real full disk under snapshot.dir: a small tmpfs mounted in a private mount namespace, sized
# so that the disk fills at different points of the snapshot cycle (shard data, shard close,
# index, `latest`). Every run must end with exit 0 or 2 (never a signal: HDF5 used to crash at
# exit), every index left in the directory must be complete and verify, `latest` must never be
# empty and must name a good snapshot, and a failed snapshot must be reported. Skipped (exit 77)
# where this machine cannot mount a tmpfs.
set -u
titan3d=$1 recipe=$2
source "$(dirname "$0")/../e2e/mount_ns.sh"
source "$(dirname "$0")/common.sh"
base=(train "$recipe" "${common[@]}" --set model.dim=64 --set model.n_layers=2
      --set model.seq_len=32 --set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1
      --set train.steps=4 --set snapshot.every=1 --set snapshot.keep=1 --set snapshot.full_every=1)
# One shard of this model is ~1.6 MB and its index ~46 KB: sizes around one snapshot (the first
# shard, index or `latest` does not fit) and around two (the second does not fit beside the
# first, which retention removes only after the commit).
failures=0 commits=0
for kb in 1200 1604 1616 1624 1632 1640 1656 3240 3272 3288 3304 3320; do
  mnt=$work/full$kb
  full_tmpfs "$mnt" "$kb" || { echo "FAIL: mount of ${kb}k"; fail=1; continue; }
  out=$(timeout 120 "$titan3d" "${base[@]}" --set run.dir="$work/run$kb" --set snapshot.dir="$mnt" \
        --set run.log_level=info 2>&1); rc=$?
  check "[ $rc -eq 0 ] || [ $rc -eq 2 ]" "${kb} KiB: exit $rc (0 or 2, never a crash)" || echo "$out"
  check "! grep -qi 'internal error' <<<\"\$out\"" "${kb} KiB: no internal error" || echo "$out"
  n_fail=$(grep -c 'failed on rank\|writing the index failed' <<<"$out")
  failures=$((failures + n_fail))
  if [ "$n_fail" -gt 0 ]; then
    check "[ $rc -eq 2 ] || grep -q 'snapshot step 4 ' <<<\"\$out\"" \
      "${kb} KiB: a run whose last snapshot failed exits 2" || echo "$out"
  fi
  for idx in "$mnt"/step_*.h5; do
    [ -e "$idx" ] || continue
    commits=$((commits + 1))
    check "timeout 60 $titan3d export $idx --out $work/hf$kb >/dev/null 2>&1" \
      "${kb} KiB: $(basename "$idx") left in the directory is complete and verifies"
  done
  if [ -e "$mnt/latest" ]; then
    check "[ -s $mnt/latest ] && [ -f $mnt/\$(cat $mnt/latest) ]" \
      "${kb} KiB: latest is not empty and names an index ($(cat "$mnt/latest"))"
  fi
  committed=$(grep -o 'snapshot step [0-9]* ([a-z]*)' <<<"$out" | tail -1 | grep -o '[0-9]\+')
  if [ -n "$committed" ]; then
    check "[ -f $mnt/step_0000000$committed.h5 ]" \
      "${kb} KiB: the last snapshot reported committed (step $committed) is on disk"
  fi
  umount "$mnt"
done
# Several ranks: every rank must reach the give-up after three failed snapshots in a row, and the
# end of a preemption whose snapshot fails (only rank 0 did: the job hung until the watchdog).
mnt=$work/tiny_disk
mkdir -p "$mnt" && mount -t tmpfs -o size=64k tmpfs "$mnt"
out=$(timeout 120 "$titan3d" "${base[@]}" --set parallel.dp=2 --set train.steps=8 \
      --set run.dir="$work/run_dp2" --set snapshot.dir="$mnt" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshots failed at step(s) 1, 2, 3' <<<\"\$out\"" \
  "2 ranks, three snapshots failed in a row: every rank stops, exit 2 (rc $rc)" || echo "$out" | tail -5
# preempt_on_full_disk WHAT MNT RUN --set...: SIGUSR1 at step 3 of a run whose snapshot.dir MNT is
# filled up then; exit 2 saying the final state is not saved, within seconds.
preempt_on_full_disk() {
  local what=$1 mnt=$2 run=$work/$3 job guard rc; shift 3
  "$titan3d" "${base[@]}" "$@" --set train.steps=100000 --set snapshot.every=100000 \
    --set run.dir="$run" --set snapshot.dir="$mnt" > "$run.log" 2>&1 &
  job=$!
  ( sleep 120; kill -KILL $job; pkill -KILL -f "$run" ) > /dev/null 2>&1 &
  guard=$!  # a hang ends here, not at ctest's timeout
  for _ in $(seq 1 600); do grep -q '"step": 3,' "$run/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done
  fill "$mnt"
  kill -USR1 $job
  wait $job; rc=$?
  pkill -P $guard 2>/dev/null; kill $guard 2>/dev/null
  check "[ $rc -eq 2 ] && grep -q 'the run ends without its final state' $run.log" \
    "$what, a preemption whose snapshot hits the full disk: exit 2, no hang (rc $rc)" || tail -5 "$run.log"
}
preempt_on_full_disk "2 ranks" "$mnt" run_preempt --set parallel.dp=2
umount "$mnt"
# Four ranks (dp2 × tp2) on a 6 MB snapshot.dir, the scale a rank used to be killed at (exit 137)
# and a preemption to hang: the snapshots fill it, every rank stops with exit 2; a preemption
# whose snapshot meets the disk filled up ends with exit 2 as well.
mnt=$work/six_mb
full_tmpfs "$mnt" 6144
out=$(timeout 120 "$titan3d" "${base[@]}" --set parallel.dp=2 --set parallel.tp=2 --set train.steps=40 \
      --set snapshot.keep=100 --set run.dir="$work/run_4" --set snapshot.dir="$mnt" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshots failed at step(s) [0-9]*, [0-9]*, [0-9]* with none' <<<\"\$out\"" \
  "4 ranks, a 6 MB snapshot.dir filled by the run's snapshots: every rank stops, exit 2 (rc $rc)" || echo "$out" | tail -5
umount "$mnt"
full_tmpfs "$mnt" 6144
preempt_on_full_disk "4 ranks" "$mnt" run_preempt_4 --set parallel.dp=2 --set parallel.tp=2
umount "$mnt"

echo "snapshots that failed on a full disk: $failures; indexes left that verify: $commits"
check "[ $failures -gt 0 ] && [ $commits -gt 0 ]" "the sweep saw both failed and committed snapshots"
exit $fail
