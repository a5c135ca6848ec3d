#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh runs on a GPU machine that has the CUDA toolkit but none of
# titan3d's other libraries (no OpenBLAS, oneDNN, MPI): the GPU test and benchmark binaries built
# here (the kernels' tests; the one-rank Model's training test, which loads MPI's libraries but
# never starts MPI), the shared libraries they load from this machine (not glibc, not CUDA's: the GPU machine's own
# CUDA 13 serves those), and the PyTorch benchmark, as gpu_bundle/bundle.tar.xz (git-ignored,
# ~28 MiB: under the 64 MiB a device call carries). Usage: scripts/gpu_bundle.sh [build dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
grep -q "^T3D_HAVE_CUDA:INTERNAL=ON" "$build/CMakeCache.txt" 2>/dev/null ||
  { echo "$build has no CUDA backend: configure it where a CUDA toolkit is (scripts/build.sh)"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target test_kernels_cuda test_model_gpu test_nccl_comm_mpi \
  bench_cuda titan3d |
  tail -n 1
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
cp "$build/tests/kernels/test_kernels_cuda" "$build/tests/model/test_model_gpu" \
  "$build/tests/stage/test_nccl_comm_mpi" "$build/bench/kernels/bench_cuda" "$stage/bin/"
cp bench/kernels/bench_cuda_torch.py "$stage/bin/"
# titan3d itself, with the Open MPI it starts its ranks through (mpirun, the plugins and help
# files, found under OPAL_PREFIX = ompi/ by gpu_train_check.sh) and a 1 MB slice of the corpus.
cp "$build/apps/titan3d" "$stage/bin/"
cp -L "$(command -v mpirun)" "$stage/bin/mpirun"
ompi_prefix=$(ompi_info --path prefix --parsable | cut -d: -f3)
ompi_pkglib=$(ompi_info --path pkglibdir --parsable | cut -d: -f3)
ompi_pkgdata=$(ompi_info --path pkgdatadir --parsable | cut -d: -f3)
for dir in "$ompi_pkglib" "$ompi_pkgdata"; do  # the same place under the new prefix
  mkdir -p "$stage/ompi/$(dirname "${dir#"$ompi_prefix"/}")"
  cp -rL "$dir" "$stage/ompi/${dir#"$ompi_prefix"/}"
done
# Its configuration (the MCA parameters: Debian's turn off the ucx PML, the openib, uct and ofi
# transports) lives outside the prefix (/etc/openmpi), so OPAL_PREFIX does not move it: without
# it a GPU machine's mpirun would try UCX and InfiniBand, which no run here has; gpu_env.sh points
# OPAL_SYSCONFDIR at this copy.
ompi_sysconf=$(ompi_info --path sysconfdir --parsable | cut -d: -f3)
mkdir -p "$stage/ompi/etc"
[ ! -d "$ompi_sysconf" ] || cp -L "$ompi_sysconf"/openmpi-* "$stage/ompi/etc/" 2>/dev/null || true
# An external PMIx (Debian's, in its own prefix) keeps plugins and help files there too; without
# them every mpirun prints that help-pcompress.txt is missing. gpu_env.sh points PMIX_PKGLIBDIR
# and PMIX_PKGDATADIR at this copy.
pmix_lib=$(find "$stage/ompi" -name 'mca_pmix_ext*.so' -exec ldd {} \; | awk '/libpmix/ {print $3; exit}')
if [ -n "$pmix_lib" ]; then
  pmix_prefix=$(dirname "$(dirname "$(readlink -f "$pmix_lib")")")
  mkdir -p "$stage/pmix/lib" "$stage/pmix/share"
  [ ! -d "$pmix_prefix/lib/pmix" ] || cp -rL "$pmix_prefix/lib/pmix" "$stage/pmix/lib/"
  [ ! -d "$pmix_prefix/share/pmix" ] || cp -rL "$pmix_prefix/share/pmix" "$stage/pmix/share/"
fi
mkdir -p "$stage/data"
[ -s data/fortunes.txt ] || bash scripts/get_data.sh > /dev/null
head -c 1000000 data/fortunes.txt > "$stage/data/corpus.txt"
cp scripts/gpu_train_check.sh scripts/gpu_layout_check.sh scripts/gpu_losses.py scripts/gpu_env.sh \
  scripts/gpu_nccl_check.sh "$stage/bin/"
for bin in "$stage"/bin/test_kernels_cuda "$stage"/bin/test_model_gpu "$stage"/bin/test_nccl_comm_mpi \
  "$stage"/bin/bench_cuda \
  "$stage"/bin/titan3d "$stage"/bin/mpirun $(find "$stage/ompi" "$stage/pmix" -name '*.so'); do
  ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libcuda*|libcublas*) ;;
    *) cp -L "$lib" "$stage/lib/" ;;
  esac
done
mkdir -p gpu_bundle
mkdir -p "$stage/pmix"
tar -C "$stage" -cJf gpu_bundle/bundle.tar.xz bin lib ompi pmix data
git rev-parse --short HEAD > gpu_bundle/commit 2>/dev/null || true
ls -la gpu_bundle/bundle.tar.xz
