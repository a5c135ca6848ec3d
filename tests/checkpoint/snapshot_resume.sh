#!/usr/bin/env bash
# Snapshot + resume end to end: N steps straight vs resuming a snapshot taken on the way give
# bit-identical per-step losses and final state, on 1 rank and on pp2×dp2×tp2. The snapshot
# resumed is incremental: full at step 2, incremental at 4 and 6 (full_every = 3), resumed at 6
# through the chain 6 -> 4 -> 2. Resharded resumes (pp2×dp2×tp2 -> 1 rank, 1 rank -> tp2×pp2)
# match within fp32 tolerance; h5py reads the global tensors.
set -u
source "$(dirname "$0")/common.sh"
steps=8 half=6
# incremental_min_unchanged = 0: incremental on schedule, though dense training changes every chunk.
snap=(--set train.steps=$steps --set snapshot.every=2 --set snapshot.full_every=3 --set snapshot.deflate=1
      --set snapshot.incremental_min_unchanged=0)

run_pair() {  # name, extra args for both runs
  local name=$1; shift
  "$titan3d" train "$recipe" "${common[@]}" "${snap[@]}" "$@" --set run.dir="$work/$name" >"$work/$name.log" 2>&1
  check "[ \$? -eq 0 ]" "$name: straight run" || cat "$work/$name.log"
  "$titan3d" resume "$work/$name/snapshots/step_0000000$half.h5" "${common[@]}" \
    --set run.dir="$work/$name.r" --set snapshot.dir="$work/$name.r/snapshots" >"$work/$name.r.log" 2>&1
  check "[ \$? -eq 0 ]" "$name: resume" || cat "$work/$name.r.log"
  check "[ -n \"\$(losses $work/$name.r/metrics.jsonl)\" ] && diff <(losses_from $work/$name/metrics.jsonl $((half + 1))) <(losses $work/$name.r/metrics.jsonl)" \
    "$name: resumed losses bit-identical to the straight run"
  check "h5diff $work/$name/snapshots/step_0000000$steps.h5 $work/$name.r/snapshots/step_0000000$steps.h5 /model /model >/dev/null && h5diff $work/$name/snapshots/step_0000000$steps.h5 $work/$name.r/snapshots/step_0000000$steps.h5 /optim /optim >/dev/null" \
    "$name: final parameters and optimizer state bit-identical"
  check "[ \"\$(grep -o '\"snapshot_incremental\": [01]' $work/$name/metrics.jsonl | tr -dc 01)\" = 0110 ]" \
    "$name: snapshots 2, 4, 6, 8 are full, incremental, incremental, full"
}

# reshard FROM NAME WHAT [--set ...]: resume FROM's step-6 snapshot in another layout as NAME; it
# must say it resharded and continue FROM's losses.
reshard() {
  local from=$1 name=$2 what=$3
  shift 3
  "$titan3d" resume "$work/$from/snapshots/step_0000000$half.h5" "${common[@]}" "$@" \
    --set run.dir="$work/$name" --set snapshot.dir="$work/$name/snapshots" --set run.log_level=info \
    >"$work/$name.log" 2>&1
  check "grep -q 'resharded' $work/$name.log && close_losses $work/$from/metrics.jsonl $work/$name/metrics.jsonl 1e-5 $((half + 1))" \
    "$what continues with the same losses (rel 1e-5)" || cat "$work/$name.log"
}

one=(--set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1)
# Staged whole (the other layouts stage in waves, within the default cap).
run_pair one "${one[@]}" --set snapshot.staging_gib=1
run_pair mesh
check "grep -q 'latest' <(ls $work/mesh/snapshots) && [ \$(ls $work/mesh/snapshots/step_00000006 | wc -l) -eq 8 ]" \
  "pp2×dp2×tp2 snapshot: 8 shard files and a latest pointer"

# A staging cap far below the state (about 300 KiB: several waves, boxes cut at chunk boundaries)
# writes the very snapshots of a run staged whole: every dataset and attribute equal (h5diff).
"$titan3d" train "$recipe" "${common[@]}" "${snap[@]}" "${one[@]}" --set snapshot.staging_gib=0.0003 \
  --set run.dir="$work/waves" --set run.log_level=info >"$work/waves.log" 2>&1
check "grep -q 'staged in [0-9]* waves' $work/waves.log" "a small snapshot.staging_gib stages in waves" ||
  tail -5 "$work/waves.log"
for s in 2 4 6 8; do
  check "h5diff $work/one/snapshots/step_0000000$s/rank00000.h5 $work/waves/snapshots/step_0000000$s/rank00000.h5" \
    "step $s: the shard staged in waves equals the one staged whole"
done

# Refused at start with the numbers: a cap below one chunk, and a host without the memory.
out=$("$titan3d" train "$recipe" "${common[@]}" "${snap[@]}" "${one[@]}" --set snapshot.staging_gib=0.00001 \
      --set run.dir="$work/tiny_cap" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshot.staging_gib.* cannot hold one snapshot chunk of this rank' <<<\"\$out\"" \
  "a staging cap below one chunk is refused (rc $rc)" || echo "$out"
out=$(T3D_TEST_MEM_AVAILABLE=100000 "$titan3d" train "$recipe" "${common[@]}" "${snap[@]}" "${one[@]}" \
      --set run.dir="$work/no_memory" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshot staging does not fit on host .* need .* is left beside their training' <<<\"\$out\" && ! grep -qs '\"loss\"' $work/no_memory/metrics.jsonl" \
  "a host without the memory for its ranks' staging is refused at start (rc $rc)" || echo "$out"

# Frozen parameters (lr 1e-30 moves no fp32 parameter): their boxes do not change between snapshots, so the incremental
# shards hold them as `changed/` datasets storing no chunk; resume and resharding rebuild them from
# the base through the chain.
run_pair frozen "${one[@]}" --set train.lr=1e-30 --set train.min_lr=1e-30
check "h5ls -r $work/frozen/snapshots/step_00000006/rank00000.h5 | grep -q '^/changed/model/' && ! h5ls -r $work/frozen/snapshots/step_00000006/rank00000.h5 | grep -q '^/model/'" \
  "frozen: the incremental shard holds every parameter box as a partial changed/ dataset"
reshard frozen frozen_tp2 "frozen 1 rank -> tp2" --set parallel.tp=2

# Resharding: fp32 reductions run in another order, so equal within a tolerance.
reshard mesh to1 "pp2×dp2×tp2 -> 1 rank" "${one[@]}"
reshard one topp "1 rank -> tp2×pp2" --set parallel.pp=2 --set parallel.tp=2

# ZeRO-1: each dp rank writes its own share of the moments as boxes of the global tensors; a
# resume re-slices them for any dp and ZeRO stage (dp2 ZeRO-1 -> 1 rank, 1 rank -> dp2 ZeRO-2).
zero=(--set parallel.pp=1 --set parallel.tp=1 --set parallel.dp=2)
run_pair zero1 "${zero[@]}" --set parallel.zero=1
reshard zero1 zto1 "dp2 ZeRO-1 -> 1 rank" "${one[@]}" --set parallel.zero=0
reshard one toz2 "1 rank -> dp2 ZeRO-2" "${zero[@]}" --set parallel.zero=2

# ZeRO-2 over dp2 × pp2 (no full gradient region; moments sharded as with ZeRO-1). Small buckets
# put partition boundaries inside rows, so a rank writes two or three boxes of one tensor (the
# second as `<name>~1`): resume is bit-identical, and resharding to 1 rank continues the losses.
run_pair zero2 --set parallel.pp=2 --set parallel.tp=1 --set parallel.dp=2 --set parallel.zero=2 \
  --set parallel.bucket_mb=0.05
check "for f in $work/zero2/snapshots/step_00000008/rank*.h5; do h5ls -r \$f; done | grep -q '~1 '" \
  "a ZeRO-2 shard holds a second box of one tensor"
reshard zero2 z2to1 "pp2×dp2 ZeRO-2 -> 1 rank" "${one[@]}" --set parallel.zero=0

# ZeRO-3: the parameters are sharded like the moments, written and read as boxes of the global
# tensors: resume is bit-identical, and resharding goes both ways (-> 1 rank, 1 rank -> ZeRO-3).
run_pair zero3 --set parallel.pp=2 --set parallel.tp=1 --set parallel.dp=2 --set parallel.zero=3 \
  --set parallel.bucket_mb=0.05
reshard zero3 z3to1 "pp2×dp2 ZeRO-3 -> 1 rank" "${one[@]}" --set parallel.zero=0
reshard one toz3 "1 rank -> dp2 ZeRO-3" "${zero[@]}" --set parallel.zero=3 --set parallel.bucket_mb=0.05

# Context parallel: cp ranks hold identical copies and cp rank 0 writes them; the snapshot resumes
# bit for bit in its own layout and reshards to one rank.
cp=(--set parallel.pp=1 --set parallel.tp=1 --set parallel.dp=2 --set parallel.cp=2 --set parallel.zero=1)
run_pair cp2_dp2_zero1 "${cp[@]}"
reshard cp2_dp2_zero1 cpto1 "cp2×dp2 ZeRO-1 -> 1 rank" "${one[@]}" --set parallel.cp=1 --set parallel.zero=0

# snapshot.resume = latest picks the newest complete snapshot and, here, has nothing left to do.
out=$("$titan3d" train "$recipe" "${common[@]}" "${one[@]}" "${snap[@]}" --set train.steps=10 \
      --set run.dir="$work/one" --set snapshot.resume=latest --set run.log_level=info 2>&1)
check "grep -q 'resumed from .*step_00000008.h5 after step 8, written on cpu' <<<\"\$out\" && [ \$(losses $work/one/metrics.jsonl | wc -l) -eq 10 ]" \
  "snapshot.resume = latest continues from the newest snapshot (steps 9-10), naming the device it was written on"
check "h5dump -a /device $work/mesh/snapshots/step_00000008.h5 | grep -q '\"cpu\"'" \
  "the index records the device it was written on (/@device)"

# The index is readable by the standard tools: h5ls lists global tensors, h5py reads them.
check "h5ls -r $work/mesh/snapshots/step_00000008.h5 | grep -q 'model/model.embed_tokens.weight Dataset {256, 128}'" \
  "h5ls shows global tensors"
py=/usr/bin/python3
if "$py" -c 'import h5py' 2>/dev/null; then
  check "(cd / && $py -c \"import h5py, numpy as np; f = h5py.File('$work/mesh/snapshots/step_00000008.h5'); g = h5py.File('$work/one/snapshots/step_00000008.h5'); w = f['model/model.layers.1.self_attn.q_proj.weight'][:]; assert w.shape == (128, 128) and np.isfinite(w).all() and (w != 0).all(); assert f.attrs['complete'] == 1 and f['state'].attrs['step'] == 8; assert np.allclose(w, g['model/model.layers.1.self_attn.q_proj.weight'][:], atol=1e-5)\")" \
    "h5py reads the global tensors of an 8-rank snapshot (from another directory)"
else
  echo "SKIPPED (loudly): h5py is not installed for $py; apt-get install python3-h5py to run the h5py check"
fi
exit $fail
