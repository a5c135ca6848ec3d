#!/usr/bin/env bash
# The NCCL device communicator on the GPU (docs/gpu.md): test_nccl_comm_mpi on one rank (every
# call on a group of one rank, a started reduction overlapping compute) and on two ranks sharing
# the GPU (they choose the staged path and say so). A skipped test fails: on a GPU machine it
# should have run. Usage: gpu_nccl_check.sh BUNDLE_ROOT REPO LOG_DIR (as gpu_check.sh calls it).
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
exit $status
