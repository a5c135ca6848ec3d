#!/usr/bin/env bash
# The planner's per-rank memory against what training measures: for layouts that fit on 8 local
# ranks, `plan --explain 0` (its largest stage) must be within 10% of the largest arena peak any
# rank reports (peak_mem_gib in metrics.jsonl), and with snapshots its host snapshot staging the
# largest any rank logs. They share one memory model, so this catches the
# two drifting apart (a new buffer in the model that the planner does not know about). Dense
# layouts, then mixtures of experts.
set -u
titan3d=$1
source "$(dirname "$0")/../e2e/lib.sh"
require_corpus
make_work_dir
fail=0
check() {  # check NAME [--set ...]
  local name=$1; shift
  local args=(--set data.path="$corpus" --set train.steps=2 --set train.val_every=0 "$@")
  "$titan3d" train "$repo/recipes/3d_pp2_dp2_tp2.toml" "${args[@]}" --set run.dir="$work/$name" \
    > "$work/$name.log" 2>&1 || { echo "FAIL $name: training exited $?"; tail -5 "$work/$name.log"; fail=1; return; }
  local measured predicted
  measured=$(sed -n 's/.*"peak_mem_gib": \([0-9.e-]*\).*/\1/p' "$work/$name/metrics.jsonl" | tail -1)
  predicted=$("$titan3d" plan "$repo/recipes/3d_pp2_dp2_tp2.toml" "${args[@]}" --explain 0 2>&1 |
              sed -n 's/^  total *\([0-9.e-]*\) GiB.*/\1/p' | head -1)
  awk -v n="$name" -v m="$measured" -v p="$predicted" 'BEGIN {
    if (m == "" || p == "") { printf "FAIL %s: measured \"%s\", predicted \"%s\"\n", n, m, p; exit 1 }
    r = p / m; printf "%-28s predicted %.6f GiB, measured %.6f GiB: %.3f\n", n, p, m, r
    exit !(r > 0.9 && r < 1.1) }' || fail=1
  # With snapshots, the host staging too: the planner's per-rank figure against the largest any
  # rank logs ("memory bytes: ... host snapshot staging N"; ranks write unequal shares).
  measured=$(cat "$work/$name"/logs/rank*.log | sed -n 's/.*host snapshot staging \([0-9]*\);.*/\1/p' | sort -n | tail -1)
  [ "${measured:-0}" -gt 0 ] || return 0
  predicted=$("$titan3d" plan "$repo/recipes/3d_pp2_dp2_tp2.toml" "${args[@]}" --explain 0 2>&1 |
              sed -n 's/^  host: snapshot staging \([0-9.e-]*\) GiB.*/\1/p' | head -1)
  awk -v n="$name" -v m="$measured" -v p="$predicted" 'BEGIN {
    if (p == "") { printf "FAIL %s: no predicted snapshot staging\n", n; exit 1 }
    r = p * 2^30 / m; printf "%-28s snapshot staging predicted %.6f GiB, measured %.6f GiB: %.3f\n", n, p, m / 2^30, r
    exit !(r > 0.9 && r < 1.1) }' || fail=1
}
check pp2_dp2_tp2_1f1b
check pp2_dp2_tp2_gpipe_m4 --set parallel.schedule=gpipe --set train.micro_batches=4 \
      --set train.global_batch=16
check pp2_tp2_dp2_zb_h1 --set parallel.schedule=zb_h1
check interleaved_v2_m4 --set parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2 \
      --set train.micro_batches=4 --set train.global_batch=16
check ckpt_full --set train.activation_checkpoint=full
check zero1 --set parallel.zero=1 --set snapshot.every=2
# ZeRO-2: the gradient shard plus two staging buffers of the largest bucket, not full gradients.
check zero2 --set parallel.zero=2
check zero2_small_buckets --set parallel.zero=2 --set parallel.bucket_mb=0.05
# ZeRO-3: also the parameter shard plus two gather buffers of the largest bucket.
check zero3_small_buckets --set parallel.zero=3 --set parallel.bucket_mb=0.05 --set snapshot.every=2
# A mixture of experts (docs/moe.md): the experts' stacked matrices, the router, the routed rows
# and scores; a leading dense block on stage 0, the selection bias, sequence parallelism, ZeRO-1.
moe=(--set model.n_experts=4 --set model.experts_per_token=2 --set model.n_shared_experts=1
     --set model.moe_ffn_dim=64 --set model.dense_layers=1 --set model.router_bias_rate=1e-3
     --set model.router_aux_coef=1e-2)
check moe_pp2_dp2_tp2 "${moe[@]}"
check moe_sp_zero1_ckpt "${moe[@]}" --set parallel.sequence_parallel=true --set parallel.zero=1 \
      --set train.activation_checkpoint=full --set model.capacity_factor=1.25
check moe_zero3_m4 "${moe[@]}" --set parallel.zero=3 --set train.micro_batches=4 \
      --set train.global_batch=16
exit $fail
