#!/usr/bin/env bash
# Damaged and missing snapshots are refused with a message naming the file, and so is an
# incremental one whose parent is missing; a rank killed mid-write and a failing write both leave
# the previous snapshot complete and resumable; retention keeps the bases kept snapshots need.
set -u
source "$(dirname "$0")/common.sh"
one=(--set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1)
# Snapshot 2 is full, 4 incremental on 2 (full_every = 4 by default; incremental on schedule).
base=(train "$recipe" "${common[@]}" "${one[@]}" --set train.steps=4 --set snapshot.every=2
      --set snapshot.incremental_min_unchanged=0)

"$titan3d" "${base[@]}" --set run.dir="$work/good" >/dev/null 2>&1
check "[ -f $work/good/snapshots/step_00000004.h5 ]" "a good run leaves snapshots 2 and 4"

refused() {  # case name, expected message regex; the damaged copy is in $work/<case>
  local name=$1 pattern=$2
  out=$("$titan3d" resume "$work/$name/snapshots/step_00000004.h5" "${common[@]}" \
        --set run.dir="$work/$name.r" 2>&1); rc=$?
  check "[ $rc -eq 2 ] && grep -qE \"$pattern\" <<<\"\$out\"" "$name snapshot refused (rc $rc)"
  echo "  $out"
}
damaged() { rm -rf "$work/$1"; cp -r "$work/good" "$work/$1"; }

damaged truncated
shard=$work/truncated/snapshots/step_00000004/rank00000.h5
truncate -s $(( $(stat -c %s "$shard") - 4096 )) "$shard"
refused truncated "rank00000.h5.*truncated"

damaged flipped
shard=$work/flipped/snapshots/step_00000004/rank00000.h5
off=$(( $(stat -c %s "$shard") / 2 ))
byte=$(od -An -tu1 -j $off -N1 "$shard" | tr -d ' ')
printf "$(printf '\\%03o' $(( byte ^ 0x10 )))" | dd of="$shard" bs=1 seek=$off conv=notrunc status=none
refused flipped "rank00000.h5.*damaged"

damaged parentless
rm "$work/parentless/snapshots/step_00000002.h5"  # retention gone wrong, or a partial copy
refused parentless "step_00000004.h5. is incremental and needs its parent .*step_00000002.h5.*missing"

damaged incomplete
rm "$work/incomplete/snapshots/step_00000004.h5"  # as if rank 0 died before the commit record
refused incomplete "step_00000004.h5.*never committed"
out=$("$titan3d" "${base[@]}" --set run.dir="$work/incomplete" --set snapshot.resume=latest \
      --set run.log_level=info 2>&1)
check "grep -q 'resumed from .*step_00000002.h5 after step 2' <<<\"\$out\"" \
  "latest skips the uncommitted snapshot and resumes from step 2"

out=$("$titan3d" resume "$work/good/snapshots/step_00000004.h5" "${common[@]}" --set model.dim=32 \
      --set run.dir="$work/dim.r" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'model.dim is 128 in the snapshot but 32' <<<\"\$out\"" \
  "a resume that changes the model's shape is refused" || echo "$out"

# kill -9 of one rank of two in the middle of writing its shard of the step-4 snapshot.
two=(train "$recipe" "${common[@]}" --set parallel.pp=1 --set parallel.dp=2 --set parallel.tp=1
     --set train.steps=4 --set snapshot.every=2 --set run.dir="$work/killed")
out=$(T3D_SNAPSHOT_FAULT=kill:4:1 timeout 120 "$titan3d" "${two[@]}" 2>&1); rc=$?
check "[ $rc -ne 0 ] && [ -f $work/killed/snapshots/step_00000002.h5 ] && [ ! -f $work/killed/snapshots/step_00000004.h5 ]" \
  "rank 1 killed mid-write: the job ends (rc $rc), snapshot 4 uncommitted, snapshot 2 intact" || echo "$out"
out=$("$titan3d" "${two[@]}" --set snapshot.resume=latest --set run.log_level=info 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q 'resumed from .*step_00000002.h5 after step 2' <<<\"\$out\" && [ -f $work/killed/snapshots/step_00000004.h5 ]" \
  "after the kill, resume = latest continues from step 2 and commits step 4" || echo "$out"

# A write that fails (injected, as a full disk would) and one that cannot even start (a file is
# in the way of the shard directory): reported, nothing committed, the last good one kept.
out=$(T3D_SNAPSHOT_FAULT=fail:4:0 "$titan3d" "${base[@]}" --set run.dir="$work/failed" 2>&1); rc=$?
# The failed snapshot was the run's last: its final state is lost, so the run ends with exit 2.
check "[ $rc -eq 2 ] && grep -q 'snapshot at step 4 failed on rank 0: .*injected write failure.*last good snapshot is .*step_00000002.h5' <<<\"\$out\" && grep -q 'snapshots failed at step(s) 4 .*the run ends without its final state' <<<\"\$out\" && [ ! -f $work/failed/snapshots/step_00000004.h5 ] && [ ! -e $work/failed/snapshots/step_00000004/rank00000.h5.tmp ]" \
  "an injected write failure is reported; snapshot 2 stays the last good one; exit 2 (rc $rc)" || echo "$out"
check "grep -q '\"snapshot_step\": 4, \"snapshot_ok\": 0' $work/failed/metrics.jsonl" \
  "the failure is in metrics.jsonl"
mkdir -p "$work/blocked/snapshots" && touch "$work/blocked/snapshots/step_00000004"
out=$("$titan3d" "${base[@]}" --set run.dir="$work/blocked" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshot at step 4 failed on rank 0: cannot create snapshot directory' <<<\"\$out\" && [ -f $work/blocked/snapshots/step_00000002.h5 ]" \
  "a shard directory that cannot be created is reported; snapshot 2 kept" || echo "$out"
out=$("$titan3d" resume "$work/failed/snapshots/step_00000002.h5" "${common[@]}" \
      --set run.dir="$work/failed.r" --set snapshot.dir="$work/failed.r/snapshots" 2>&1); rc=$?
check "[ $rc -eq 0 ] && diff <(losses_from $work/good/metrics.jsonl 3) <(losses $work/failed.r/metrics.jsonl) >/dev/null" \
  "the kept snapshot resumes exactly" || echo "$out"
# Retention: resumed at 2, snapshots 3 (full) 4 5 6 (incremental) 7 (full) 8 (incremental on 7).
# keep = 1 leaves the newest and the base it needs, and removes the never-committed leftovers.
rm "$work/blocked/snapshots/step_00000004"  # the blocking file
"$titan3d" "${base[@]}" --set run.dir="$work/blocked" --set train.steps=8 --set snapshot.every=1 \
  --set snapshot.keep=1 --set snapshot.resume=latest >/dev/null 2>&1
check "[ \"\$(cd $work/blocked/snapshots && echo step_*)\" = 'step_00000007 step_00000007.h5 step_00000008 step_00000008.h5' ]" \
  "snapshot.keep = 1 retains step 8 and its base, step 7" || ls "$work/blocked/snapshots"
exit $fail
