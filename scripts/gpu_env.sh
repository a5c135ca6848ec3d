# Sourced by the GPU checks (gpu_train_check.sh, gpu_layout_check.sh) with their arguments
# BUNDLE_ROOT REPO LOG_DIR: sets root, repo, logs, device (DEVICE, default cuda) and here (the
# checks' own directory, absolute: they cd to the repository), makes the log directory, and puts
# the unpacked bundle's binaries, Open MPI (relocated by OPAL_PREFIX) and libraries first on the
# paths.
root=$1 repo=$2 logs=$3
device=${DEVICE:-cuda}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$logs"
export PATH="$root/bin:$PATH" OPAL_PREFIX="$root/ompi"
# Open MPI's configuration and PMIx's plugins and help files, from the bundle too (gpu_bundle.sh:
# OPAL_PREFIX moves neither): the MCA parameters the runs here are made with.
export OPAL_SYSCONFDIR="$root/ompi/etc" PMIX_PKGLIBDIR="$root/pmix/lib/pmix" \
  PMIX_PKGDATADIR="$root/pmix/share/pmix"
export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL for the device communicator (loaded at run time, never bundled: docs/gpu.md): the one
# PyTorch's wheel brings (nvidia/nccl/lib under site-packages, the user's too: a pip install
# --user), unless T3D_NCCL_LIBRARY names one.
if [ -z "${T3D_NCCL_LIBRARY:-}" ]; then
  sites=$(python3 -c 'import site; print(*site.getsitepackages(), site.getusersitepackages())' 2>/dev/null)
  for site in $sites; do
    if [ -f "$site/nvidia/nccl/lib/libnccl.so.2" ]; then
      export T3D_NCCL_LIBRARY="$site/nvidia/nccl/lib/libnccl.so.2"
      break
    fi
  done
fi
# The step's soft deadline (GPU_STEP_DEADLINE, seconds since the epoch: gpu_check.sh sets it
# before its hard limit): past it a check starts no more runs, so that what it compares of the
# runs that did finish still prints, instead of a hard limit ending it with nothing said.
out_of_time() {  # out_of_time NAME: true (and says so) when NAME is not to be started
  [ "${GPU_STEP_DEADLINE:-0}" -gt 0 ] && [ "$(date +%s)" -ge "$GPU_STEP_DEADLINE" ] || return 1
  echo "FAIL: $1 not run (out of time: the step's deadline passed)"
}
echo "NCCL: ${T3D_NCCL_LIBRARY:-none found (tensor collectives staged through host memory)}" >&2
