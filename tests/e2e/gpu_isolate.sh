#!/usr/bin/env bash
# scripts/gpu_isolate.sh (what scripts/gpu_check.sh runs after each GPU test binary), on a stand-in
# for a GPU test binary, so it is checked here although no GPU is: after a sticky CUDA error
# and after a crash, each failed or unreached test runs alone, and the culprit is named; a run
# that finished without a sticky error is left alone; disabled and passed tests never rerun.
set -u
source "$(dirname "$0")/lib.sh"
make_work_dir
isolate=$repo/scripts/gpu_isolate.sh
fake=$work/test_fake_cuda
cat > "$fake" <<'FAKE'
#!/usr/bin/env bash
# A.one passes; A.two hits an illegal address (also alone), which poisons B.three in the same
# process; alone, B.three passes. FAKE_MODE=crash dies in A.two; FAKE_MODE=plain fails A.two by an
# assertion, with no CUDA error.
case "${1:-}" in
  --gtest_list_tests) printf 'A.\n  one\n  two\n  DISABLED_off\nB.\n  three\n'; exit 0 ;;
  --gtest_filter=*)
    t=${1#--gtest_filter=}
    echo "[ RUN      ] $t"
    [ "$t" = A.two ] && { echo "an illegal memory access was encountered"; echo "[  FAILED  ] $t (1 ms)"; exit 1; }
    echo "[       OK ] $t (1 ms)"; exit 0 ;;
esac
echo "[ RUN      ] A.one"; echo "[       OK ] A.one (1 ms)"; echo "[ RUN      ] A.two"
[ "${FAKE_MODE:-}" = crash ] && kill -SEGV $$
if [ "${FAKE_MODE:-}" = plain ]; then
  echo "Expected: 1, which is: 2"; echo "[  FAILED  ] A.two (1 ms)"
  echo "[ RUN      ] B.three"; echo "[       OK ] B.three (1 ms)"
else
  for t in A.two B.three; do
    [ $t = B.three ] && echo "[ RUN      ] B.three"
    echo "cudaMemcpy failed: an illegal memory access was encountered"; echo "[  FAILED  ] $t (1 ms)"
  done
fi
echo "[==========] 3 tests from 2 test suites ran. (3 ms total)"
exit 1
FAKE
chmod +x "$fake"
fail=0
for mode in sticky crash plain; do
  (FAKE_MODE=$mode "$fake" > "$work/$mode.log" 2>&1)
  bash "$isolate" "$fake" "$work/$mode.log" 20 > "$work/$mode.out" 2>&1
  rc=$?
  echo "--- $mode (exit $rc)"; cat "$work/$mode.out"
  [ $rc -eq 0 ] || { echo "FAIL: exit $rc"; fail=1; }
done
for mode in sticky crash; do
  out=$work/$mode.out
  check "grep -q '^  A.two: FAILED alone' $out && grep -q '^  B.three: passed alone' $out && grep -q 'first to look at: A.two' $out" \
    "$mode: the culprit fails alone and is named; the poisoned test passes alone"
  check "! grep -q 'A.one\|DISABLED' $out && [ \$(grep -c '^  ' $out) -eq 3 ]" \
    "$mode: a passed test and a disabled one are not rerun"
done
check "grep -q 'sticky CUDA error' $work/sticky.out && grep -q 'did not finish' $work/crash.out" \
  "each says why it reran"
check "[ ! -s $work/plain.out ]" "a finished run without a CUDA error: its failure is its own, nothing rerun"
exit $fail
