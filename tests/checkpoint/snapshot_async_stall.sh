#!/usr/bin/env bash
# Async snapshots: training waits for the copy to staging memory, not for the write (which
# deflates and syncs). Timed, so it runs alone (tests/CMakeLists.txt); snapshot_resume.sh checks
# the bits of the same runs.
set -u
source "$(dirname "$0")/common.sh"
"$titan3d" train "$recipe" "${common[@]}" --set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1 \
  --set train.steps=4 --set snapshot.every=2 --set snapshot.deflate=1 --set snapshot.staging_gib=1 \
  --set run.dir="$work/one" >"$work/one.log" 2>&1
check "[ \$? -eq 0 ]" "1 rank, snapshots at steps 2 and 4" || cat "$work/one.log"
# The first snapshot of a run only: a later one also waits for its predecessor when the disk is
# slower than snapshot.every steps, which says nothing about async.
stall_vs_write() {
  grep '"snapshot_ok": 1' "$1" | head -1 |
    sed -E 's/.*"snapshot_stall_s": ([^,]+),.*"snapshot_write_s": ([^,]+),.*/\1 \2/' |
    awk '{ s += $1; w += $2 } END { printf "first snapshot: stall %.1f ms, write %.1f ms\n", 1e3 * s, 1e3 * w; exit !(NR == 1 && s < w / 2) }'
}
check "stall_vs_write $work/one/metrics.jsonl" "async snapshot: training stalls for less than half the write" ||
  stall_vs_write "$work/one/metrics.jsonl"
exit $fail
