#!/usr/bin/env bash
# bf16 GEMMs (oneDNN, bf16 inputs, fp32 accumulation) end to end:
#  1. The default recipe's model, data and schedule trained 200 steps in bf16 ends within 1% of
#     fp32: the loss averaged over every 20-step window, and the last validation loss. (Layout
#     dp = 2 instead of the recipe's pp2 × dp2 × tp2, to keep the suite short: the layout does not
#     change what is computed, train_layout_equivalence shows that.) The fp32 side runs on the
#     kernels golden_losses_portable pins (OPENBLAS_CORETYPE=Haswell, T3D_SIMD=avx2, one thread
#     per rank) for the same bits on every x86-64 CPU with AVX2 and FMA, so its losses are
#     recorded once, in tests/e2e/golden/bf16_fp32_reference.txt. The file is used only while its
#     key is the SHA-256 of what those bits depend on: the portable goldens (re-recorded whenever
#     what is computed changes), recipes/default.toml, the corpus and the settings below; else
#     this script trains the fp32 run itself and says so. BF16_RECORD=1 re-records the file.
#  2. Two bf16 runs with the same choice give bit-identical losses.
#  3. The choice is recorded (run directory, snapshot) and `resume` continues with it bit for bit;
#     a resume forced onto another GEMM says that it will not be bit-identical.
#  4. precision = auto measures once per machine and shape, and the next run takes the cached
#     answer (an empty HOME, so the cache starts empty); a kind the CPU cannot run (oneDNN limited
#     to AVX2 by DNNL_MAX_CPU_ISA: no bf16 GEMMs) is left out with the reason and what auto
#     chooses from instead (no advice meant for a user who forced bf16), and auto trains fp32.
# PART (the second argument): `accuracy` runs 1-3, `auto` runs 4 (which must have the machine to
# itself: beside another test's ranks the measurement rightly keeps no cache), `all` (the default)
# both.
set -u
titan3d=$1 part=${2:-all}
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
fail=0
settings=(--set parallel.pp=1 --set parallel.tp=1 --set parallel.dp=2 --set train.val_every=100
          --set train.log_every=50)
default=(--set data.path="$corpus" "${settings[@]}")
fp32=(--set train.precision=fp32 --set hardware.gemm=openblas --set hardware.openblas_coretype=Haswell
      --set hardware.threads_per_rank=1)
bf16=(--set train.precision=bf16 --set hardware.gemm=onednn)
train() {  # train NAME RECIPE [args]
  local name=$1 recipe=$2; shift 2
  "$titan3d" train "$recipe" --set run.dir="$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { echo "FAIL: $name exited $?"; tail -20 "$work/$name.log"; exit 1; }
}
# A CPU where oneDNN cannot run bf16 GEMMs (no AVX-512) has nothing to test here.
if ! "$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=1 \
     --set train.val_every=0 --set run.dir="$work/probe" "${bf16[@]}" > "$work/probe.log" 2>&1; then
  grep -q "oneDNN cannot run" "$work/probe.log" &&
    { echo "SKIP: $(grep -o 'oneDNN cannot run.*' "$work/probe.log" | head -1)"; exit 77; }
  echo "FAIL: a one-step bf16 run exited non-zero"; tail "$work/probe.log"; exit 1
fi
if [ "$part" != auto ]; then
reference=$repo/tests/e2e/golden/bf16_fp32_reference.txt
key=$({ sha256sum < "$repo/tests/e2e/golden/portable.txt"; sha256sum < "$repo/recipes/default.toml"
        sha256sum < "$corpus"; echo "${settings[*]} ${fp32[*]}"; } | sha256sum | cut -d' ' -f1)
if [ "${BF16_RECORD:-0}" != 1 ] && grep -qx "key $key" "$reference" 2> /dev/null; then
  sed -n 's/^loss //p' "$reference" | tr , '\n' > "$work/fp32.losses"
  vf=$(sed -n 's/^val //p' "$reference")
  echo "fp32 reference: $reference"
else
  [ "${BF16_RECORD:-0}" = 1 ] ||
    echo "NOTE: $reference is not for this arithmetic, recipe or corpus: training the fp32 reference here (BF16_RECORD=1 $0 TITAN3D re-records it)"
  OPENBLAS_CORETYPE=Haswell T3D_SIMD=avx2 train fp32 "$repo/recipes/default.toml" "${default[@]}" "${fp32[@]}"
  losses "$work/fp32/metrics.jsonl" > "$work/fp32.losses"
  vf=$(sed -n 's/.*"val_loss": \([0-9.]*\).*/\1/p' "$work/fp32/metrics.jsonl" | tail -1)
  if [ "${BF16_RECORD:-0}" = 1 ]; then
    { echo "# fp32 side of tests/e2e/train_bf16.sh (1.): its losses and last validation loss; the key"
      echo "# names what they depend on. Re-record: BF16_RECORD=1 tests/e2e/train_bf16.sh build/apps/titan3d"
      echo "key $key"; echo "val $vf"; echo "loss $(paste -sd, "$work/fp32.losses")"; } > "$reference"
    echo "recorded $reference"
  fi
fi
train bf16 "$repo/recipes/default.toml" "${default[@]}" "${bf16[@]}"
grep -q '"kind": "onednn-bf16"' "$work/bf16/gemm_choice.json" && grep -q '"device": "cpu"' "$work/bf16/gemm_choice.json" ||
  { echo "FAIL: the bf16 run did not record onednn-bf16 on the cpu: $(cat "$work/bf16/gemm_choice.json")"; fail=1; }
paste "$work/fp32.losses" <(losses "$work/bf16/metrics.jsonl") | awk '
  { a += $1; b += $2; n++
    if (n % 20 == 0) { r = (b - a) / a; if (r < 0) r = -r; if (r > worst) worst = r; if (r > 0.01) bad++; a = b = 0 } }
  END { printf "bf16 vs fp32, 200 steps: worst 20-step window differs by %.3f%% (tolerance 1%%)\n", 100 * worst
        exit !(n == 200 && bad == 0) }' || { echo "FAIL: bf16 losses not within 1% of fp32"; fail=1; }
vb=$(sed -n 's/.*"val_loss": \([0-9.]*\).*/\1/p' "$work/bf16/metrics.jsonl" | tail -1)
awk -v f="$vf" -v b="$vb" 'BEGIN { d = (b - f) / f; if (d < 0) d = -d
  printf "validation loss fp32 %s, bf16 %s (%.3f%%)\n", f, b, 100 * d; exit !(f != "" && d <= 0.01) }' ||
  { echo "FAIL: bf16 validation loss not within 1% of fp32"; fail=1; }

# Repeats, snapshot and resume on the tiny recipe.
tiny=(--set data.path="$corpus" --set train.steps=10 --set train.val_every=0 --set snapshot.every=5)
train repeat_a "$repo/recipes/tiny.toml" "${tiny[@]}" "${bf16[@]}"
train repeat_b "$repo/recipes/tiny.toml" "${tiny[@]}" "${bf16[@]}"
cmp -s <(losses "$work/repeat_a/metrics.jsonl") <(losses "$work/repeat_b/metrics.jsonl") &&
  echo "bf16 repeats: identical losses over 10 steps" || { echo "FAIL: two bf16 runs differ"; fail=1; }
snap=$work/repeat_a/snapshots/step_00000005.h5
h5dump -a /recipe "$snap" 2>/dev/null | grep -q 'gemm = \\"onednn\\"\|gemm = "onednn"' ||
  h5dump -d /recipe "$snap" 2>/dev/null | grep -q 'onednn' ||
  { echo "FAIL: the snapshot's recipe does not record hardware.gemm = onednn"; fail=1; }
"$titan3d" resume "$snap" --set run.dir="$work/resumed" > "$work/resumed.log" 2>&1 ||
  { echo "FAIL: resume exited $?"; tail "$work/resumed.log"; exit 1; }
grep -q "GEMM: onednn-bf16" "$work/resumed.log" ||
  { echo "FAIL: resume did not continue on onednn-bf16"; grep GEMM "$work/resumed.log"; fail=1; }
if cmp -s <(losses "$work/repeat_a/metrics.jsonl" | tail -5) <(losses "$work/resumed/metrics.jsonl" | tail -5); then
  echo "bf16 resume: steps 6-10 identical to the straight run"
else
  echo "FAIL: the resumed bf16 run differs from the straight run"; fail=1
fi
"$titan3d" resume "$snap" --set run.dir="$work/forced" --set hardware.gemm=openblas > "$work/forced.log" 2>&1 ||
  { echo "FAIL: forced resume exited $?"; tail "$work/forced.log"; exit 1; }
grep -q "will not be bit-identical" "$work/forced.log" && grep -q "GEMM: openblas-fp32" "$work/forced.log" &&
  echo "resume onto another GEMM: warned, ran on openblas-fp32" ||
  { echo "FAIL: a resume forced onto another GEMM did not say so"; grep -E "GEMM|bit-identical" "$work/forced.log"; fail=1; }
fi

if [ "$part" != accuracy ]; then
home=$work/home
mkdir -p "$home"
HOME=$home XDG_CACHE_HOME= train auto_a "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=2 \
  --set train.val_every=0 --set train.precision=auto
HOME=$home XDG_CACHE_HOME= train auto_b "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=2 \
  --set train.val_every=0 --set train.precision=auto
kind_a=$(sed -n 's/.*"kind": "\([a-z0-9-]*\)".*/\1/p' "$work/auto_a/gemm_choice.json")
kind_b=$(sed -n 's/.*"kind": "\([a-z0-9-]*\)".*/\1/p' "$work/auto_b/gemm_choice.json")
if grep -q "GEMM: .*; measured: GFLOP/s" "$work/auto_a.log" && grep -q "GEMM: .*; cached in $home" "$work/auto_b.log" &&
   [ -n "$kind_a" ] && [ "$kind_a" = "$kind_b" ]; then
  echo "precision = auto: measured once ($kind_a), then taken from the cache"
else
  echo "FAIL: auto choice not measured then cached ($kind_a, $kind_b)"; grep -h "GEMM:" "$work"/auto_?.log; fail=1
fi
HOME=$work/home_avx2 XDG_CACHE_HOME= DNNL_MAX_CPU_ISA=AVX2 train auto_avx2 "$repo/recipes/tiny.toml" --set data.path="$corpus" \
  --set train.steps=2 --set train.val_every=0 --set train.precision=auto
# The user asked for auto: the log says what auto chose from, not how to force another precision.
if grep -q "GEMM candidate onednn-bf16 left out: oneDNN cannot run a bf16 GEMM" "$work/auto_avx2.log" &&
   grep -q "choosing among openblas-fp32, onednn-fp32" "$work/auto_avx2.log" &&
   ! grep -q 'Set hardware.gemm' "$work/auto_avx2.log" &&
   grep -q '"precision": "fp32"' "$work/auto_avx2/gemm_choice.json"; then
  echo "no bf16 GEMMs on the CPU: the candidate is left out (saying what auto chooses from), auto trains fp32"
else
  echo "FAIL: a CPU without bf16 GEMMs"; grep -h "GEMM" "$work/auto_avx2.log"; fail=1
fi
fi
exit $fail
