#!/usr/bin/env bash
# scripts/plot.sh draws a traced pp2 run: loss curves and the pipeline timeline, as PNG and SVG;
# and a mixture of experts' expert load per layer over steps (with a capacity that drops slots).
# Needs Debian's python3-matplotlib (plot.sh installs it when it can); skips loudly otherwise.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
if ! /usr/bin/python3 -c "import matplotlib" 2>/dev/null && ! bash "$repo/scripts/setup.sh" python3-matplotlib >/dev/null 2>&1; then
  echo "SKIPPED: python3-matplotlib is not installed and cannot be installed here"; exit 77
fi
make_work_dir
"$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=4 \
  --set parallel.pp=2 --set train.micro_batches=4 --set train.val_every=2 --trace \
  --set run.dir="$work/run" > "$work/train.log" 2>&1 || { tail "$work/train.log"; exit 1; }
bash "$repo/scripts/plot.sh" "$work/run" "$work/plots" || exit 1
fail=0
for f in loss timeline; do
  head -c 8 "$work/plots/$f.png" | od -An -tx1 | grep -q "89 50 4e 47" || { echo "FAIL: $f.png is not a PNG"; fail=1; }
  grep -q "<svg" "$work/plots/$f.svg" || { echo "FAIL: $f.svg is not an SVG"; fail=1; }
done
[ -e "$work/plots/experts.png" ] && { echo "FAIL: a dense run drew experts.png"; fail=1; }
"$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=4 \
  --set model.n_layers=2 --set model.n_experts=4 --set model.experts_per_token=2 \
  --set model.capacity_factor=0.5 --set run.dir="$work/moe" > "$work/moe.log" 2>&1 ||
  { tail "$work/moe.log"; exit 1; }
bash "$repo/scripts/plot.sh" "$work/moe" "$work/moe_plots" || exit 1
head -c 8 "$work/moe_plots/experts.png" | od -An -tx1 | grep -q "89 50 4e 47" || { echo "FAIL: experts.png is not a PNG"; fail=1; }
for layer in 0 1; do  # one line per MoE layer, and the dropped slots' panel
  grep -q "layer $layer" "$work/moe_plots/experts.svg" || { echo "FAIL: experts.svg has no line for layer $layer"; fail=1; }
done
grep -q "dropped slots" "$work/moe_plots/experts.svg" || { echo "FAIL: experts.svg has no dropped-slots panel"; fail=1; }
[ $fail -eq 0 ] && echo "ok   loss, timeline and expert load drawn: $(ls "$work/plots" "$work/moe_plots" | tr '\n' ' ')"
exit $fail
