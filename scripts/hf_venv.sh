#!/usr/bin/env bash
# A Python virtual environment with Hugging Face `tokenizers` (from PyPI) in build/hf-venv, for the
# test that encodes corpora with it and with titan3d's byte-level BPE (tests/data/bpe_crosscheck.sh).
# Idempotent: does nothing when the environment already imports the pinned version. Where PyPI
# cannot be reached it fails, and that test skips saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.23.3  # the version that wrote tests/data/fixtures/bpe
venv=build/hf-venv
if "$venv/bin/python" -c "import tokenizers, sys; sys.exit(tokenizers.__version__ != '$version')" 2>/dev/null; then
  exit 0
fi
bash scripts/setup.sh python3-venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "tokenizers==$version"
