#!/usr/bin/env bash
# Snapshots of format version 1 (incremental shards as XOR masks) stay readable: the fixture chain
# (fixtures/format1, written by the last version writing it) evaluates to the very numbers that
# version computed, and resumes into format-2 snapshots.
set -u
source "$(dirname "$0")/common.sh"
repo=$(cd "$(dirname "$0")/../.." && pwd)
cp -r "$(dirname "$0")/fixtures/format1" "$work/snapshots"
"$titan3d" eval "$work/snapshots/step_00000004.h5" --set data.path="$repo/data/fortunes.txt" \
  --json "$work/eval.json" >"$work/eval.log" 2>&1
check "cmp -s '$work/eval.json' '$(dirname "$0")/fixtures/format1/eval.json'" \
  "eval of the format-1 chain (step 4 XOR on step 2) equals the writing version's" ||
  { cat "$work/eval.log" "$work/eval.json"; }
"$titan3d" resume "$work/snapshots/step_00000004.h5" --set data.path="$repo/data/fortunes.txt" \
  --set train.steps=6 --set run.dir="$work/resumed" --set run.max_restarts=0 \
  >"$work/resume.log" 2>&1
check "[ \$? -eq 0 ] && [ \"\$(h5dump -a format_version '$work/resumed/snapshots/step_00000006.h5' | grep -o '(0): [0-9]*')\" = '(0): 2' ]" \
  "resumed from it, the run writes format-2 snapshots" || tail -5 "$work/resume.log"
exit $fail
