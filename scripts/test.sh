#!/usr/bin/env bash
# The README's test command: installs what is needed, builds, and runs the whole suite with ctest
# (MPI tests run under mpirun --oversubscribe inside ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
# python3 runs the recipe fuzzer and the tests' JSON checks; Debian's python3-torch and
# python3-h5py the PyTorch cross-check and the h5py read of a snapshot, python3-sentencepiece the
# check that Python encodes like titan3d's tokenizer, clang-format the formatting check, so no
# test is skipped for a missing package.
bash scripts/setup.sh python3 python3-torch python3-h5py python3-sentencepiece clang-format
bash scripts/build.sh
bash scripts/get_data.sh   # the e2e tests train on the real corpus
# Hugging Face tokenizers from PyPI, for the byte-level BPE cross-check (which skips without it).
bash scripts/hf_venv.sh || echo "test: no Hugging Face tokenizers environment; data_bpe_crosscheck will skip"
# Two tests at a time: each test's PROCESSORS says what may run beside it, in units of a budget
# of 5 (tests/CMakeLists.txt): single-process tests and deterministic trainings run beside each
# other and two of them beside the SLURM test's requeue wait; nothing beside a deadline-bound test.
ctest --test-dir build --output-on-failure --timeout 600 -j5 "$@"
