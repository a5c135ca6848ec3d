#!/usr/bin/env bash
# Snapshot cost on a real training run, from the run's own metrics.jsonl: the stall (time training
# waited) as a share of step time, the write time, and the size of full and incremental
# snapshots as a share of the raw state (4 bytes per parameter and moment element). Several runs
# per mode; every figure printed is the median over the runs.
#   bash bench/snapshot/bench_snapshot.sh [build/apps/titan3d] [recipe] [extra --set ...]
#   RUNS=3 STEPS=40 EVERY=5 MODES="..." to change the defaults.
set -eu
titan3d=${1:-build/apps/titan3d}
recipe=${2:-recipes/default.toml}
shift $(( $# > 2 ? 2 : $# ))
runs=${RUNS:-3} steps=${STEPS:-40} every=${EVERY:-5}
# name:async:deflate:full_every
modes=${MODES:-"sync-raw:false:0:1 async-raw:true:0:1 async-incr-raw:true:0:4 async-deflate1:true:1:1 async-incr-deflate1:true:1:4"}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One line per run: step_ms stall_ms write_ms stall_share% full_MB full_share% incr_MB incr_share%
# (steps 2.. only: step 1 warms up; shares of the same steps; "-" where a run had no such snapshot).
summarize() {
  awk '
    function field(name,   v) { if (!match($0, "\"" name "\": [0-9.e+-]+")) return ""; v = substr($0, RSTART, RLENGTH); sub(/.*: /, "", v); return v + 0 }
    /"loss"/ { s = field("step"); if (s > 1) { st += field("step_time_s"); n++ } }
    /"snapshot_ok": 1/ { stall += field("snapshot_stall_s"); write += field("snapshot_write_s"); k++
      if (field("snapshot_incremental") == 1) { ib += field("snapshot_bytes"); ir += field("snapshot_raw_bytes"); ni++ }
      else { fb += field("snapshot_bytes"); fr += field("snapshot_raw_bytes"); nf++ } }
    END { printf "%.1f %.2f %.1f %.2f %s %s %s %s\n", 1e3 * st / n, 1e3 * stall / k, 1e3 * write / k, 100 * stall / st,
            nf ? sprintf("%.2f", fb / nf / 1e6) : "-", nf ? sprintf("%.1f", 100 * fb / fr) : "-",
            ni ? sprintf("%.2f", ib / ni / 1e6) : "-", ni ? sprintf("%.1f", 100 * ib / ir) : "-" }' "$1"
}
# Column-wise median of the rows on stdin ("-" stays "-").
median() {
  awk '{ for (i = 1; i <= NF; i++) v[i, NR] = $i; nf = NF }
       END { for (i = 1; i <= nf; i++) { m = 0; for (r = 1; r <= NR; r++) if (v[i, r] != "-") a[++m] = v[i, r] + 0
               if (!m) { printf "%s ", "-"; continue }
               for (x = 1; x <= m; x++) for (y = x + 1; y <= m; y++) if (a[y] < a[x]) { t = a[x]; a[x] = a[y]; a[y] = t }
               printf "%s ", (m % 2) ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2 }
             print "" }'
}

printf '%-20s %8s %9s %9s %9s %10s %9s %10s %9s\n' mode step_ms stall_ms write_ms stall_% full_MB full_% incr_MB incr_%
for mode in $modes; do
  IFS=: read -r name async deflate full_every <<<"$mode"
  for r in $(seq 1 "$runs"); do
    dir="$work/$name.$r"
    "$titan3d" train "$recipe" --set run.dir="$dir" --set train.steps="$steps" \
      --set snapshot.every="$every" --set snapshot.async="$async" --set snapshot.deflate="$deflate" \
      --set snapshot.full_every="$full_every" --set snapshot.keep=100 --set train.val_every=0 \
      --set run.log_level=warn "$@" >/dev/null
    summarize "$dir/metrics.jsonl"
  done | median | awk -v name="$name" '{ printf "%-20s %8s %9s %9s %9s %10s %9s %10s %9s\n", name, $1, $2, $3, $4, $5, $6, $7, $8 }'
done
