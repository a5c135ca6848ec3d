#!/usr/bin/env bash
# What depends on the CPU's instruction set, run on an emulated CPU without AVX-512: qemu-user's
# EPYC-Milan model (AMD Zen 3: AVX2 + FMA, no AVX-512, no AVX512-BF16), whose translator has no
# AVX-512 at all, so a stray AVX-512 instruction dies with SIGILL as on the real CPU. Checks a
# change for the Zen 3 machines from any x86-64 machine (ONEDNN_MAX_CPU_ISA=AVX2 only caps what
# titan3d and oneDNN choose; this also catches what they did not choose):
#  1. the kernel tests and the GEMM-choice tests pass, the bf16 ones skipping with their reason;
#  2. an imported model evaluates to the original's loss bit for bit on that CPU (both evals run
#     emulated: mpirun starts one qemu rank, which joins as a rank started by mpirun does).
# Usage: bash scripts/check_without_avx512.sh [BUILD_DIR]   (after scripts/build.sh; ~3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bash scripts/setup.sh qemu-user
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
zen3=(qemu-x86_64 -cpu EPYC-Milan)
quiet() { grep -v "TCG doesn't support requested feature" || true; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0

# The emulated CPU really lacks AVX-512 (and has what titan3d's fp32 kernels use).
cat >"$work/isa.c" <<'EOF'
#include <stdio.h>
int main(void) {
  __builtin_cpu_init();
  printf("avx2=%d fma=%d avx512f=%d\n", !!__builtin_cpu_supports("avx2"),
         !!__builtin_cpu_supports("fma"), !!__builtin_cpu_supports("avx512f"));
  return 0;
}
EOF
cc -O2 "$work/isa.c" -o "$work/isa"
isa=$("${zen3[@]}" "$work/isa" 2>&1 | quiet)
echo "emulated CPU: $isa"
[ "$isa" = "avx2=1 fma=1 avx512f=0" ] || { echo "FAIL: the emulated CPU is not AVX2 without AVX-512"; exit 1; }

for t in kernels/test_kernels machine/test_gemm_choice; do
  bin="$build/tests/$t"
  [ -x "$bin" ] || bin=$(find "$build/tests" -name "$(basename "$t")" -type f -perm -u+x | head -1)
  log="$work/$(basename "$t").log"
  if "${zen3[@]}" "$bin" >"$log" 2>&1; then
    echo "ok   $(basename "$t"): $(grep -c '^\[       OK \]' "$log") passed, $(grep -c '^\[  SKIPPED \].*ms)$' "$log") skipped (bf16: this CPU has none)"
  else
    echo "FAIL $(basename "$t")"; grep -E '^\[  FAILED|Failure|Illegal' "$log" | head -20; fail=1
  fi
done

# Import equality, as tests/use/import.sh checks it natively: the original trains on the kind an
# import evaluates with (openblas-fp32), so equal losses compare the weights, not two kernels.
titan3d="$build/apps/titan3d"
head -c 20000 data/fortunes.txt >"$work/part.txt"
"$titan3d" train recipes/tiny.toml --set model.n_kv_heads=2 --set run.log_level=warn \
  --set hardware.gemm=openblas --set train.steps=10 --set train.val_every=0 \
  --set snapshot.every=10 --set run.dir="$work/run" >/dev/null 2>&1
snap="$work/run/snapshots/step_00000010.h5"
"$titan3d" export "$snap" --out "$work/hf" >/dev/null 2>&1
"$titan3d" import "$work/hf" --out "$work/imp" >/dev/null 2>&1
for s in "$snap" "$work/imp/step_00000000.h5"; do
  mpirun --oversubscribe -np 1 "${zen3[@]}" "$titan3d" eval "$s" --data "$work/part.txt" \
    --json "$work/$(basename "$s").json" 2>&1 | quiet | tail -1
done
a=$(sed -E 's/.*"loss": ([^,}]+).*/\1/' "$work/step_00000010.h5.json")
b=$(sed -E 's/.*"loss": ([^,}]+).*/\1/' "$work/step_00000000.h5.json")
if [ "$a" = "$b" ]; then echo "ok   the imported model's eval equals the original's ($a)"
else echo "FAIL imported eval $b, original $a"; fail=1; fi
exit $fail
