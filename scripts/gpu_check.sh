#!/usr/bin/env bash
# Everything the GPU needs checking, in one go on a machine with an NVIDIA GPU (within 570 s,
# GPU_CHECK_BUDGET_S): the CUDA backend's tests against the CPU backend, the Model's training steps on the
# GPU against the CPU's, titan3d training on the GPU (scripts/gpu_train_check.sh),
# compute-sanitizer's memcheck and racecheck over its kernels, the kernel benchmark beside
# PyTorch's at the same shapes, and last titan3d's training step against the same LLaMA in
# PyTorch, eager and compiled (bench/gpu/bench_gpu.sh).
#
# It runs the binaries of gpu_bundle/bundle.tar.xz, made here by scripts/gpu_bundle.sh (a GPU
# machine may lack OpenBLAS, oneDNN, MPI and HDF5; the bundle brings the libraries the binaries
# need besides CUDA's). CONTRIBUTING.md says how to carry it. Logs go to $OUT/gpu_check (or
# /tmp/gpu_check); the summary is printed at the end. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${OUT:-/tmp}/gpu_check
mkdir -p "$logs"
status=0
# The whole check fits one call of the device tool (10 minutes): each step's limit is cut to what
# is left of GPU_CHECK_BUDGET_S (default 570 s), and a step with no time left is reported as not
# run. The longest steps come last, so a short lease still returns the tests.
budget=${GPU_CHECK_BUDGET_S:-570}
step() {  # step NAME SECONDS CMD...: runs CMD with a time limit, logs it, records pass/fail
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS - 5))
  if [ $left -lt 20 ]; then
    printf '%-22s %-28s\n' "$name" "not run: out of time" | tee -a "$logs/summary.txt"
    status=1
    return
  fi
  [ $limit -le $left ] || limit=$left
  local t0=$SECONDS
  # The checks' soft deadline (gpu_env.sh out_of_time): four fifths into the hard limit, so that
  # a check stops starting runs and still prints what it compared of those that finished.
  local soft=$((limit * 4 / 5))
  GPU_STEP_DEADLINE=$(($(date +%s) + soft)) timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  local verdict=passed
  [ $rc -eq 0 ] || { verdict="FAILED (exit $rc$([ $rc -eq 124 ] && echo ", over ${limit} s"))"; status=1; }
  printf '%-22s %-28s %4d s\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$logs/summary.txt"
}

# skips STEP: on a GPU machine a test skipped for want of a GPU is a failure (it did not run);
# one skipped for what this host's CPU lacks (a bf16 GEMM to compare with) is said, not failed.
skips() {
  local reasons
  reasons=$(awk '/: Skipped$/ {why = 1; next} /SKIPPED \]/ {if (why) print name ": " text; why = 0;
    text = ""; next} /^\[ RUN/ {name = $NF} why {text = text $0 " "}' "$logs/$1.log")
  [ -n "$reasons" ] || return 0
  if grep -q "GPU" <<<"$reasons"; then
    printf '%-22s %s\n' "$1" "FAILED: GPU tests skipped on a GPU machine" | tee -a "$logs/summary.txt"
    status=1
  else
    printf '%-22s %s\n' "$1" "(tests skipped for this host's CPU, not the GPU:)" |
      tee -a "$logs/summary.txt"
  fi
  head -n 5 <<<"$reasons" | tee -a "$logs/summary.txt"
}

# isolate BINARY STEP: after a sticky CUDA error or a crash in STEP's run of BINARY, its failed and
# unreached tests each run alone (scripts/gpu_isolate.sh), so that one test's illegal address does
# not hide whether the others pass; its lines join the summary.
isolate() {
  rm -f "$logs/$2.log.isolated"
  local left=$((budget - SECONDS - 35))
  [ $left -gt 90 ] && left=90
  [ $left -ge 10 ] || return 0
  bash scripts/gpu_isolate.sh "$root/bin/$1" "$logs/$2.log" "$left" 2>&1 | tee -a "$logs/summary.txt"
}

echo "== gpu_check at $(cat gpu_bundle/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)" | tee "$logs/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$logs/summary.txt"
lscpu 2>/dev/null | grep -m1 "Model name" | tee -a "$logs/summary.txt"
[ -s gpu_bundle/bundle.tar.xz ] || { echo "no gpu_bundle/bundle.tar.xz: run scripts/gpu_bundle.sh here first"; exit 2; }
root=$(mktemp -d)
tar -C "$root" -xJf gpu_bundle/bundle.tar.xz
# CUDA's libraries from this machine: the toolkit's, else the ones PyTorch's wheels bring.
cuda_libs=/usr/local/cuda/lib64
if [ ! -e "$cuda_libs/libcublasLt.so.13" ]; then
  found=$(find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -n 1)
  [ -n "$found" ] && cuda_libs=$(dirname "$found")
fi
export LD_LIBRARY_PATH="$root/lib:$cuda_libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! "$root/bin/test_kernels_cuda" --gtest_list_tests >/dev/null 2>"$logs/load.log"; then
  echo "the test binary does not load here:"; cat "$logs/load.log"; ldd "$root/bin/test_kernels_cuda"; exit 2
fi

step gpu_tests 120 "$root/bin/test_kernels_cuda"
isolate test_kernels_cuda gpu_tests
grep -E "^GPU 0|PASSED|FAILED|SKIPPED \]" "$logs/gpu_tests.log" | sort -u | head -n 20
skips gpu_tests
# The bf16 attention tiles failing their tests (or crashing the binary) would take every bf16
# training check and benchmark below with them: run those on the fp32 tiles then, and say so.
if ! cat "$logs/gpu_tests.log" "$logs/gpu_tests.log.isolated" 2>/dev/null |
  grep -q "OK \] CudaAttentionBf16.MatchesTheCpuWithinBf16Rounding"; then  # in the run or alone
  export T3D_GPU_ATTENTION=fp32
  echo "bf16 attention         FAILED its tests: the checks below run the fp32 tiles (T3D_GPU_ATTENTION=fp32)" |
    tee -a "$logs/summary.txt"
  status=1
fi
# The whole Model on the GPU: dense and MoE models' training steps against the CPU's, twice for the
# bits.
step gpu_model 120 "$root/bin/test_model_gpu"
isolate test_model_gpu gpu_model
grep -E "OK \]|FAILED|SKIPPED \]|Failure|Expected|Which is|error" "$logs/gpu_model.log" | head -n 20
skips gpu_model
# The NCCL device communicator: every call on a one-rank group, a started reduction overlapping
# compute, two ranks sharing the GPU staged, and selfcheck's device_comm rows
# (scripts/gpu_nccl_check.sh, ~10 s and three selfcheck --quick runs).
step gpu_nccl 60 bash "$root/bin/gpu_nccl_check.sh" "$root" "$PWD" "$logs/nccl"
grep -E "NCCL|OK \]|FAIL|SKIPPED" "$logs/gpu_nccl.log" | head -n 12
# titan3d itself on the GPU (one rank, fp32): against the CPU, twice, and resumed from a snapshot.
step gpu_train 300 bash "$root/bin/gpu_train_check.sh" "$root" "$PWD" "$logs/train"
grep -E "device:|GPU|FAIL|within|eval|^device" "$logs/gpu_train.log" | head -n 30
# Every layout on the GPU (ranks sharing it): the pipeline schedules and ZeRO stages to the bit,
# tp+SP, cp, ep within the CPU path's tolerance, a kill -9 and restart, memcheck over training.
step gpu_layouts 150 bash "$root/bin/gpu_layout_check.sh" "$root" "$PWD" "$logs/layouts"
grep -E "vs|FAIL|sanitizer" "$logs/gpu_layouts.log" | head -n 24
sanitized='CudaElementwise.*:CudaRows.*:CudaLoss.*:CudaAttention.*:CudaAttentionBf16.*:CudaMoe.*:CudaSharedGate.*:CudaDispatch.*:CudaDevice.ADeviceArenaNeedsAGpu'
if command -v compute-sanitizer >/dev/null || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # Some GPU machines' sandboxes (gVisor's) make compute-sanitizer refuse the device ("Device
  # not supported"): one short test under it first, so that a refusal costs seconds, not the two
  # runs' minutes, and is said as what it is (not run), not as a memory error.
  timeout 60 "$cs" --tool memcheck "$root/bin/test_kernels_cuda" \
    --gtest_filter=CudaDevice.NamesTheGpu >"$logs/sanitizer_probe.log" 2>&1
  if grep -qi "device not supported" "$logs/sanitizer_probe.log"; then
    echo "memcheck, racecheck    not run: compute-sanitizer refused this GPU ($(grep -i -m1 -o 'device not supported[^.]*' "$logs/sanitizer_probe.log"))" |
      tee -a "$logs/summary.txt"
  else
    step memcheck 120 "$cs" --tool memcheck --error-exitcode 9 "$root/bin/test_kernels_cuda" --gtest_filter="$sanitized"
    step racecheck 120 "$cs" --tool racecheck --error-exitcode 9 "$root/bin/test_kernels_cuda" --gtest_filter="$sanitized"
    grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$logs/memcheck.log" "$logs/racecheck.log" 2>/dev/null
  fi
else
  echo "compute-sanitizer not found: memcheck and racecheck not run" | tee -a "$logs/summary.txt"
fi
step bench_titan3d 90 "$root/bin/bench_cuda"
python=$(command -v python3 || command -v python)
step bench_pytorch 120 "$python" "$root/bin/bench_cuda_torch.py"

echo "== kernels at a ~1 B LLaMA's shapes: median ms (rate), titan3d vs PyTorch on this GPU" | tee -a "$logs/summary.txt"
grep -h "^DEVICE" "$logs/bench_titan3d.log" | tee -a "$logs/summary.txt"
grep -h "^PYTORCH" "$logs/bench_pytorch.log" | tee -a "$logs/summary.txt"
"$python" - "$logs/bench_titan3d.log" "$logs/bench_pytorch.log" <<'PY' | tee -a "$logs/summary.txt"
import sys
def read(path):
    rows = {}
    try:
        for line in open(path):
            if line.startswith("BENCH "):
                _, name, ms, rate, unit = line.split()
                rows[name] = (float(ms), float(rate), unit)
    except OSError:
        pass
    return rows
ours, theirs = read(sys.argv[1]), read(sys.argv[2])
print(f"{'op':<28} {'titan3d ms':>11} {'PyTorch ms':>11} {'speed vs PyTorch':>17}  rate (titan3d / PyTorch)")
for name, (ms, rate, unit) in ours.items():
    if name in theirs:
        tms, trate, _ = theirs[name]
        print(f"{name:<28} {ms:11.3f} {tms:11.3f} {tms / ms:16.2f}x  {rate:.2f} / {trate:.2f} {unit}")
    else:
        print(f"{name:<28} {ms:11.3f} {'-':>11} {'-':>17}  {rate:.2f} {unit}")
PY
# Last, as the longest: titan3d against the same LLaMA in PyTorch (eager, compiled), ~125 M and ~1 B.
step bench_e2e 300 bash bench/gpu/bench_gpu.sh "$root" "$PWD" "$logs/e2e"
echo "== end to end, bf16: titan3d vs PyTorch on this GPU" | tee -a "$logs/summary.txt"
grep -E "^model|^125m|^1b|^gpu-bench|^snapshot-bench|FAIL" "$logs/bench_e2e.log" | tee -a "$logs/summary.txt"
# Then, if time is left: the 8-expert top-2 MoE against the dense model of equal active
# parameters (issue 41), titan3d and PyTorch alike.
step bench_moe 240 env SIZES="moe moe_dense" bash bench/gpu/bench_gpu.sh "$root" "$PWD" "$logs/e2e_moe"
grep -E "^model|^moe|FAIL" "$logs/bench_moe.log" | tee -a "$logs/summary.txt"
echo "== summary (logs in $logs)"
cat "$logs/summary.txt" | grep -E "passed|FAILED|not run"
exit $status
