#!/usr/bin/env bash
# Every C++ and CUDA file (.cpp, .h, .cu, .cuh) of the product, the tests and the benchmarks is
# formatted by .clang-format (clang-format --dry-run -Werror): a formatting error fails the suite,
# as CI runs it. Format a
# change with `clang-format -i FILE...` (or `git clang-format`).
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
tool=$(command -v clang-format || command -v clang-format-14 || true)
if [ -z "$tool" ]; then
  echo "SKIP: clang-format is not installed (scripts/test.sh installs it)"
  exit 77
fi
# Versions format some constructs differently: the tree is formatted by Debian 12's (14).
major=$("$tool" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [ "$major" != 14 ]; then
  echo "SKIP: clang-format $major here; the tree is formatted by clang-format 14 (Debian 12)"
  exit 77
fi
cd "$repo"
mapfile -t files < <(find apps runtime parallel checkpoint kernels tests bench \
                       \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -type f | sort)
[ "${#files[@]}" -gt 150 ] || { echo "FAIL: only ${#files[@]} C++ files found"; exit 1; }
if ! "$tool" --dry-run -Werror "${files[@]}"; then
  echo "FAIL: the files above are not formatted; run: $tool -i FILE..."
  exit 1
fi
echo "${#files[@]} files formatted by .clang-format ($("$tool" --version | head -1))"
