#!/usr/bin/env bash
# What replay costs (run.replay_every, docs/resilience.md): the same recipe with replay off and
# with replay every N steps, run alternately (off, on, off, on, ...) so that load from elsewhere
# hits both alike. Per run: the mean step time over steps 2.. (step 1 warms up) and, for the replay
# runs, the replay's own share Σ replay_s / Σ step_time_s from their metrics. Printed: the medians
# over the rounds, the step-time ratio on/off and the measured share; the CPU is named.
#   bash bench/e2e/bench_replay.sh [build/apps/titan3d] [recipe] [extra --set ...]
#   ROUNDS=3 STEPS=300 EVERY=100 to change the defaults (EVERY=100: the issue's figure).
set -eu
titan3d=${1:-build/apps/titan3d}
recipe=${2:-recipes/default.toml}
shift $(( $# > 2 ? 2 : $# ))
rounds=${ROUNDS:-3} steps=${STEPS:-300} every=${EVERY:-100}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# "mean_step_ms replay_share%" of one run's metrics (steps 2..).
summarize() {
  awk '
    function field(name,   v) { if (!match($0, "\"" name "\": [0-9.e+-]+")) return 0; v = substr($0, RSTART, RLENGTH); sub(/.*: /, "", v); return v + 0 }
    /"loss"/ { s = field("step"); if (s > 1) { st += field("step_time_s"); rp += field("replay_s"); n++ } }
    END { printf "%.2f %.3f\n", 1e3 * st / n, 100 * rp / st }' "$1"
}
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
run() {  # run NAME REPLAY_EVERY [extra --set ...]
  local name=$1 replay=$2; shift 2
  "$titan3d" train "$recipe" --set run.dir="$work/$name" --set train.steps="$steps" \
    --set train.val_every=0 --set snapshot.every=0 --set run.replay_every="$replay" \
    --set run.log_level=warn "$@" >/dev/null 2>&1
  summarize "$work/$name/metrics.jsonl"
}
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; recipe $recipe ${*:-}; $steps steps, replay every $every, $rounds rounds"
: > "$work/off" ; : > "$work/on" ; : > "$work/share"
for r in $(seq 1 "$rounds"); do
  read -r off _ < <(run "off$r" 0 "$@")
  read -r on share < <(run "on$r" "$every" "$@")
  echo "round $r: step ${off} ms off, ${on} ms with replay (x$(awk -v a="$on" -v b="$off" 'BEGIN { printf "%.4f", a / b }')); replay's own share ${share}%"
  echo "$off" >> "$work/off"; echo "$on" >> "$work/on"; echo "$share" >> "$work/share"
done
off=$(median < "$work/off") on=$(median < "$work/on") share=$(median < "$work/share")
awk -v off="$off" -v on="$on" -v share="$share" -v every="$every" 'BEGIN {
  printf "replay-bench: median step %.2f ms off, %.2f ms with replay_every = %d: x%.4f (%+.2f%%); replay_s share %.3f%%\n",
    off, on, every, on / off, 100 * (on / off - 1), share }'
