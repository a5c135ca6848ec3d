#!/usr/bin/env bash
# Two hosts on this machine: network namespaces `hosta` and `hostb` (each with its own host name,
# through a UTS namespace) joined by a veth pair, 10.97.0.1 and 10.97.0.2. Open MPI reaches host B
# through a launch agent that enters B's namespaces instead of ssh, and its TCP traffic (MPI and
# its own out-of-band channel) is restricted to the veth; inside a host ranks use shared memory.
# On that cluster:
#   1. pp2 × dp2 × tp2, ranks 0-3 on host A and 4-7 on host B: every tp group inside a host, the
#      pipeline's traffic across the link; the losses equal the one-rank run's.
#   2. the same ranks dealt round-robin (--map-by node): titan3d warns that tp groups straddle hosts.
#   3. `titan3d selfcheck` on that layout: intra-host and inter-host link rows, bandwidth rows say
#      which groups cross hosts.
#   4. host B's link cut mid-run (`ip link set ... down`): the watchdog names host B.
#   5. titan3d self-launched on host A over both hosts (run.hostfile, Open MPI's agent and networks
#      from its environment) with run.elastic: host B's link cut after a snapshot; the job
#      finishes on host A alone, pp2 × dp1 × tp2 with twice the micro-batches, and every step's
#      loss equals the uninterrupted two-host run's within 5e-5 (fp32, OpenBLAS: pinned).
#   6. The same without run.elastic: the job stops, naming host B as unreachable (and, with the
#      memory tier on, leaves nothing of it in /dev/shm).
#   7. Regrow: as 5, but host B's link comes back while the shrunk job runs; the job probes it
#      (run.elastic_regrow_s), stops at a snapshot and continues on both hosts as pp2 × dp2 × tp2,
#      every step's loss again within 5e-5 of the uninterrupted run's. This run keeps its
#      snapshots in the memory tier (snapshot.memory_every = 10; on disk only the stop's snapshot),
#      and host B's /dev/shm directory is deleted with the host (here both "hosts" share
#      /dev/shm): the shrunk job restores the memory tier, host B's shards from their buddy copies
#      on host A, resharded onto pp2 × dp1 × tp2, and nothing of the job is left in /dev/shm at
#      its end.
# Traffic stays inside the two namespaces made here. Skips (exit 77) when not root or when network
# namespaces cannot be made. Everything started in the namespaces is ended on exit.
set -u
titan3d=$(realpath "$1")
source "$(dirname "$0")/lib.sh"
need_root "network namespaces"
need_packages iproute2 util-linux openmpi-bin
require_corpus

make_two_hosts "" 97 /tmp/t3d_2hosts.XXXXXX
printf '10.97.0.1 slots=4\n10.97.0.2 slots=4\n' > "$work/hostfile"

# mpi ARGS...: mpirun on host A (as a user would run it on the cluster's first node).
mpi() {
  timeout "${MPI_TIMEOUT:-240}" "$work/agent" hosta mpirun --allow-run-as-root -np 8 \
    --hostfile "$work/hostfile" --bind-to none \
    --mca plm_rsh_agent "$work/agent" \
    --mca btl self,vader,tcp --mca btl_tcp_if_include 10.97.0.0/24 \
    --mca oob_tcp_if_include 10.97.0.0/24 \
    -x OPENBLAS_NUM_THREADS=1 -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=PASSIVE "$@"
}
model=(--set data.path="$corpus" --set model.dim=64 --set model.n_layers=4 --set model.n_heads=4
       --set model.n_kv_heads=2 --set model.seq_len=32 --set train.global_batch=8
       --set train.micro_batches=2 --set train.steps=4 --set train.val_every=0
       --set hardware.hbm_gib=0.25 --set run.max_restarts=0)
layout=(--set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2)

# 1. Across the two hosts vs one rank.
"$titan3d" train "$repo/recipes/tiny.toml" "${model[@]}" --set run.dir="$work/one" \
  > "$work/one.log" 2>&1 || { echo "FAIL: one-rank reference"; tail "$work/one.log"; exit 1; }
mpi "$titan3d" train "$repo/recipes/tiny.toml" "${model[@]}" "${layout[@]}" \
  --set run.dir="$work/two" > "$work/two.log" 2>&1
rc=$?
hosts=$(sed -n 's/.*rank *\([0-9]\) \[.*host \(host[ab]\).*/\1\2/p' "$work/two.log" | xargs)
check "[ $rc -eq 0 ] && [ '$hosts' = '0hosta 1hosta 2hosta 3hosta 4hostb 5hostb 6hostb 7hostb' ]" \
  "pp2×dp2×tp2 over TCP: ranks 0-3 on hosta, 4-7 on hostb (rc $rc)" || tail -20 "$work/two.log"
check "! grep -q 'straddle' '$work/two.log'" "tp groups inside hosts: no placement warning"
if [ -s "$work/two/metrics.jsonl" ]; then
  printf '     losses, two hosts vs one rank: '
  compare_losses "$work/two/metrics.jsonl" "$work/one/metrics.jsonl" 1e-5 || fail=1
else
  echo "FAIL no metrics from the two-host run"; fail=1
fi

# 2. Round-robin placement puts every tp group across the link.
mpi --map-by node "$titan3d" train "$repo/recipes/tiny.toml" "${model[@]}" "${layout[@]}" \
  --set train.steps=1 --set run.dir="$work/rr" > "$work/rr.log" 2>&1
check "grep -q '4 of 4 tensor-parallel groups straddle hosts' '$work/rr.log'" \
  "ranks round-robin over hosts: $(grep -o 'tp group of world ranks 0,1 spans hosts[^.;]*' "$work/rr.log" | head -1)" ||
  tail -5 "$work/rr.log"

# 3. selfcheck on the two-host layout.
mpi "$titan3d" selfcheck --quick "$repo/recipes/tiny.toml" "${model[@]}" "${layout[@]}" \
  --set run.dir="$work/check" > "$work/check.log" 2>&1
rc=$?
check "[ $rc -eq 0 ] && grep -q '^OK: ' '$work/check.log'" "selfcheck across hosts: $(grep -E '^(OK|FAILED):' "$work/check.log")" ||
  tail -20 "$work/check.log"
check "grep -qE '^link +intra .*hosta <-> hosta \(intra-host\)' '$work/check.log' && grep -qE '^link +inter .*hosta <-> hostb \(inter-host\)' '$work/check.log'" \
  "selfcheck reports intra- and inter-host links:"
grep -E '^link ' "$work/check.log" | sed 's/^/       /'
check "grep -qE '^bandwidth +tp .*intra-host' '$work/check.log' && grep -qE '^bandwidth +pp .*inter-host' '$work/check.log'" \
  "selfcheck bandwidth rows: tp groups intra-host, pp groups inter-host"

# 4. Cut host B's link once training runs; the watchdog (parallel.timeout_s = 5) must name hostb.
MPI_TIMEOUT=120 mpi "$titan3d" train "$repo/recipes/tiny.toml" "${model[@]}" "${layout[@]}" \
  --set train.steps=100000 --set parallel.timeout_s=5 --set run.dir="$work/cut" \
  > "$work/cut.log" 2>&1 &
job=$!
if wait_for 60 test -s "$work/cut/metrics.jsonl"; then
  ip -n "$ns_b" link set "$link_b" down
  cut_at=$(date +%s)
  wait_for 60 grep -q 'watchdog:' "$work/cut.log"
  took=$(( $(date +%s) - cut_at ))
  sleep 1  # let the other ranks' watchdog lines arrive; the one naming hostb is wanted
  line=$(grep 'watchdog:.*waiting on host hostb' "$work/cut.log" | head -1)
  [ -n "$line" ] || line=$(grep -m1 'watchdog:' "$work/cut.log")
  check "grep -q 'waiting on host hostb (world ranks\\? [4-7,]*)' <<<\"\$line\"" \
    "link of hostb cut: watchdog after ${took}s: ${line#*watchdog: }" || tail -20 "$work/cut.log"
else
  echo "FAIL the long run did not start training within 60 s"; tail -20 "$work/cut.log"; fail=1
fi
# mpirun cannot reach host B's daemon any more; it is ended with the namespaces' processes.
for pid in $(ip netns pids "$ns_a") $(ip netns pids "$ns_b"); do kill -9 "$pid" 2> /dev/null; done
wait "$job" 2> /dev/null

# 5-6. Self-launched over both hosts: titan3d's own mpirun, run.hostfile, and Open MPI's launch
# agent and networks from the environment (as a cluster's mca-params.conf would give them).
ip -n "$ns_b" link set "$link_b" up
self_launched() {
  timeout "${SUP_TIMEOUT:-300}" env OMPI_MCA_plm_rsh_agent="$work/agent"     OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=10.97.0.0/24     OMPI_MCA_oob_tcp_if_include=10.97.0.0/24     "$work/agent" hosta "$titan3d" train "$repo/recipes/tiny.toml" "${model[@]}" "${layout[@]}"     --set run.hostfile="$work/hostfile" --set train.steps=$long_steps --set snapshot.every=20     --set parallel.timeout_s=5 --set train.precision=fp32 --set hardware.gemm=openblas "$@"
}
# The regrow run's shrunk job must still be training when host B answers again (B comes back as
# soon as the shrink is logged; the job probes it once it logged a step and run.elastic_regrow_s
# passed): measured 12 steps from its resume to the stop. Cut after step 50, 200 steps leave it
# about 140.
long_steps=200
# last_hosts LOG N: "<rank><host>" of the last N rank lines of LOG (its last launch), by rank.
last_hosts() { sed -n 's/.*rank *\([0-9]\) \[.*host \(host[ab]\).*/\1\2/p' "$1" | tail -"$2" | sort | xargs; }
# every_step_as_straight RUN WHAT: RUN logged every step, each loss within 5e-5 of the
# uninterrupted run's (straight.losses). The continuation sums in another order (dp1 with twice
# the micro-batches) for up to ~160 steps, and fp32 rounding differences grow with them: measured
# up to 4.5e-8 (AMD EPYC Zen 5, openblas-fp32), and 1.3e-5 over 340 such steps. A wrong
# continuation (a micro-batch lost, another lr or sampler position) differs by orders of magnitude
# more.
every_step_as_straight() {
  counted_losses "$work/$1/metrics.jsonl" > "$work/$1.losses"
  local n
  n=$(grep -c . "$work/$1.losses")
  check "[ $n -eq $long_steps ]" "$1: every step logged ($n of $long_steps)"
  printf '     losses, %s (%s) vs uninterrupted: ' "$1" "$2"
  compare_losses "$work/$1.losses" "$work/straight.losses" 5e-5 || fail=1
}
# cut_after RUN STEP: cuts host B's link once RUN logged STEP (a snapshot before it committed).
cut_after() {
  if wait_for 120 awk -v s="$2" '/^{"step"/ { split($2, a, ","); if (a[1] + 0 >= s) f = 1 } END { exit !f }' "$work/$1/metrics.jsonl"; then
    ip -n "$ns_b" link set "$link_b" down
    echo "     cut host B's link after step $(sed -n 's/^{"step": \([0-9]*\),.*/\1/p' "$work/$1/metrics.jsonl" | tail -1)"
  else
    echo "FAIL $1 did not reach step $2 within 120 s"; fail=1
  fi
}
self_launched --set run.dir="$work/straight" --set run.max_restarts=0 > "$work/straight.log" 2>&1
check "[ $? -eq 0 ]" "self-launched over both hosts (run.hostfile): the uninterrupted run" ||
  tail -20 "$work/straight.log"

self_launched --set run.dir="$work/elastic" --set run.elastic=true --set run.max_restarts=2 \
  > "$work/elastic.log" 2>&1 &
job=$!
cut_after elastic 50
# Host B is gone: its processes end too, as they would with the host (mpirun's were ended by
# titan3d once the shrink was decided).
wait_for 120 grep -q 'elastic: unreachable' "$work/elastic.log"
for pid in $(ip netns pids "$ns_b"); do kill -9 "$pid" 2> /dev/null; done
wait "$job"
rc=$?
check "[ $rc -eq 0 ]" "elastic: the job finished after host B was cut (rc $rc)" || tail -30 "$work/elastic.log"
line=$(grep -m1 'elastic: unreachable' "$work/elastic.log")
check "grep -q 'host 10.97.0.2 .*pp2 dp2 tp2 (8 ranks, 2 micro-batches per replica) -> pp2 dp1 tp2 (4 ranks, 4 micro-batches per replica)' <<<\"\$line\"" \
  "elastic: the log says what changed and why: ${line#titan3d: }"
check "grep -q '\"action\": \"shrink to pp2 dp1 tp2' '$work/elastic/incidents.jsonl' && grep -q '\"restarts\": 1' '$work/elastic/summary.json'" \
  "elastic: incidents.jsonl records the shrink, summary.json one restart"
hosts=$(last_hosts "$work/elastic.log" 4)
check "[ '$hosts' = '0hosta 1hosta 2hosta 3hosta' ]" "elastic: the continued job runs on host A alone ($hosts)"
counted_losses "$work/straight/metrics.jsonl" > "$work/straight.losses"
every_step_as_straight elastic "dp2 -> dp1 on host A"

# 7. Regrow: host B comes back while the job runs shrunk on host A.
ip -n "$ns_b" link set "$link_b" up
self_launched --set run.dir="$work/regrow" --set run.elastic=true --set run.max_restarts=2 \
  --set run.elastic_regrow_s=1 --set snapshot.every=1000 --set snapshot.memory_every=10 \
  > "$work/regrow.log" 2>&1 &
job=$!
cut_after regrow 50
wait_for 120 grep -q 'elastic: unreachable' "$work/regrow.log"
for pid in $(ip netns pids "$ns_b"); do kill -9 "$pid" 2> /dev/null; done
tier=$(grep -o '/dev/shm/titan3d-[0-9a-f]*-[0-9a-f]*-' "$work/regrow.log" | head -1)
rm -rf "${tier:-/nonexistent/}hostb"  # host B's memory went with it
ip -n "$ns_b" link set "$link_b" up
wait "$job"
rc=$?
check "[ $rc -eq 0 ]" "regrow: the job finished (rc $rc)" || tail -30 "$work/regrow.log"
restore=$(grep -m1 '"event": "restore"' "$work/regrow/incidents.jsonl" 2> /dev/null)
check "grep -q '\"tier\": \"memory\", \"snapshot_step\": [1-9][0-9]*[05], \"disk_step\": 0,' <<<\"\$restore\" && grep -q 'memory tier: step [0-9]* complete among the 1 living host(s): hosta' '$work/regrow.log' && grep -q '(resharded: .*dp=2.* -> .*dp=1.*), written on cpu in .* (tier: memory)' '$work/regrow.log'" \
  "memory tier: host B lost with its /dev/shm, the shrunk job restored the memory tier from host A's buddy copies, resharded: ${restore#*\"tier\"}" ||
  { grep -E 'memory tier|resumed|elastic' "$work/regrow.log" | tail -8; cat "$work/regrow/incidents.jsonl"; }
line=$(grep -m1 'reachable again' "$work/regrow.log")
check "grep -q 'elastic: host 10.97.0.2 reachable again; stopped at the snapshot of step [0-9]* and continuing on all 2 hosts: pp2 dp1 tp2 (4 ranks, 4 micro-batches per replica) -> pp2 dp2 tp2 (8 ranks, 2 micro-batches per replica)' <<<\"\$line\"" \
  "regrow: the log says so: ${line#titan3d: }" || tail -30 "$work/regrow.log"
check "grep -q '\"restarts\": 1' '$work/regrow/summary.json' && grep -q '\"kind\": \"regrow\"' '$work/regrow/summary.json' && grep -q 'elastic regrow' '$work/regrow.log'" \
  "regrow: one restart (the shrink); summary.json and the end table record the regrow"
hosts=$(last_hosts "$work/regrow.log" 8)
check "[ '$hosts' = '0hosta 1hosta 2hosta 3hosta 4hostb 5hostb 6hostb 7hostb' ]" "regrow: the continued job runs on both hosts again ($hosts)"
every_step_as_straight regrow "dp2 -> dp1 -> dp2"
check "[ -n '$tier' ] && ! compgen -G '$tier*' > /dev/null" "memory tier: nothing of the job left in /dev/shm ($tier*)"

ip -n "$ns_b" link set "$link_b" up
self_launched --set run.dir="$work/rigid" --set run.max_restarts=1 --set snapshot.memory_every=10 \
  > "$work/rigid.log" 2>&1 &
job=$!
cut_after rigid 50
wait "$job"
rc=$?
line=$(grep -m1 'unreachable host' "$work/rigid.log")
check "[ $rc -ne 0 ] && [ -s '$work/rigid/restart.toml' ] && grep -q 'unreachable host 10.97.0.2 (mpirun .*a restart on the same hosts cannot start. Set run.elastic = true' <<<\"\$line\"" \
  "without run.elastic: stops naming the host (rc $rc): ${line#titan3d: }" || tail -10 "$work/rigid.log"
tier=$(grep -o '/dev/shm/titan3d-[0-9a-f]*-[0-9a-f]*-' "$work/rigid.log" | head -1)
check "[ -n '$tier' ] && ! compgen -G '$tier*' > /dev/null" \
  "without run.elastic, with the memory tier: nothing of the stopped job left in /dev/shm ($tier*)"
exit $fail
