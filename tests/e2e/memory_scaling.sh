#!/usr/bin/env bash
# Each dimension cuts what it promises, as each rank reports it (logs/rank<N>.log, "memory bytes"):
# tp = 2 halves the parameters per rank, pp = 2 halves them per stage, ZeRO-1 over dp = 2 halves
# the optimizer state, ZeRO-2 the gradients too (plus its staging buffers), ZeRO-3 the parameters
# too (plus its gather buffers), cp = 2 halves the activations, full activation checkpointing keeps
# a fraction of the activations. "Half" allows the pieces that are not split (norm weights, the uneven
# embedding/head split of the pipeline): between 0.45 and 0.60 of one rank's figure.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
common=(--set data.path="$corpus" --set model.dim=128 --set model.n_layers=4 --set model.n_heads=4
        --set model.seq_len=32 --set train.global_batch=4 --set train.steps=1 --set train.val_every=0)
# largest_bytes RUN KIND: the largest value of KIND over the run's ranks.
largest_bytes() {
  cat "$work/$1"/logs/rank*.log | sed -n "s/.*memory bytes: .*\\b$2 \\([0-9]*\\).*/\\1/p" | sort -n | tail -1
}
run one
run tp2 --set parallel.tp=2
run pp2 --set parallel.pp=2
run zero1 --set parallel.dp=2 --set parallel.zero=1
run zero0 --set parallel.dp=2
run ckpt --set train.activation_checkpoint=full
run pp2tp2 --set parallel.pp=2 --set parallel.tp=2
run pp2tp2_bf16 --set parallel.pp=2 --set parallel.tp=2 --set train.precision=bf16
run pp2tp2_sp --set parallel.pp=2 --set parallel.tp=2 --set parallel.sequence_parallel=true
run bf16 --set train.precision=bf16
run cp2 --set parallel.cp=2
# ZeRO-2 keeps 1/dp of the gradients plus two staging buffers of the largest bucket (a bucket is at
# least one layer). 16 layers and 0.5 MB buckets: the largest bucket is the embedding merged with
# layer 0, ~7% of the gradients, so ZeRO-2's gradients are ~0.64 of ZeRO-1's (0.5 + 2 × 0.07).
deep=(--set model.n_layers=16 --set parallel.dp=2 --set parallel.bucket_mb=0.5)
run zero1_deep "${deep[@]}" --set parallel.zero=1
run zero2_deep "${deep[@]}" --set parallel.zero=2
run zero3_deep "${deep[@]}" --set parallel.zero=3
fail=0
ratio() {  # ratio NAME VALUE BASE LO HI
  awk -v n="$1" -v v="$2" -v b="$3" -v lo="$4" -v hi="$5" 'BEGIN {
    r = v / b; printf "%-34s %10d / %10d = %.3f (expected %.2f..%.2f)\n", n, v, b, r, lo, hi;
    exit !(r >= lo && r <= hi) }' || fail=1
}
ratio "params per rank, tp=2" "$(largest_bytes tp2 params)" "$(largest_bytes one params)" 0.45 0.60
ratio "params per rank, pp=2 (largest stage)" "$(largest_bytes pp2 params)" "$(largest_bytes one params)" 0.45 0.60
ratio "optimizer per rank, ZeRO-1 dp=2" "$(largest_bytes zero1 optimizer)" "$(largest_bytes one optimizer)" 0.45 0.55
ratio "optimizer per rank, ZeRO-0 dp=2" "$(largest_bytes zero0 optimizer)" "$(largest_bytes one optimizer)" 0.99 1.01
# ZeRO-2 line: "ZeRO-2 gradient bytes: shard S + 2 staging buffers × W (the largest bucket)".
z2() { cat "$work/zero2_deep"/logs/rank*.log | sed -n "s/.*ZeRO-2 gradient bytes: shard \([0-9]*\) + \([0-9]*\) staging buffers × \([0-9]*\).*/\1 \2 \3/p" | sort -n | tail -1; }
read -r shard nstaging staging <<<"$(z2)"
full=$(largest_bytes zero1_deep grads)
ratio "grads per rank, ZeRO-2 dp=2: shard only" "$shard" "$full" 0.49 0.51
ratio "grads per rank, ZeRO-2 dp=2: shard + staging" "$(largest_bytes zero2_deep grads)" "$full" 0.55 0.66
ratio "  of which staging (${nstaging:-?} × largest bucket)" "$((${nstaging:-0} * ${staging:-0}))" "$full" 0.08 0.16
# Nothing else changes: the arena peak drops by exactly the gradient bytes saved.
ratio "peak saving, ZeRO-2 vs ZeRO-1 (bytes / grads saved)" \
  "$(( $(largest_bytes zero1_deep peak) - $(largest_bytes zero2_deep peak) ))" "$(( full - $(largest_bytes zero2_deep grads) ))" 1.0 1.0
[ "$(largest_bytes zero2_deep grads)" = "$((shard + nstaging * staging))" ] ||
  { echo "FAIL: ZeRO-2 grads $(largest_bytes zero2_deep grads) != shard $shard + $nstaging × $staging"; fail=1; }
# ZeRO-3 shards the parameters the same way: a shard of half plus two gather buffers of the
# largest bucket; gradients as ZeRO-2; the peak drops by exactly the parameter bytes saved.
read -r pshard ngather gather <<<"$(cat "$work/zero3_deep"/logs/rank*.log | sed -n "s/.*ZeRO-3 parameter bytes: shard \([0-9]*\) + \([0-9]*\) gather buffers × \([0-9]*\).*/\1 \2 \3/p" | sort -n | tail -1)"
pfull=$(largest_bytes zero1_deep params)
ratio "params per rank, ZeRO-3 dp=2: shard only" "$pshard" "$pfull" 0.49 0.51
ratio "params per rank, ZeRO-3 dp=2: shard + gather" "$(largest_bytes zero3_deep params)" "$pfull" 0.55 0.66
ratio "grads per rank, ZeRO-3 vs ZeRO-2" "$(largest_bytes zero3_deep grads)" "$(largest_bytes zero2_deep grads)" 1.0 1.0
ratio "peak saving, ZeRO-3 vs ZeRO-2 (bytes / params saved)" \
  "$(( $(largest_bytes zero2_deep peak) - $(largest_bytes zero3_deep peak) ))" "$(( pfull - $(largest_bytes zero3_deep params) ))" 1.0 1.0
[ "$(largest_bytes zero3_deep params)" = "$((pshard + ngather * gather))" ] ||
  { echo "FAIL: ZeRO-3 params $(largest_bytes zero3_deep params) != shard $pshard + $ngather × $gather"; fail=1; }
# comm GROUP RUN: the largest bytes any rank of RUN sent on GROUP ("communication bytes" line).
comm() {
  cat "$work/$2"/logs/rank*.log | sed -n "s/.*communication bytes: .*\b$1 \([0-9]*\).*/\1/p" | sort -n | tail -1
}
# bf16 stores the large saved tensors in bf16 (the residual stream stays fp32) and halves the
# bytes of TP and PP traffic; sequence parallelism sends 1/tp of the rows between stages.
ratio "activations, bf16" "$(largest_bytes bf16 activations)" "$(largest_bytes one activations)" 0.45 0.65
ratio "tp bytes, bf16" "$(comm tp pp2tp2_bf16)" "$(comm tp pp2tp2)" 0.49 0.51
ratio "pp bytes, bf16" "$(comm pp pp2tp2_bf16)" "$(comm pp pp2tp2)" 0.49 0.51
ratio "pp bytes, sequence parallel" "$(comm pp pp2tp2_sp)" "$(comm pp pp2tp2)" 0.49 0.51
# Full checkpointing keeps only the residual stream per block (1 of its ~12 tensors of N×C-ish).
ratio "activations, checkpoint full" "$(largest_bytes ckpt activations)" "$(largest_bytes one activations)" 0.05 0.30
# Context parallelism: each rank keeps half of every sequence's positions; the whole sequence's
# keys and values live only in per-step scratch (gathered per block, not kept).
ratio "activations, cp=2" "$(largest_bytes cp2 activations)" "$(largest_bytes one activations)" 0.49 0.51
exit $fail
