#!/usr/bin/env bash
# Every verb with the device memory guarded as a GPU's (T3D_GUARD_DEVICE_MEMORY=1,
# kernels/memory_guard.h: nothing outside the ops may touch it, or the rank ends naming the byte
# and its backtrace), on the CPU, against the same commands unguarded:
#   - train (2 ranks: data parallelism with ZeRO 1, snapshots on disk staged in 7 waves and in
#     memory, replay checks, validation) and resume of its step-2 snapshot: the same losses and
#     gradient norms, and the same tensors in the snapshots (h5diff): guarded, a staged copy is
#     made only when waited for (kernels::copy_to_host_started), its host bytes NaN until then, so
#     a wave written before its copies were waited for would differ;
#   - eval and generate of that snapshot: the same loss and the same text;
#   - export (the same safetensors bytes) and import of the export;
#   - selfcheck of the recipe.
# train_device_staging guards the layouts (pipeline, tensor, context, expert parallelism).
# Usage: device_memory_guard.sh TITAN3D
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
shape=(--set data.path="$corpus" --set model.dim=64 --set model.n_layers=4 --set model.n_heads=4
       --set model.n_kv_heads=2 --set model.seq_len=32 --set hardware.hbm_gib=0.25
       --set hardware.gemm=openblas --set hardware.threads_per_rank=1)
common=("${shape[@]}" --set train.global_batch=8 --set train.micro_batches=2 --set train.steps=4
        --set train.val_every=2 --set parallel.dp=2 --set parallel.zero=1
        --set snapshot.every=2 --set snapshot.staging_gib=0.0002 --set snapshot.memory_every=1
        --set run.replay_every=2)
fail=0
# both NAME ARG...: titan3d ARG... unguarded, then guarded, each ARG "@" replaced by $work/NAME.u
# or $work/NAME.g (a run directory or output), their output in $work/NAME.u.out and NAME.g.out.
both() {
  local name=$1 kind; shift
  for kind in u g; do
    local args=("${@//@/$work/$name.$kind}")
    if [ $kind = g ]; then export T3D_GUARD_DEVICE_MEMORY=1; fi
    "$titan3d" "${args[@]}" > "$work/$name.$kind.out" 2>&1; local rc=$?
    unset T3D_GUARD_DEVICE_MEMORY
    [ $rc -eq 0 ] && continue
    echo "FAIL: $name ($kind) exited $rc"; tail "$work/$name.$kind.out"; guard_trace "$work/$name.$kind.out"
    fail=1; return 1
  done
}
same() {  # same WHAT A B: prints ok or FAIL with the difference
  if diff "$2" "$3" > "$work/diff"; then echo "ok   $1"; else echo "FAIL: $1 (< unguarded, > guarded):"; head "$work/diff"; fail=1; fi
}
metrics() { field "$1" loss; field "$1" grad_norm; field "$1" val_loss; }

if both train train "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir=@; then
  grep -q "staged through host memory (T3D_GUARD_DEVICE_MEMORY=1)" "$work/train.g/logs/rank1.log" ||
    { echo "FAIL: the guarded run's log does not say it staged"; fail=1; }
  same "train: $(field "$work/train.u/metrics.jsonl" loss | wc -l) steps, every loss, gradient norm and validation loss" \
    <(metrics "$work/train.u/metrics.jsonl") <(metrics "$work/train.g/metrics.jsonl")
  for step in 2 4; do
    for group in /model /optim /state; do
      h5diff -q "$work/train.u/snapshots/step_0000000$step.h5" "$work/train.g/snapshots/step_0000000$step.h5" \
        $group $group > /dev/null 2>&1 || { echo "FAIL: the snapshots of step $step differ in $group"; fail=1; }
    done
  done
  [ $fail -eq 0 ] && echo "ok   the snapshots of steps 2 and 4: the same tensors (model, optimizer, state)"
  snap=$work/train.u/snapshots/step_00000002.h5
  both resume resume "$snap" --set run.dir=@ &&
    same "resume of step 2: steps 3 and 4 as trained" <(field "$work/train.u/metrics.jsonl" loss | tail -2) \
      <(field "$work/resume.g/metrics.jsonl" loss)
  both eval eval "$snap" --batches 2 &&
    same "eval: $(grep -o 'loss [0-9.]*' "$work/eval.g.out")" <(grep -o 'loss.*windows' "$work/eval.u.out") \
      <(grep -o 'loss.*windows' "$work/eval.g.out")
  both generate generate "$snap" --prompt "The" --max-tokens 12 --seed 7 &&
    same "generate: the same 12 tokens" <(grep -a -o '^The.*generate:' "$work/generate.u.out") \
      <(grep -a -o '^The.*generate:' "$work/generate.g.out")
  both export export "$snap" --out @ &&
    same "export: the same safetensors bytes" <(sha256sum < "$work/export.u/model.safetensors") \
      <(sha256sum < "$work/export.g/model.safetensors")
  both import import "$work/export.g" --out @ && echo "ok   import of the export"
fi
if T3D_GUARD_DEVICE_MEMORY=1 "$titan3d" selfcheck "$repo/recipes/tiny.toml" --quick "${shape[@]}" \
     --set parallel.dp=2 > "$work/selfcheck.out" 2>&1; then
  echo "ok   selfcheck"
else echo "FAIL: selfcheck"; tail "$work/selfcheck.out"; guard_trace "$work/selfcheck.out"; fail=1; fi
exit $fail
