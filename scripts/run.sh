#!/usr/bin/env bash
# The README's main command: installs what is needed, builds, fetches the default corpus and
# trains the default recipe on several ranks. Extra arguments go to `titan3d train`
# (e.g. --set train.steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
bash scripts/get_data.sh
exec build/apps/titan3d train recipes/default.toml "$@"
