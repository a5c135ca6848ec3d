#!/usr/bin/env bash
# No false alarm over a long run (issue 43): a very small model (recipes/tiny.toml cut to dim 32,
# 16 positions, 4 rows a step) trains STEPS steps with run.replay_every = 1 (every step replayed
# on a peer and checked; under ZeRO 1-3 the parameters also hashed at rest) on
#   dp2, dp2 × tp2, pp2 × dp2, dp2 with ZeRO-3, and a mixture of experts on dp2 × ep2 (each
#   replica replays itself) and dp4 × ep2 (each EP group replays the other),
# and each must exit 0, log every step with its replay_s, and report no corruption: each step's
# replay reproduced the step's gradients bit for bit, and the replicas' parameters agreed. Every
# loss also equals the same run's without replay, bit for bit. The time each replayed run took is
# printed.
#
#   replay_long.sh TITAN3D [STEPS]   (default 500, what ctest's train_replay_long runs: the
#                                     replayed runs 13-19 s together on 2 shared vCPUs, the
#                                     whole test about 35 s)
set -u
titan3d=$1 steps=${2:-500}
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
small=(--set data.path="$corpus" --set model.dim=32 --set model.n_heads=4 --set model.n_kv_heads=2
       --set model.seq_len=16 --set train.global_batch=4 --set train.micro_batches=1
       --set train.steps="$steps" --set train.warmup_steps=10 --set train.val_every=0
       --set train.log_every=100000 --set snapshot.every=0 --set run.log_level=warn
       --set hardware.threads_per_rank=1 --set hardware.gemm=openblas --set hardware.hbm_gib=0.25
       --set run.max_restarts=0)
moe=(--set model.n_layers=3 --set model.n_experts=4 --set model.experts_per_token=2
     --set model.moe_ffn_dim=16 --set model.n_shared_experts=1 --set model.dense_layers=1
     --set model.router_bias_rate=1e-3 --set model.router_aux_coef=1e-2)
total=0
# long NAME [--set ...]
long() {
  local name=$1 t0 secs; shift
  "$titan3d" train "$repo/recipes/tiny.toml" "${small[@]}" --set run.dir="$work/${name}_plain" \
    "$@" > "$work/${name}_plain.log" 2>&1 || echo "FAIL: ${name}_plain exited $?"
  t0=$(date +%s.%N)
  "$titan3d" train "$repo/recipes/tiny.toml" "${small[@]}" --set run.dir="$work/$name" "$@" \
    --set run.replay_every=1 > "$work/$name.log" 2>&1
  local rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  total=$(awk -v a="$total" -v b="$secs" 'BEGIN { printf "%.1f", a + b }')
  check "[ $rc -eq 0 ] && [ \$(field $work/$name/metrics.jsonl replay_s | awk '\$1 > 0' | wc -l) -eq $steps ]" \
    "$name: $steps steps, each replayed and checked (${secs} s)" || tail -5 "$work/$name.log"
  check "! grep -q corruption $work/$name.log $work/$name/logs/*.log && ! grep -qs corruption $work/$name/incidents.jsonl" \
    "$name: no false alarm"
  check "diff <(losses $work/${name}_plain/metrics.jsonl) <(losses $work/$name/metrics.jsonl) > /dev/null" \
    "$name: every loss equals the run's without replay"
}
long dp2 --set parallel.dp=2
long dp2_tp2 --set parallel.dp=2 --set parallel.tp=2
long pp2_dp2 --set parallel.pp=2 --set parallel.dp=2
long dp2_zero3 --set parallel.dp=2 --set parallel.zero=3 --set parallel.bucket_mb=0.01
long moe_dp2_ep2 "${moe[@]}" --set parallel.dp=2 --set parallel.ep=2
long moe_dp4_ep2 "${moe[@]}" --set parallel.dp=4 --set parallel.ep=2
echo "all layouts: $total s for $steps steps each"
exit $fail
