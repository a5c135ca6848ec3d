#!/usr/bin/env bash
# gpu_isolate.sh BINARY LOG SECONDS: after a GPU test binary's run (its output in LOG), says which
# of its failures are its own. A sticky CUDA error (an illegal address, a launch failure) poisons
# the process's context, so every test after the culprit fails too, and a crash ends the run
# before the rest are reached: then each failed or unreached test runs again alone, in its own
# process (30 s each, SECONDS in all), and one line per test says how it did alone; the first
# that fails alone is the one to look at first. Without a sticky error or a crash the failures
# are the tests' own: nothing is rerun. Its lines go to standard output (scripts/gpu_check.sh puts
# them in its summary); the reruns' output to LOG.isolated. Exit status 0 unless BINARY cannot
# list its tests.
set -uo pipefail
binary=$1 log=$2 budget=${3:-60}
sticky='illegal memory access|unspecified launch failure|misaligned address|illegal instruction|device-side assert|an illegal|cudaErrorLaunch|context is destroyed|CUDA_ERROR_'
name=$(basename "$binary")
all=$("$binary" --gtest_list_tests 2>/dev/null | awk '
  /^[^ ]/ { suite = $1; next }
  /^  [^ ]/ { print suite $1 }') || { echo "$name: cannot list its tests"; exit 1; }
finished=$(grep -c '^\[==========\] .* ran\.' "$log" 2>/dev/null)
if [ "${finished:-0}" -gt 0 ] && ! grep -qE "$sticky" "$log"; then
  exit 0  # a finished run without a sticky error: its failures are its own
fi
done_ok=$(sed -n 's/^\[       OK \] \([^ ]*\).*/\1/p' "$log" | sort -u)
skipped=$(sed -n 's/^\[  SKIPPED \] \([^ ]*\).*/\1/p' "$log" | sort -u)
# Failed or never reached: every listed test not reported OK or skipped (disabled ones excluded).
rerun=$(comm -23 <(printf '%s\n' "$all" | grep -v '\.DISABLED_\|^DISABLED_' | sort -u) \
                 <(printf '%s\n%s\n' "$done_ok" "$skipped" | grep . | sort -u))
[ -n "$rerun" ] || exit 0
why=$([ "${finished:-0}" -gt 0 ] && echo "a sticky CUDA error" || echo "the run did not finish")
echo "$name: $why; $(printf '%s\n' "$rerun" | grep -c .) test(s) failed or not reached, each run alone:"
: > "$log.isolated"
start=$SECONDS first=""
for test in $all; do  # in the order they ran
  grep -qxF "$test" <<< "$rerun" || continue
  if [ $((SECONDS - start)) -ge "$budget" ]; then
    echo "  $test: not run alone (out of time)"
    continue
  fi
  echo "== $test" >> "$log.isolated"
  timeout 30 "$binary" --gtest_filter="$test" >> "$log.isolated" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && grep -q "^\[  SKIPPED \] $test" "$log.isolated"; then
    verdict="skipped alone"
  elif [ $rc -eq 0 ]; then
    verdict="passed alone (it failed only after another test's error)"
  else
    verdict="FAILED alone (exit $rc$([ $rc -eq 124 ] && echo ", over 30 s"))"
    [ -n "$first" ] || first=$test
  fi
  echo "  $test: $verdict"
done
[ -z "$first" ] || echo "  first to look at: $first"
exit 0
