#!/usr/bin/env bash
# Snapshots of format version 1 (incremental shards as XOR masks) stay readable: the fixture chain
# (fixtures/format1, written by the last version writing it) evaluates to the numbers that version
# computed, and resumes into format-2 snapshots. The fixture pins OpenBLAS, whose kernels differ by
# CPU (its SkylakeX and Haswell kernels, an AVX-512 CPU's and Zen 3's, give losses 1.7e-10 apart):
# bit for bit on the kind of CPU that wrote it (AVX-512), within 1e-9 elsewhere. The row loops are
# pinned to their SSE2 build (T3D_SIMD), which every x86-64 runs and which computed the fixture's
# numbers: their AVX2 and AVX-512 builds contract to FMAs (1e-10 apart; kernels/row_math.h). A chain
# read wrongly (a mask not applied, a chunk from the wrong parent) moves the loss by far more.
set -u
source "$(dirname "$0")/common.sh"
repo=$(cd "$(dirname "$0")/../.." && pwd)
cp -r "$(dirname "$0")/fixtures/format1" "$work/snapshots"
T3D_SIMD=sse2 "$titan3d" eval "$work/snapshots/step_00000004.h5" --set data.path="$repo/data/fortunes.txt" \
  --json "$work/eval.json" >"$work/eval.log" 2>&1
loss_of() { sed -E 's/.*"loss": ([^,}]+).*/\1/' "$1"; }
if grep -qw avx512f /proc/cpuinfo &&
  ! [[ "$(echo "${ONEDNN_MAX_CPU_ISA:-${DNNL_MAX_CPU_ISA:-}}" | tr a-z A-Z)" =~ ^(SSE41|AVX|AVX2|AVX2_VNNI)$ ]] &&
  [[ "${OPENBLAS_CORETYPE:-SkylakeX}" =~ ^(SkylakeX|Cooperlake|SapphireRapids)$ ]]; then
  check "cmp -s '$work/eval.json' '$(dirname "$0")/fixtures/format1/eval.json'" \
    "eval of the format-1 chain (step 4 XOR on step 2) equals the writing version's" ||
    { cat "$work/eval.log" "$work/eval.json"; }
else
  check "awk -v a=\"\$(loss_of '$work/eval.json')\" -v b=\"\$(loss_of '$(dirname "$0")/fixtures/format1/eval.json')\" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0 && d <= 1e-9 * b) }'" \
    "eval of the format-1 chain (step 4 XOR on step 2) is the writing version's within 1e-9 (another CPU's OpenBLAS kernels)" ||
    { cat "$work/eval.log" "$work/eval.json"; }
fi
"$titan3d" resume "$work/snapshots/step_00000004.h5" --set data.path="$repo/data/fortunes.txt" \
  --set train.steps=6 --set run.dir="$work/resumed" --set run.max_restarts=0 \
  >"$work/resume.log" 2>&1
check "[ \$? -eq 0 ] && [ \"\$(h5dump -a format_version '$work/resumed/snapshots/step_00000006.h5' | grep -o '(0): [0-9]*')\" = '(0): 2' ]" \
  "resumed from it, the run writes format-2 snapshots" || tail -5 "$work/resume.log"
exit $fail
