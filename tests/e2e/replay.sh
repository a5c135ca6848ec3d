#!/usr/bin/env bash
# Silent data corruption caught by replay (run.replay_every, runtime/train/replay.h), self-launched
# tiny runs of 6 steps with a T3D_FAULT=flip bit flip (parallel/fault.h):
#
#   replay.sh TITAN3D dp      dp2 and dp1, and the refused settings:
#     - a clean dp2 run with replay_every = 1 reports nothing, logs replay_s, and its losses are
#       bit-identical to the same run's without replay;
#     - without replay a gradient flip goes unseen (exit 0, the losses change after it);
#     - with replay_every = 2, a flip at step 4 of a rank's gradient or of a stored activation is
#       caught at step 4, naming that rank (settled: a transient fault); a parameter flip at step
#       3 is caught at step 4 with both dp2 ranks named as candidates, not settled (no third
#       replica), and with dp4 settled on the flipped rank by the parameter hashes. Each: exit 6,
#       one account on the console, one `corruption` line in incidents.jsonl naming the rank and
#       its host, the snapshot of the last step checked (2) kept, none of step 4 (and with a
#       snapshot every step, step 3's set aside as unverified), no restart;
#       resumed from that snapshot without the fault, the gradient flip's run gives the clean
#       run's steps 3-6;
#     - dp1 replays itself: clean with replay_every = 1, and a gradient flip is named;
#     - a mixture of experts (dp2, ep = 1) clean with replay_every = 1 as well;
#     - run.on_corruption = exclude on one host: the account names the host, the launcher stops
#       (exit 6) saying that exclude needs several hosts;
#     - a negative replay_every, an expert-parallel group that no other whole group can replay:
#       exit 2 naming the key.
#   replay.sh TITAN3D tp_pp   dp2 × tp2 and pp2 × dp2: the clean runs' losses equal the runs'
#     without replay; gradient and activation flips name the flipped rank (an activation flip on
#     the last stage first among the stages it reached); a parameter flip names it among the
#     candidates.
#   replay.sh TITAN3D zero_cp  dp2 with ZeRO 1, 2, 3 (small buckets) and cp2 × dp2: clean runs
#     unchanged; gradient and activation flips named; parameter flips under ZeRO 1, 2 and 3 (a
#     ZeRO-3 shard's, which every replica gathers alike) named, settled, by the hashes of the
#     parameters at rest, at the replayed step and at the check after it; an owner's wrong
#     optimizer update under ZeRO 1, 2 and 3 (a bit of its AdamW's output flipped before the
#     all-gather) named by a peer's recomputation of the update (dp2: owner and checker as
#     candidates; dp4: settled).
#   replay.sh TITAN3D ep      a mixture of experts with expert parallelism (tiny_moe): dp4 × ep2
#     (two EP groups, each replaying the other whole) and dp2 × ep2 (one EP group: each replica
#     replays itself, said in the log), clean runs unchanged; gradient and activation flips named,
#     a dp4 parameter flip outvoted.
# REPLAY_KEEP=DIR keeps the runs in DIR.
set -u
titan3d=$1 group=$2
source "$(dirname "$0")/lib.sh"
require_corpus
if [ -n "${REPLAY_KEEP:-}" ]; then work=$REPLAY_KEEP; mkdir -p "$work"; else make_work_dir; fi
common=(--set data.path="$corpus" --set train.steps=6 --set train.warmup_steps=2
        --set train.val_every=0 --set train.log_every=100000 --set snapshot.every=2
        --set train.micro_batches=2 --set run.log_level=warn --set hardware.threads_per_rank=1
        --set hardware.gemm=openblas --set run.max_restarts=2)

# clean NAME [--set ...]: a run without replay and one with replay_every = 1, both exit 0; the
# second reports nothing and has every loss of the first, bit for bit.
clean() {
  local name=$1; shift
  run "${name}_plain" "$@"
  run "${name}_replayed" "$@" --set run.replay_every=1
  check "diff <(losses $work/${name}_plain/metrics.jsonl) <(losses $work/${name}_replayed/metrics.jsonl) > /dev/null && [ \$(losses $work/${name}_replayed/metrics.jsonl | wc -l) -eq 6 ]" \
    "$name: replay_every = 1 keeps all 6 losses bit-identical"
  check "! grep -q 'corruption' $work/${name}_replayed.log $work/${name}_replayed/logs/*.log && ! grep -qs corruption $work/${name}_replayed/incidents.jsonl" \
    "$name: replay_every = 1 reports nothing"
  check "[ \$(field $work/${name}_replayed/metrics.jsonl replay_s | awk '\$1 > 0' | wc -l) -eq 6 ] && ! grep -q replay_s $work/${name}_plain/metrics.jsonl" \
    "$name: replay_s logged at every step with replay, absent without"
  check "grep -qE '\"replay_share\": 0\\.[0-9]' $work/${name}_replayed/summary.json && ! grep -q replay_share $work/${name}_plain/summary.json" \
    "$name: summary.json gives the replay's share of the step time"
}

# caught NAME FAULT STEP WANT [--set ...]: the run with T3D_FAULT=FAULT and replay_every = 2
# exits 6 with one account of step STEP whose named rank(s) match the regular expression WANT
# (after "check): " when settled, "candidates " when not), and incidents.jsonl's line agrees.
caught() {
  local name=$1 fault=$2 step=$3 want=$4; shift 4
  T3D_FAULT=$fault "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" \
    --set run.dir="$work/$name" --set run.replay_every=2 "$@" > "$work/$name.log" 2>&1
  local rc=$? msg
  msg=$(grep "^titan3d: silent data corruption" "$work/$name.log")
  check "[ $rc -eq 6 ] && [ \$(grep -c '^titan3d: silent data corruption' $work/$name.log) -eq 1 ] && grep -qE \"at step $step \\((gradients|parameters|parameters at rest|update) check\\)(: |, not settled: candidates )$want\" <<<\"\$msg\"" \
    "$name ($fault): exit 6 at step $step naming $want" ||
    { echo "rc=$rc"; tail -5 "$work/$name.log"; }
  check "[ \$(grep -c '\"event\": \"corruption\", \"step\": $step,' $work/$name/incidents.jsonl) -eq 1 ] && grep -q '\"exit_code\": 6' $work/$name/incidents.jsonl && ! grep -q restart $work/$name/incidents.jsonl" \
    "$name: one corruption line in incidents.jsonl, no restart" ||
    cat "$work/$name/incidents.jsonl"
  check "compgen -G '$work/$name/snapshots/step_00000002*' > /dev/null && ! compgen -G '$work/$name/snapshots/step_0000000$step*' > /dev/null && grep -q 'last check passed at step 2' <<<\"\$msg\"" \
    "$name: the snapshot of step 2 (the last check passed) kept, none of step $step"
}
# incident_rank NAME RANK: incidents.jsonl names RANK, settled, with its host.
incident_rank() {
  check "grep -q '\"settled\": true, \"rank\": $2, \"host\": \"$(hostname)\"' $work/$1/incidents.jsonl" \
    "$1: incidents.jsonl names rank $2 and its host" || cat "$work/$1/incidents.jsonl"
}

case $group in
  dp)
    clean dp2 --set parallel.dp=2
    T3D_FAULT=flip:1:4:grad run dp2_grad_unseen --set parallel.dp=2
    check "! diff <(losses $work/dp2_plain/metrics.jsonl) <(losses $work/dp2_grad_unseen/metrics.jsonl) > /dev/null && diff <(losses $work/dp2_plain/metrics.jsonl | head -4) <(losses $work/dp2_grad_unseen/metrics.jsonl | head -4) > /dev/null" \
      "without replay a gradient flip at step 4 goes unseen: exit 0, the losses change after it"
    caught dp2_grad flip:1:4:grad 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.dp=2
    incident_rank dp2_grad 1
    # The account's advice taken: continuing from the snapshot of step 2 (without the fault) gives
    # the clean run's steps 3-6, bit for bit.
    "$titan3d" resume "$work/dp2_grad/snapshots/step_00000002.h5" "${common[@]}" --set parallel.dp=2 \
      --set run.replay_every=2 --set run.dir="$work/dp2_resumed" \
      --set snapshot.dir="$work/dp2_resumed/snapshots" > "$work/dp2_resumed.log" 2>&1
    rc=$?
    check "[ $rc -eq 0 ] && diff <(losses $work/dp2_plain/metrics.jsonl | tail -4) <(losses $work/dp2_resumed/metrics.jsonl) > /dev/null" \
      "dp2_grad: resumed from the kept snapshot of step 2, steps 3-6 equal the clean run's" ||
      tail -3 "$work/dp2_resumed.log"
    caught dp2_act flip:0:4:act 4 "rank 0 \\[pp0 dp0 tp0\\]" --set parallel.dp=2
    incident_rank dp2_act 0
    caught dp2_param flip:1:3:param 4 "rank 0 \\[pp0 dp0 tp0\\] on host [^ ]+ and rank 1 \\[pp0 dp1 tp0\\]" \
      --set parallel.dp=2
    check "grep -q 'with dp = 2 no third replica can say which is wrong' $work/dp2_param.log && grep -q '\"settled\": false' $work/dp2_param/incidents.jsonl" \
      "dp2_param: not settled, said so"
    # With a snapshot every step, step 3's (taken after the flip, before the check) is set aside,
    # so that `resume latest` continues from step 2's, the last verified one.
    caught dp4_param flip:2:3:param 4 "rank 2 \\[pp0 dp2 tp0\\]" --set parallel.dp=4 \
      --set snapshot.every=1
    check "! compgen -G '$work/dp4_param/snapshots/step_00000003*' > /dev/null && compgen -G '$work/dp4_param/snapshots/unverified-step-4/step_00000003.h5' > /dev/null && ! grep -qs 'step_00000003' $work/dp4_param/snapshots/latest" \
      "dp4_param: step 3's snapshot (after the flip) set aside as unverified, \`latest\` no longer names it" ||
      ls -R "$work/dp4_param/snapshots" | head
    incident_rank dp4_param 2
    check "grep -q 'outvoted in its dp group' $work/dp4_param.log" "dp4_param: settled by the parameter hashes"
    clean dp1
    check "grep -q 'replays its own step; this catches transient faults only' $work/dp1_replayed/logs/rank0.log" \
      "dp1: the log says a rank replays itself"
    caught dp1_grad flip:0:4:grad 4 "rank 0 \\[pp0 dp0 tp0\\]"
    clean moe_dp2 "${tiny_moe[@]}" --set parallel.dp=2
    # run.on_corruption = exclude on one host: nothing to leave out, the job stops as with stop.
    caught dp2_exclude_one_host flip:1:4:grad 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.dp=2 \
      --set run.on_corruption=exclude
    check "grep -q 'run.on_corruption = exclude: step 4 is not applied; the last check passed at step 2: a self-launched job on several hosts continues without host $(hostname)' $work/dp2_exclude_one_host.log && grep -q '^titan3d: corruption found by replay at step 4 (rank 1: .*) after step 3; run.on_corruption = exclude needs the job on several hosts (run.hostfile)' $work/dp2_exclude_one_host.log && grep -q '\"action\": \"exclude\", \"exclude_host\": \"$(hostname)\", \"exclude_rank\": 1' $work/dp2_exclude_one_host/incidents.jsonl" \
      "dp2_exclude_one_host: the account names the host to leave out; the launcher, with one host, stops, saying why" ||
      tail -3 "$work/dp2_exclude_one_host.log"
    for bad in run.replay_every=-1 ep3; do
      settings=(--set "$bad") key=${bad%%=*}
      # An expert-parallel group of dp2 x cp3 neither inside one cp rank's dp coordinates nor
      # holding all of them: no whole group replays another.
      [ "$bad" = ep3 ] && key=run.replay_every settings=("${tiny_moe[@]}" --set model.n_experts=6
        --set model.seq_len=48 --set model.router_aux_coef=0 --set parallel.dp=2
        --set parallel.cp=3 --set parallel.ep=3 --set run.replay_every=1)
      out=$("$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir="$work/bad" \
            "${settings[@]}" --dry-run 2>&1); rc=$?
      check "[ $rc -eq 2 ] && grep -q '\`$key\`' <<<\"\$out\"" "$bad: exit 2 naming $key" ||
        echo "$out" | tail -3
    done
    ;;
  tp_pp)
    clean dp2_tp2 --set parallel.dp=2 --set parallel.tp=2
    caught dp2_tp2_grad flip:3:4:grad 4 "rank 3 \\[pp0 dp1 tp1\\]" --set parallel.dp=2 --set parallel.tp=2
    incident_rank dp2_tp2_grad 3
    caught dp2_tp2_act flip:2:4:act 4 "rank 2 \\[pp0 dp1 tp0\\]" --set parallel.dp=2 --set parallel.tp=2
    caught dp2_tp2_param flip:1:3:param 4 "(rank [0-9] [^:]* and )?rank 1 \\[pp0 dp0 tp1\\]" \
      --set parallel.dp=2 --set parallel.tp=2
    clean pp2_dp2 --set parallel.pp=2 --set parallel.dp=2
    caught pp2_dp2_grad flip:3:4:grad 4 "rank 3 \\[pp1 dp1 tp0\\]" --set parallel.pp=2 --set parallel.dp=2
    caught pp2_dp2_act flip:1:4:act 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.pp=2 --set parallel.dp=2
    # On the last stage the corrupted activation changes the first stage's gradients too (they
    # come from its input gradient): the last stage is named first.
    caught pp2_dp2_act_last flip:3:4:act 4 "rank 3 \\[pp1 dp1 tp0\\] on host [^ ]+ and rank 1 " \
      --set parallel.pp=2 --set parallel.dp=2
    caught pp2_dp2_param flip:3:3:param 4 "rank 2 \\[pp1 dp0 tp0\\] on host [^ ]+ and rank 3 \\[pp1 dp1 tp0\\]" \
      --set parallel.pp=2 --set parallel.dp=2
    ;;
  zero_cp)
    for z in 1 2 3; do
      clean dp2_zero$z --set parallel.dp=2 --set parallel.zero=$z --set parallel.bucket_mb=0.05
    done
    caught dp2_zero2_grad flip:1:4:grad 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.dp=2 --set parallel.zero=2 \
      --set parallel.bucket_mb=0.05
    caught dp2_zero3_grad flip:0:4:grad 4 "rank 0 \\[pp0 dp0 tp0\\]" --set parallel.dp=2 --set parallel.zero=3
    caught dp2_zero3_act flip:1:4:act 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.dp=2 --set parallel.zero=3
    # ZeRO-1: a parameter flipped as the replayed step starts is used by that step's forward; the
    # copy rank 1 reads changed after step 3's update, so the hashes of the parameters at rest
    # name it, settled.
    caught dp2_zero1_param flip:1:4:param 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.dp=2 \
      --set parallel.zero=1
    incident_rank dp2_zero1_param 1
    # A ZeRO-3 shard's flip is gathered by every replica alike (their gradients agree), and a
    # ZeRO-2 replica's flipped copy is overwritten by the step's all-gather after its forward read
    # it: both are seen by the hashes of the parameters at rest, at the next check, settled. A
    # shard's flip at the check step itself too.
    caught dp2_zero3_param flip:1:3:param 4 "rank 1 \\[pp0 dp1 tp0\\]" --set parallel.dp=2 \
      --set parallel.zero=3 --set parallel.bucket_mb=0.05
    incident_rank dp2_zero3_param 1
    check "grep -q 'its dense parameters changed in memory after step 2.s update' $work/dp2_zero3_param.log && grep -q '\"check\": \"parameters at rest\"' $work/dp2_zero3_param/incidents.jsonl" \
      "dp2_zero3_param: the account says the shard changed at rest after step 2's update"
    caught dp2_zero3_param_now flip:0:4:param 4 "rank 0 \\[pp0 dp0 tp0\\]" --set parallel.dp=2 \
      --set parallel.zero=3
    caught dp2_zero2_param flip:0:3:param 4 "rank 0 \\[pp0 dp0 tp0\\]" --set parallel.dp=2 \
      --set parallel.zero=2 --set parallel.bucket_mb=0.05
    # A shard flipped at step 5, after the last check (step 4) and at the run's last step, which
    # is no check step: named there all the same.
    T3D_FAULT=flip:1:5:param "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" \
      --set run.dir="$work/dp2_zero3_last" --set train.steps=5 --set run.replay_every=2 \
      --set parallel.dp=2 --set parallel.zero=3 > "$work/dp2_zero3_last.log" 2>&1
    rc=$?
    check "[ $rc -eq 6 ] && grep -q '^titan3d: silent data corruption at step 5 (parameters at rest check): rank 1 \\[pp0 dp1 tp0\\].*the last check passed at step 4' $work/dp2_zero3_last.log" \
      "dp2_zero3_last: a shard flipped at the run's last step, no check step, is named there" ||
      tail -3 "$work/dp2_zero3_last.log"
    # An owner's wrong update (a bit of what its AdamW wrote, flipped before the all-gather hands
    # it to every replica alike; the hashes at rest are taken after it): a peer's recomputation
    # of the update names it, with dp2 the owner and its one checker as candidates, with dp4
    # settled by the second checker.
    caught dp2_zero1_update flip:1:4:update 4 "rank 0 \\[pp0 dp0 tp0\\] on host [^ ]+ and rank 1 \\[pp0 dp1 tp0\\]" \
      --set parallel.dp=2 --set parallel.zero=1
    check "grep -q '(update check), not settled' $work/dp2_zero1_update.log && grep -q 'rank 1: its update of the dense parameters: hash [0-9a-f]*, recomputed by rank 0' $work/dp2_zero1_update.log" \
      "dp2_zero1_update: the account names the update check and the two hashes"
    caught dp4_zero2_update flip:2:4:update 4 "rank 2 \\[pp0 dp2 tp0\\]" --set parallel.dp=4 \
      --set parallel.zero=2 --set parallel.bucket_mb=0.05
    incident_rank dp4_zero2_update 2
    caught dp2_zero3_update flip:0:4:update 4 "rank 0 \\[pp0 dp0 tp0\\] on host [^ ]+ and rank 1 " \
      --set parallel.dp=2 --set parallel.zero=3
    clean cp2_dp2 --set parallel.cp=2 --set parallel.dp=2
    caught cp2_dp2_grad flip:3:4:grad 4 "rank 3 \\[pp0 dp1 cp1 tp0\\]" --set parallel.cp=2 --set parallel.dp=2
    ;;
  ep)
    clean moe_dp4_ep2 "${tiny_moe[@]}" --set parallel.dp=4 --set parallel.ep=2
    caught moe_dp4_ep2_grad flip:3:4:grad 4 "rank 3 \\[pp0 dp3 tp0\\]" "${tiny_moe[@]}" \
      --set parallel.dp=4 --set parallel.ep=2
    check "grep -q 'its replay by rank 1' $work/moe_dp4_ep2_grad.log" \
      "moe_dp4_ep2_grad: rank 3 replayed by rank 1, its place in the other EP group"
    caught moe_dp4_ep2_param flip:1:3:param 4 "rank 1 \\[pp0 dp1 tp0\\]" "${tiny_moe[@]}" \
      --set parallel.dp=4 --set parallel.ep=2
    clean moe_dp2_ep2 "${tiny_moe[@]}" --set parallel.dp=2 --set parallel.ep=2
    check "grep -q 'one expert-parallel group (parallel.ep = 2) spans every replica (parallel.dp = 2): .*replays its own step' $work/moe_dp2_ep2_replayed/logs/rank0.log" \
      "moe_dp2_ep2: the log says each replica replays itself"
    caught moe_dp2_ep2_grad flip:1:4:grad 4 "rank 1 \\[pp0 dp1 tp0\\]" "${tiny_moe[@]}" \
      --set parallel.dp=2 --set parallel.ep=2
    caught moe_dp2_ep2_act flip:0:4:act 4 "rank 0 \\[pp0 dp0 tp0\\]" "${tiny_moe[@]}" \
      --set parallel.dp=2 --set parallel.ep=2
    # pp2 with a dense first stage: only the second stage holds experts (no replica of them on
    # dp2 × ep2, so only it hashes parameters at rest), yet every rank meets at the exchange of the
    # run's last step, no check step: the run ends.
    run moe_pp2_dp2_ep2 "${tiny_moe[@]}" --set model.n_layers=2 --set parallel.pp=2 \
      --set parallel.dp=2 --set parallel.ep=2 --set train.steps=5 --set run.replay_every=2
    check "[ \$(losses $work/moe_pp2_dp2_ep2/metrics.jsonl | wc -l) -eq 5 ] && ! grep -q corruption $work/moe_pp2_dp2_ep2.log" \
      "moe_pp2_dp2_ep2: a stage with experts and one without finish the last step together"
    ;;
  *) echo "FAIL: unknown group $group"; exit 1 ;;
esac
exit $fail
