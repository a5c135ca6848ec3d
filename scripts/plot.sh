#!/usr/bin/env bash
# Draws a run directory's loss curves and (for traced runs) pipeline timeline to PNG and SVG.
# Usage: scripts/plot.sh RUN_DIR [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=/usr/bin/python3  # Debian's interpreter, which sees Debian's matplotlib
if ! $python -c "import matplotlib" 2>/dev/null; then
  bash "$here/setup.sh" python3-matplotlib
fi
exec $python "$here/plot.py" "$@"
