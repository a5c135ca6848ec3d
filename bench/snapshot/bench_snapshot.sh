#!/usr/bin/env bash
# Snapshot cost on a real training run: stall (time training waited) as a share of step time, and
# write time, with snapshot.async on and off. Reads metrics.jsonl; prints one row per mode.
#   bash bench/snapshot/bench_snapshot.sh [build/apps/titan3d] [recipe] [extra --set ...]
set -eu
titan3d=${1:-build/apps/titan3d}
recipe=${2:-recipes/default.toml}
shift $(( $# > 2 ? 2 : $# ))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
steps=40 every=5
printf '%-6s %10s %10s %12s %12s %10s %12s\n' async steps step_ms snap_bytes stall_ms write_ms stall_share
for async in true false; do
  "$titan3d" train "$recipe" --set run.dir="$work/$async" --set train.steps=$steps \
    --set snapshot.every=$every --set snapshot.async=$async --set train.val_every=0 \
    --set run.log_level=warn "$@" >/dev/null
  # Steps 2.. (step 1 warms up); stall shares are over the same steps.
  awk -v async=$async -v steps=$steps '
    /"loss"/ { match($0, /"step": [0-9]+/); s = substr($0, RSTART + 8, RLENGTH - 8) + 0;
               match($0, /"step_time_s": [0-9.e-]+/); t = substr($0, RSTART + 15, RLENGTH - 15);
               if (s > 1) { st += t; n++ } }
    /"snapshot_ok": 1/ { match($0, /"snapshot_stall_s": [0-9.e-]+/); stall += substr($0, RSTART + 20, RLENGTH - 20);
               match($0, /"snapshot_write_s": [0-9.e-]+/); write += substr($0, RSTART + 20, RLENGTH - 20);
               match($0, /"snapshot_bytes": [0-9.e+]+/); bytes = substr($0, RSTART + 18, RLENGTH - 18); k++ }
    END { printf "%-6s %10d %10.1f %12d %12.2f %10.1f %11.2f%%\n", async, n, 1e3 * st / n, bytes,
                 1e3 * stall / k, 1e3 * write / k, 100 * stall / st }' "$work/$async/metrics.jsonl"
done
