#!/usr/bin/env bash
# Each dimension cuts what it promises, as each rank reports it (logs/rank<N>.log, "memory bytes"):
# tp = 2 halves the parameters per rank, pp = 2 halves them per stage, ZeRO-1 over dp = 2 halves
# the optimizer state, cp = 2 halves the activations, full activation checkpointing keeps a fraction of the activations. "Half" allows the pieces that are not split (norm weights, the uneven
# embedding/head split of the pipeline): between 0.45 and 0.60 of one rank's figure.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
common=(--set data.path="$corpus" --set model.dim=128 --set model.n_layers=4 --set model.n_heads=4
        --set model.seq_len=32 --set train.global_batch=4 --set train.steps=1 --set train.val_every=0)
run() {
  local name=$1; shift
  "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir="$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { echo "FAIL: $name exited $?"; tail -5 "$work/$name.log"; exit 1; }
}
# field RUN KIND: the largest value of KIND over the run's ranks.
field() {
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
fail=0
ratio() {  # ratio NAME VALUE BASE LO HI
  awk -v n="$1" -v v="$2" -v b="$3" -v lo="$4" -v hi="$5" 'BEGIN {
    r = v / b; printf "%-34s %10d / %10d = %.3f (expected %.2f..%.2f)\n", n, v, b, r, lo, hi;
    exit !(r >= lo && r <= hi) }' || fail=1
}
ratio "params per rank, tp=2" "$(field tp2 params)" "$(field one params)" 0.45 0.60
ratio "params per rank, pp=2 (largest stage)" "$(field pp2 params)" "$(field one params)" 0.45 0.60
ratio "optimizer per rank, ZeRO-1 dp=2" "$(field zero1 optimizer)" "$(field one optimizer)" 0.45 0.55
ratio "optimizer per rank, ZeRO-0 dp=2" "$(field zero0 optimizer)" "$(field one optimizer)" 0.99 1.01
# comm GROUP RUN: the largest bytes any rank of RUN sent on GROUP ("communication bytes" line).
comm() {
  cat "$work/$2"/logs/rank*.log | sed -n "s/.*communication bytes: .*\b$1 \([0-9]*\).*/\1/p" | sort -n | tail -1
}
# bf16 stores the large saved tensors in bf16 (the residual stream stays fp32) and halves the
# bytes of TP and PP traffic; sequence parallelism sends 1/tp of the rows between stages.
ratio "activations, bf16" "$(field bf16 activations)" "$(field one activations)" 0.45 0.65
ratio "tp bytes, bf16" "$(comm tp pp2tp2_bf16)" "$(comm tp pp2tp2)" 0.49 0.51
ratio "pp bytes, bf16" "$(comm pp pp2tp2_bf16)" "$(comm pp pp2tp2)" 0.49 0.51
ratio "pp bytes, sequence parallel" "$(comm pp pp2tp2_sp)" "$(comm pp pp2tp2)" 0.49 0.51
# Full checkpointing keeps only the residual stream per block (1 of its ~12 tensors of N×C-ish).
ratio "activations, checkpoint full" "$(field ckpt activations)" "$(field one activations)" 0.05 0.30
# Context parallelism: each rank keeps half of every sequence's positions; the whole sequence's
# keys and values live only in per-step scratch (gathered per block, not kept).
ratio "activations, cp=2" "$(field cp2 activations)" "$(field one activations)" 0.49 0.51
exit $fail
