#!/usr/bin/env bash
# Installs the Debian packages titan3d builds and runs with. Idempotent: does nothing when every
# package is already there, so it is cheap to call from every other script.
set -euo pipefail
packages=(build-essential cmake pkg-config git
          openmpi-bin libopenmpi-dev
          libcli11-dev libtoml11-dev libspdlog-dev
          libhdf5-dev hdf5-tools
          libopenblas-dev libgtest-dev libdnnl-dev
          libsentencepiece-dev nlohmann-json3-dev
          libpcre2-dev libutf8proc-dev libxxhash-dev)
packages+=("$@")  # callers may ask for more (e.g. fortunes for the default corpus)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
