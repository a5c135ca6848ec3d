#!/usr/bin/env bash
# The README's test command: installs what is needed, builds, and runs the whole suite with ctest
# (MPI tests run under mpirun --oversubscribe inside ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
bash scripts/get_data.sh   # the e2e tests train on the real corpus
ctest --test-dir build --output-on-failure --timeout 600 "$@"
