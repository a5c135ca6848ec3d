#!/usr/bin/env bash
# run.on_corruption = exclude (docs/resilience.md, Replay) on two hosts made on this machine as in
# two_hosts.sh: network namespaces `hosta` and `hostb` (own host names through UTS namespaces)
# joined by a veth pair, Open MPI reaching host B through a launch agent, its TCP traffic on the
# veth. titan3d self-launched on host A over both hosts (run.hostfile, one slot each: dp2 with
# rank 1 on host B), run.replay_every = 2, a snapshot every 2 steps, and a gradient bit flip on
# rank 1 at step 4 (T3D_FAULT=flip:1:4:grad):
#   - the replay names rank 1 on host hostb at step 4; the launcher leaves host B out through the
#     elastic shrink (dp2 -> dp1 with twice the micro-batches on host A) and restarts from the
#     snapshot of step 2, the last verified one; the job finishes (exit 0);
#   - the log and incidents.jsonl name the step, rank, host and what differed (the corruption
#     line, action exclude; the launcher's incident, its shrink and its restart from step 2);
#   - the continued job runs on host A alone, and its losses of steps 3-8 equal, bit for bit, an
#     uninterrupted run resumed from the same snapshot on dp1 with 4 micro-batches.
# Skips (exit 77) when not root or when network namespaces cannot be made. Everything started in
# the namespaces is ended on exit.
set -u
titan3d=$(realpath "$1")
source "$(dirname "$0")/lib.sh"
need_root "network namespaces"
need_packages iproute2 util-linux openmpi-bin
require_corpus

make_two_hosts "x" 98 /tmp/t3d_exclude.XXXXXX
printf '10.98.0.1 slots=1\n10.98.0.2 slots=1\n' > "$work/hostfile"

# The GEMM, precision and threads pinned: losses are compared bit for bit.
run=(--set data.path="$corpus" --set train.steps=8 --set train.warmup_steps=2
     --set train.val_every=0 --set train.log_every=100000 --set train.micro_batches=2
     --set snapshot.every=2 --set snapshot.keep=10 --set run.replay_every=2 --set train.precision=fp32
     --set hardware.gemm=openblas --set hardware.threads_per_rank=1)
timeout 300 env T3D_FAULT=flip:1:4:grad OMPI_MCA_plm_rsh_agent="$work/agent" \
  OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=10.98.0.0/24 \
  OMPI_MCA_oob_tcp_if_include=10.98.0.0/24 \
  "$work/agent" hosta "$titan3d" train "$repo/recipes/tiny.toml" "${run[@]}" \
  --set parallel.dp=2 --set run.hostfile="$work/hostfile" --set run.on_corruption=exclude \
  --set run.max_restarts=1 --set run.dir="$work/excluded" > "$work/excluded.log" 2>&1
rc=$?
check "[ $rc -eq 0 ] && [ \"\$(last_step '$work/excluded/metrics.jsonl')\" = 8 ]" \
  "the job finished its 8 steps after leaving a host out (rc $rc)" || tail -20 "$work/excluded.log"
line=$(grep -m1 '^titan3d: silent data corruption' "$work/excluded.log")
check "grep -q 'at step 4 (gradients check): rank 1 \\[pp0 dp1 tp0\\] on host hostb: .*rank 1: dense bucket 0 .*hash [0-9a-f]*, its replay by rank 0: [0-9a-f]*\\. run.on_corruption = exclude: step 4 is not applied; the last check passed at step 2' <<<\"\$line\"" \
  "the replay names step 4, rank 1, host hostb and the bucket's hashes: ${line#titan3d: }" ||
  tail -20 "$work/excluded.log"
line=$(grep -m1 'elastic: host' "$work/excluded.log")
check "grep -q 'elastic: host 10.98.0.2 (silent data corruption at step 4, excluded); continuing on the 1 remaining host(s) (.*): pp1 dp2 tp1 (2 ranks, 2 micro-batches per replica) -> pp1 dp1 tp1 (1 rank, 4 micro-batches per replica)' <<<\"\$line\"" \
  "the launcher leaves host B out through the elastic shrink: ${line#titan3d: }" ||
  tail -20 "$work/excluded.log"
incidents=$work/excluded/incidents.jsonl
check "grep -q '\"event\": \"corruption\", \"step\": 4, .*\"settled\": true, \"rank\": 1, \"host\": \"hostb\", .*\"what\": \"rank 1: dense bucket 0.*\"action\": \"exclude\", \"exclude_host\": \"hostb\", \"exclude_rank\": 1, \"exit_code\": 6' '$incidents'" \
  "incidents.jsonl: the corruption (step, rank, host, what differed, action exclude)" || cat "$incidents"
check "grep -q '\"cause\": \"corruption found by replay at step 4 (rank 1: dense bucket 0 .*)\", \"rank\": 1, \"host\": \"hostb\", \"exit_code\": 6, .*\"snapshot_step\": 2, .*\"action\": \"shrink to pp1 dp1 tp1 (1 rank, 4 micro-batches per replica) without host 10.98.0.2 (silent data corruption at step 4, excluded); restart from snapshot step 2\"' '$incidents'" \
  "incidents.jsonl: the launcher's incident, its shrink and its restart from step 2" || cat "$incidents"
hosts=$(sed -n 's/.*rank *\([0-9]\) \[.*host \(host[ab]\).*/\1\2/p' "$work/excluded.log" | tail -1)
check "[ '$hosts' = '0hosta' ]" "the continued job runs on host A alone ($hosts)"
"$titan3d" resume "$work/excluded/snapshots/step_00000002.h5" "${run[@]}" --set parallel.dp=1 \
  --set train.micro_batches=4 --set run.hostfile= --set run.dir="$work/reference" \
  --set snapshot.dir="$work/reference/snapshots" > "$work/reference.log" 2>&1 ||
  { echo "FAIL: the reference resumed on dp1 exited $?"; tail "$work/reference.log"; exit 1; }
final_losses "$work/excluded/metrics.jsonl" | awk '$1 >= 3' > "$work/excluded.losses"
final_losses "$work/reference/metrics.jsonl" > "$work/reference.losses"
check "diff '$work/excluded.losses' '$work/reference.losses' > /dev/null && [ \$(grep -c . '$work/reference.losses') -eq 6 ]" \
  "steps 3-8 after the restart equal, bit for bit, the run resumed from the step-2 snapshot on dp1 with 4 micro-batches" ||
  paste "$work/excluded.losses" "$work/reference.losses"
exit $fail
