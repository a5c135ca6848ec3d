#!/usr/bin/env bash
# Expert parallelism (docs/parallelism.md): one mixture-of-experts recipe on dp = 4 ranks at
# ep = 1, 2 and 4, interleaved in every round. Prints per ep:
#   - tokens/s (median over steps 3.., then over RUNS rounds) and ep_comm_share (the same medians);
#   - per-rank arena memory, from the "memory bytes: params … grads … optimizer …" line every rank
#     logs (the largest rank's): the routed experts' part of params is ep = 1's over ep;
#   - all-to-all bytes per step, measured (the "communication bytes: … ep N" line every rank logs at
#     the end, over the steps, mean over ranks) against the formula below.
# The ranks share the machine's cores (oversubscribed, 1 thread each): tokens/s shows what EP costs
# on one host, not what it buys on many.
#
# The formula (runtime/model/model_moe.cpp; Comm counts the bytes a rank sends to other ranks).
# Per MoE block and micro-batch, a rank with S = N·K kept slots (dropless), of which `out` go to
# experts on other EP ranks and `in` come from other ranks, on an EP group of P ranks, E/P experts
# each, rows of C floats:
#   forward:  counts 4·(E/P)·(P−1) (all_to_all), rows out·4C (dispatch), in·4C (combine)
#   backward: gates out·4, rows out·4C (dy), in·4C (dx), in·4 (gate gradients)
#   sum:      4·(E/P)·(P−1) + (8C + 4)·(out + in)
# Over the ranks of a group Σ out = Σ in; when every rank's tokens choose the experts alike, a rank
# keeps on average 1/P of its slots, so out = in = S·(P−1)/P on average and per rank
#   bytes per step = L_moe · M · [4·(E/P)·(P−1) + (16C + 8)·S·(P−1)/P]
# (L_moe MoE blocks, M micro-batches per step; fp32 rows: the wire carries floats whatever
# train.precision says). Activation checkpointing would add the forward's share again.
# Usage: bench/e2e/bench_expert_parallel.sh [extra --set ...]
#   (RUNS, STEPS, DIM, LAYERS, EXPERTS, TOPK, MOE_FFN, SEQ, BATCH)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-8} dim=${DIM:-256} layers=${LAYERS:-4} experts=${EXPERTS:-8}
topk=${TOPK:-2} moe_ffn=${MOE_FFN:-256} seq=${SEQ:-128} batch=${BATCH:-8}
ranks=4
[ -s data/fortunes_train.bin ] || bash scripts/get_data.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
field() { tail -n +3 "$1" | sed -n "s/.*\"$2\": \\([0-9.e+-]*\\).*/\\1/p" | median; }  # steps 3..
# mem RUN N: the largest params (N = 1), grads (2) or optimizer (3) bytes any rank of RUN logged.
mem() {
  cat "$work/$1"/logs/rank*.log |
    sed -n "s/.*memory bytes: params \([0-9]*\) grads \([0-9]*\) optimizer \([0-9]*\) .*/\\$2/p" |
    sort -n | tail -1
}
# train NAME EP: prints "tokens/s ep_share params grads optimizer ep_bytes_per_step"
train() {
  local name=$1 ep=$2
  build/apps/titan3d train recipes/tiny.toml --set model.dim="$dim" --set model.n_layers="$layers" \
    --set model.n_heads=8 --set model.n_kv_heads=8 --set model.seq_len="$seq" \
    --set model.n_experts="$experts" --set model.experts_per_token="$topk" \
    --set model.moe_ffn_dim="$moe_ffn" --set train.global_batch="$batch" \
    --set train.micro_batches=1 --set train.steps="$steps" --set train.precision=fp32 \
    --set train.val_every=0 --set data.path=data/fortunes_train.bin --set data.val_fraction=0 \
    --set hardware.hbm_gib=1 --set hardware.threads_per_rank=1 --set parallel.dp=$ranks \
    --set parallel.ep="$ep" --set snapshot.every=0 --set run.dir="$work/$name" "${@:3}" \
    > "$work/$name.log" 2>&1 || { tail "$work/$name.log" >&2; exit 1; }
  local m=$work/$name/metrics.jsonl bytes
  bytes=$(cat "$work/$name"/logs/rank*.log | sed -n 's/.*communication bytes: .* ep \([0-9]*\).*/\1/p' |
    awk -v s="$steps" '{ t += $1; n++ } END { printf "%.0f", t / n / s }')
  echo "$(field "$m" tokens_per_s) $(field "$m" ep_comm_share) $(mem "$name" 1) $(mem "$name" 2)" \
       "$(mem "$name" 3) $bytes"
}
declare -A tok share params grads optim bytes
for i in $(seq "$runs"); do
  for ep in 1 2 4; do
    read -r t s p g o b < <(train "ep$ep.$i" "$ep" "$@")
    tok[$ep]+="$t " share[$ep]+="$s " bytes[$ep]+="$b " params[$ep]=$p grads[$ep]=$g optim[$ep]=$o
    echo "round $i ep$ep: $t tok/s, ep_comm_share $s, params $p grads $g optimizer $o bytes, all-to-all $b bytes/step"
  done
done
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p') (family $(lscpu | sed -n 's/^CPU family: *//p'), model $(lscpu | sed -n 's/^Model: *//p')), $(nproc) cores; $ranks ranks × 1 thread; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: dim $dim, $layers MoE layers, $experts experts top-$topk, moe_ffn_dim $moe_ffn, seq $seq, global batch $batch (dp $ranks), fp32"
# The routed experts' fp32 weights of every block: 3 matrices of moe_ffn_dim × dim per expert.
experts_bytes=$(( 12 * moe_ffn * dim * experts * layers ))
dense=$(( params[1] - experts_bytes ))  # the rest of params, the same at every ep
rows_per_rank=$(( batch / ranks * seq ))  # N: tokens per rank and micro-batch
printf '%-3s %9s %9s %12s %12s %12s %12s %12s %12s\n' ep "tok/s" "ep share" "params B" \
  "experts B" "E-formula B" "optimizer B" "a2a B/step" "formula B"
for ep in 1 2 4; do
  formula=$(awk -v L="$layers" -v E="$experts" -v P="$ep" -v C="$dim" -v S=$((rows_per_rank * topk)) \
    'BEGIN { printf "%.0f", L * (4 * (E / P) * (P - 1) + (16 * C + 8) * S * (P - 1) / P) }')
  printf '%-3s %9.0f %9.3f %12s %12s %12s %12s %12.0f %12s\n' "$ep" \
    "$(tr ' ' '\n' <<<"${tok[$ep]}" | grep . | median)" \
    "$(tr ' ' '\n' <<<"${share[$ep]}" | grep . | median)" "${params[$ep]}" \
    "$(( ${params[$ep]} - dense ))" "$(( experts_bytes / ep ))" "${optim[$ep]}" \
    "$(tr ' ' '\n' <<<"${bytes[$ep]}" | grep . | median)" "$formula"
done
