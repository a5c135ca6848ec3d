#!/usr/bin/env bash
# The NCCL device communicator on the GPU (docs/gpu.md): test_nccl_comm_mpi on one rank (every
# call on a group of one rank, a started reduction overlapping compute) and on two ranks sharing
# the GPU (they choose the staged path and say so). A skipped test fails: on a GPU machine it
# should have run. Then `titan3d selfcheck`'s device_comm rows (docs/selfcheck.md): one rank with
# parallel.device_comm = "nccl" opens NCCL for every group; two ranks sharing the GPU name the
# staged path and why, and measure dp × cp's bus bandwidth on device memory; forcing "nccl" there
# is a FAILED row naming dp × cp and the shared GPU (exit 5), not a crash or a hang.
# Usage: gpu_nccl_check.sh BUNDLE_ROOT REPO LOG_DIR (as gpu_check.sh calls it).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" "$@"
cd "$repo"
status=0
# One rank: the communicator's tests (the choice's test needs two ranks); two ranks: all of them,
# each rank's one-rank communicators beside the other's on the GPU.
for np in 1 2; do
  filter='*'
  [ "$np" = 1 ] && filter='NcclComm.*'
  mpirun --allow-run-as-root --oversubscribe -np "$np" "$root/bin/test_nccl_comm_mpi" \
    --gtest_color=no --gtest_filter="$filter" >"$logs/nccl_np$np.log" 2>&1 ||
    { echo "np $np: FAILED"; status=1; }
  grep -E "OK \]|FAILED|SKIPPED \]|Failure|no GPU|no NCCL" "$logs/nccl_np$np.log" | sort -u
  if grep -q "SKIPPED \]" "$logs/nccl_np$np.log"; then
    echo "np $np: FAILED: tests skipped on a GPU machine"
    status=1
  fi
done
# selfcheck NAME EXPECTED_RC PATTERN... [-- titan3d args]: every PATTERN (grep -E) in its table.
selfcheck() {
  local name=$1 want=$2 rc
  shift 2
  local patterns=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do patterns+=("$1"); shift; done
  shift
  titan3d selfcheck --quick --set hardware.device="$device" --set run.dir="$logs/$name" "$@" \
    >"$logs/$name.log" 2>&1
  rc=$?
  [ "$rc" = "$want" ] || { echo "$name: FAILED: exit $rc, not $want"; status=1; }
  for p in "${patterns[@]}"; do
    grep -qE "$p" "$logs/$name.log" || { echo "$name: FAILED: no line matches '$p'"; status=1; }
  done
  grep -E "^(device_comm|bandwidth .*device memory)" "$logs/$name.log"
}
selfcheck selfcheck_np1_nccl 0 '^device_comm +tp +nccl +OK +NCCL ' \
  '^device_comm +dp × cp +nccl +OK +NCCL .*\(1 rank, its own GPU\)' \
  -- --np 1 --set parallel.device_comm=nccl
selfcheck selfcheck_np2 0 '^device_comm +dp × cp +staged +OK +staged through host memory \(ranks 0 and 1 share GPU' \
  '^device_comm +tp +staged +OK +staged through host memory \(one rank' \
  '^bandwidth +dp × cp +staged 1 MiB +- +all_reduce .* busbw +([0-9]*[1-9][0-9]*\.[0-9]+|0\.[0-9]*[1-9][0-9]*) GB/s +device memory' \
  -- --np 2
selfcheck selfcheck_np2_nccl 5 '^device_comm +dp × cp +refused +FAILED +world ranks 0,1: parallel.device_comm = "nccl", but .* share GPU' \
  '^FAILED: .*device_comm on dp × cp' -- --np 2 --set parallel.device_comm=nccl
exit $status
