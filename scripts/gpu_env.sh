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
export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
