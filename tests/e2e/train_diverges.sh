#!/usr/bin/env bash
# A run that diverges stops with exit 2, naming the step and the first block whose output went
# non-finite (agreed across pipeline stages), printed once; with train.dynamic_loss_scale the
# non-finite steps are skipped and said so instead.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
boom=(--set data.path="$corpus" --set train.lr=1e6 --set train.min_lr=0 --set train.grad_clip=0
      --set train.steps=20 --set train.val_every=0)
fail=0
for layout in "" "--set parallel.pp=2"; do
  out=$("$titan3d" train "$repo/recipes/tiny.toml" "${boom[@]}" $layout --set run.dir="$work/a" 2>&1); rc=$?
  msg=$(grep "^titan3d: " <<<"$out")
  if [ $rc -ne 2 ] || ! grep -qE "diverged at step [0-9]+: .*first non-finite output is model\.(layers\.[0-9]+|embed_tokens)" <<<"$msg" ||
     [ "$(grep -c "diverged" <<<"$out")" -ne 1 ]; then
    echo "FAIL ($layout): rc=$rc"; echo "$out" | tail -5; fail=1
  else
    echo "ok   ($layout): $msg"
  fi
done
out=$("$titan3d" train "$repo/recipes/tiny.toml" "${boom[@]}" --set train.dynamic_loss_scale=true \
      --set run.dir="$work/b" 2>&1); rc=$?
skipped=$(grep -c "skipped (train.dynamic_loss_scale)" <<<"$out")
if [ $rc -ne 0 ] || [ "$skipped" -lt 1 ]; then echo "FAIL dynamic_loss_scale: rc=$rc skipped=$skipped"; fail=1
else echo "ok   dynamic_loss_scale: $skipped steps skipped, exit 0"; fi
exit $fail
