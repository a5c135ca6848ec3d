#!/usr/bin/env bash
# Elastic shrink of a mixture of experts (runtime/supervise/elastic.h), self-launched on this
# machine: run.hostfile names localhost and a host no launch agent reaches (Open MPI's rsh agent
# is a script that refuses it), so the first launch fails, the probe finds that host lost, and
# run.elastic shrinks dp2 ep2 onto localhost's one slot as dp1 ep1 (each rank all 4 experts):
#  1. hardware.hbm_gib between the two layouts' memory as `titan3d plan --explain 0` prices it:
#     the job stops without a relaunch, exit non-zero, saying ep would fall from 2 to 1, the
#     experts per rank, the GiB and hardware.hbm_gib, and restart.toml is there to continue with.
#  2. hardware.hbm_gib with room for dp1 ep1: the job shrinks, runs on localhost and finishes,
#     with the losses and gradient norms, bit for bit, of the same recipe started on dp1 ep1 with
#     2 micro-batches (the shrink kept train.global_batch and the rows of every micro-batch).
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
printf '#!/bin/sh\necho "no such test host: $1" >&2\nexit 255\n' > "$work/agent"
chmod +x "$work/agent"
printf 'localhost slots=1\nt3d-lost-host slots=1\n' > "$work/hosts"
# The GEMM, precision and threads pinned: the shrunk job's losses are compared bit for bit.
moe=("${tiny_moe[@]}" --set model.moe_ffn_dim=1024 --set data.path="$corpus" --set train.steps=3
     --set train.precision=fp32 --set hardware.gemm=openblas --set hardware.threads_per_rank=1)
ep2=(--set parallel.dp=2 --set parallel.ep=2)
# gib LAYOUT...: the per-rank GiB `plan` prices the recipe's own layout at.
gib() {
  "$titan3d" plan "$repo/recipes/tiny.toml" "${moe[@]}" "$@" --explain 0 |
    sed -n 's/^  total *\([0-9.e-]*\) GiB.*/\1/p'
}
before=$(gib "${ep2[@]}")
after=$(gib --set parallel.dp=1 --set parallel.ep=1 --set train.micro_batches=2)
check "awk -v b='$before' -v a='$after' 'BEGIN { exit !(b > 0 && a > b) }'" \
  "plan prices dp1 ep1 above dp2 ep2 ($after GiB against $before per rank)" || exit 1
between=$(awk -v b="$before" -v a="$after" 'BEGIN { printf "%g", (a + b) / 2 }')
elastic() {  # elastic RUN [--set ...]: the self-launched job, its output in $work/RUN.log
  local name=$1; shift
  timeout 120 env OMPI_MCA_plm_rsh_agent="$work/agent" "$titan3d" train "$repo/recipes/tiny.toml" \
    "${moe[@]}" "${ep2[@]}" --set run.hostfile="$work/hosts" --set run.elastic=true \
    --set run.max_restarts=1 --set run.dir="$work/$name" "$@" > "$work/$name.log" 2>&1
}

# 1. The folded experts do not fit.
elastic over --set hardware.hbm_gib="$between"
rc=$?
line=$(grep -m1 'run.elastic cannot shrink' "$work/over.log")
check "[ $rc -ne 0 ] && [ $rc -ne 124 ]" "over hardware.hbm_gib = $between: the job stops (rc $rc)" ||
  tail -20 "$work/over.log"
check "grep -q 'unreachable host t3d-lost-host (mpirun .*; run.elastic cannot shrink: ep would fall from 2 to 1, each rank holding 4 of the 4 routed experts of every MoE block (2 now): pp1 dp1 tp1 (1 rank, 2 micro-batches per replica) needs about [0-9.]* GiB per rank .* against hardware.hbm_gib = $between; .*Raise hardware.hbm_gib to at least .*then continue with .titan3d train $work/over/restart.toml.' <<<\"\$line\"" \
  "it says why: ${line#titan3d: }" || tail -5 "$work/over.log"
check "[ -s '$work/over/restart.toml' ] && ! grep -q 'elastic: unreachable' '$work/over.log' && grep -q '\"action\": \"stop: unreachable host t3d-lost-host' '$work/over/incidents.jsonl'" \
  "no relaunch; restart.toml written; incidents.jsonl records the stop"

# 2. Room for every expert on the remaining rank: the job shrinks and finishes there.
elastic fits --set hardware.hbm_gib=0.25
rc=$?
line=$(grep -m1 'elastic: unreachable' "$work/fits.log")
check "[ $rc -eq 0 ] && [ \"\$(last_step '$work/fits/metrics.jsonl')\" = 3 ]" \
  "with room: the shrunk job finished its 3 steps (rc $rc)" || tail -20 "$work/fits.log"
check "grep -q 'pp1 dp2 tp1 ep2 (2 ranks, 1 micro-batch per replica) -> pp1 dp1 tp1 (1 rank, 2 micro-batches per replica)' <<<\"\$line\"" \
  "the log says what changed: ${line#titan3d: }" || tail -5 "$work/fits.log"
timeout 120 "$titan3d" train "$repo/recipes/tiny.toml" "${moe[@]}" --set hardware.hbm_gib=0.25 \
  --set parallel.dp=1 --set parallel.ep=1 --set train.micro_batches=2 --set run.dir="$work/ep1" \
  > "$work/ep1.log" 2>&1 || { echo "FAIL: the dp1 ep1 reference exited $?"; tail "$work/ep1.log"; exit 1; }
check "diff <(field $work/fits/metrics.jsonl loss; field $work/fits/metrics.jsonl grad_norm) <(field $work/ep1/metrics.jsonl loss; field $work/ep1/metrics.jsonl grad_norm) > /dev/null && [ \$(losses $work/ep1/metrics.jsonl | wc -l) -eq 3 ]" \
  "the shrunk job's losses and gradient norms are bit for bit those of dp1 ep1 with 2 micro-batches"
exit $fail
