#!/usr/bin/env bash
# A run that diverges stops with exit 2, naming the step and a model part (agreed across pipeline
# stages), printed once. A finite loss above 100·ln(vocab_size) counts as diverged. With
# train.dynamic_loss_scale diverged steps are skipped and said so, and 8 in a row end the run
# (exit 2) instead of "training" to the end on skipped steps.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
boom=(--set data.path="$corpus" --set train.min_lr=0 --set train.grad_clip=0
      --set train.steps=20 --set train.val_every=0)
fail=0
# lr = 1e4: step 2's loss is ~2e7, finite (was taken for a healthy step); 1e6 likewise ~2e11.
for case in "1e6" "1e6 --set parallel.pp=2" "1e4" "1e4 --set parallel.pp=2" "1e4 --set parallel.tp=2"; do
  layout=${case#* }; [ "$layout" = "$case" ] && layout=""
  out=$("$titan3d" train "$repo/recipes/tiny.toml" "${boom[@]}" --set train.lr=${case%% *} $layout \
        --set run.dir="$work/a" 2>&1); rc=$?
  msg=$(grep "^titan3d: " <<<"$out")
  if [ $rc -ne 2 ] || ! grep -qE "diverged at step 2: loss [0-9.e+]+ \(above 554.5 = 100 · ln\(vocab_size\)\).*(is|are) in model\.(layers\.[0-9]+|embed_tokens|norm / lm_head)" <<<"$msg" ||
     grep -q "no stored activation" <<<"$msg" || [ "$(grep -c "diverged" <<<"$out")" -ne 1 ]; then
    echo "FAIL ($layout): rc=$rc"; echo "$out" | tail -5; fail=1
  else
    echo "ok   ($layout): $msg"
  fi
done
out=$("$titan3d" train "$repo/recipes/tiny.toml" "${boom[@]}" --set train.lr=1e6 --set train.dynamic_loss_scale=true \
      --set run.dir="$work/b" 2>&1); rc=$?
skipped=$(grep -c "skipped (train.dynamic_loss_scale, " <<<"$out")
if [ $rc -ne 2 ] || [ "$skipped" -ne 7 ] ||
   ! grep -q "^titan3d: giving up: 8 steps in a row diverged and were skipped" <<<"$out"; then
  echo "FAIL dynamic_loss_scale: rc=$rc skipped=$skipped"; echo "$out" | tail -3; fail=1
else echo "ok   dynamic_loss_scale: $skipped steps skipped, then gave up with exit 2"; fi
exit $fail
