#!/usr/bin/env bash
# `titan3d selfcheck --quick` passes on 1, 2, 4 and 8 ranks (the 8 as pp2×dp2×tp2) with a valid
# JSON report, and fails naming the culprit under injected faults (parallel/fault.h): a rank whose
# all-reduce contribution arrives corrupted, and a rank that never sends; with expert parallelism
# it checks the EP groups' all-to-all and pairs, naming a slow pair and a silent rank.
set -u
titan3d=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
check() {  # check CONDITION DESCRIPTION
  if eval "$1"; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi
}
valid_json() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if r["rows"] else 1)' "$1"; }

for np in 1 2 4; do
  out=$("$titan3d" selfcheck --quick --np $np --set run.dir="$work/np$np" --json "$work/np$np.json" 2>&1); rc=$?
  check "[ $rc -eq 0 ] && grep -q '^OK: ' <<<\"\$out\" && grep -q 'mesh pp=1 dp=$np cp=1 tp=1' <<<\"\$out\"" \
    "$np rank(s), default model: $(tail -1 <<<"$out")" || echo "$out"
  check "valid_json $work/np$np.json" "$np rank(s): --json is valid JSON"
done

# The device rows: the CPU everywhere by default; hardware.device = cuda where no GPU is visible
# is a FAILED device row naming every rank, with the way out (on a machine with a GPU this part
# is not run: there the row would pass).
out=$("$titan3d" selfcheck --quick --np 2 --set run.dir="$work/dev" 2>&1)
check "grep -q '^device *world *every rank *OK *hardware.device = cpu: every rank computes on its host' <<<\"\$out\"" \
  "the device row: every rank on the CPU" || echo "$out"
if [ -e /dev/nvidia0 ] || [ -e /dev/nvidiactl ]; then
  echo "skip hardware.device = cuda without a GPU: this machine has one"
else
  out=$("$titan3d" selfcheck --quick --np 2 --set run.dir="$work/devcuda" --set hardware.device=cuda 2>&1); rc=$?
  check "[ $rc -eq 5 ] && grep -q '^device *world *every rank *FAILED *world ranks 0,1: hardware.device = \"cuda\", but this' <<<\"\$out\" && grep -q '^FAILED: 1 of .*device on world (world ranks 0,1)' <<<\"\$out\"" \
    "hardware.device = cuda without a GPU: the device row fails naming both ranks (rc $rc)" || echo "$out"
fi

recipe=$repo/recipes/3d_pp2_dp2_tp2.toml
out=$("$titan3d" selfcheck "$recipe" --quick --set run.dir="$work/3d" --json "$work/3d.json" 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q '^OK: ' <<<\"\$out\" && grep -q '^p2p .* OK' <<<\"\$out\" && grep -q '^replica .* OK' <<<\"\$out\"" \
  "pp2×dp2×tp2: $(tail -1 <<<"$out")" || echo "$out"
check "valid_json $work/3d.json && grep -q '\"ok\": true' $work/3d.json" "pp2×dp2×tp2: JSON says ok"

out=$(T3D_FAULT=corrupt:5 "$titan3d" selfcheck "$recipe" --quick --set run.dir="$work/corrupt" \
      --json "$work/corrupt.json" 2>&1); rc=$?
check "[ $rc -eq 5 ] && grep -q '^FAILED: .*all_reduce on tp (world rank 5)' <<<\"\$out\" && grep -q '^all_gather .* OK' <<<\"\$out\"" \
  "corrupted contribution of rank 5: rc $rc, $(tail -1 <<<"$out" | cut -c1-120)..." || echo "$out"
check "grep -q '\"ok\": false' $work/corrupt.json && grep -q '\"culprits\": \[5\]' $work/corrupt.json" \
  "corrupted contribution: the JSON names rank 5"

out=$(T3D_FAULT=nosend:4 "$titan3d" selfcheck "$recipe" --quick --set run.dir="$work/nosend" \
      --set parallel.timeout_s=4 2>&1); rc=$?
check "[ $rc -eq 5 ] && grep -q '^FAILED: 1 of .*p2p on pp (world rank 4)' <<<\"\$out\" && grep -q 'nothing from world rank 4' <<<\"\$out\"" \
  "rank 4 never sends: rc $rc, $(tail -1 <<<"$out")" || echo "$out"
# Expert parallelism (ep=4 on dp=4, a recipe `train` still refuses): the EP groups' all-to-all and
# every pair pass; a slow link between ranks 1 and 2 is a WARN naming that pair; a rank that never
# sends fails the pair check naming it.
ep=(--quick --np 4 --set model.n_experts=4 --set parallel.ep=4)
out=$("$titan3d" selfcheck "${ep[@]}" --set run.dir="$work/ep" 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q '^OK: ' <<<\"\$out\" && grep -q 'mesh pp=1 dp=4 cp=1 tp=1 ep=4' <<<\"\$out\" && grep -q '^all_to_all *ep .* OK' <<<\"\$out\" && grep -q '^p2p *ep .* OK' <<<\"\$out\" && grep -q '^pair_time *ep *6 pairs' <<<\"\$out\" && grep -q '^all_reduce *edp .* OK' <<<\"\$out\"" \
  "ep=4: $(tail -1 <<<"$out")" || echo "$out"

out=$(T3D_FAULT=slow_link:1:2:300 "$titan3d" selfcheck "${ep[@]}" --set run.dir="$work/ep_slow" 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q '^pair_time *ep *ranks 1,2 *WARN *world ranks 1 <-> 2' <<<\"\$out\" && grep -q '^pair_time *ep *6 pairs *WARN .*slowest .* (world ranks 1,2)' <<<\"\$out\"" \
  "ep=4, slow link 1<->2: $(grep '^pair_time' <<<"$out" | head -2 | tr '\n' ' ')" || echo "$out"

out=$(T3D_FAULT=nosend:3 "$titan3d" selfcheck "${ep[@]}" --set run.dir="$work/ep_nosend" \
      --set parallel.timeout_s=4 2>&1); rc=$?
check "[ $rc -eq 5 ] && grep -q '^FAILED: 1 of .*p2p on ep (world rank 3)' <<<\"\$out\" && grep -q 'nothing from world rank 3' <<<\"\$out\"" \
  "ep=4, rank 3 never sends: rc $rc, $(tail -1 <<<"$out")" || echo "$out"
out=$(T3D_FAULT=corrupt:2 "$titan3d" selfcheck "${ep[@]}" --set run.dir="$work/ep_corrupt" 2>&1); rc=$?
check "[ $rc -eq 5 ] && grep -q '^all_to_all *ep .* FAILED .*from world rank 2 wrong' <<<\"\$out\" && grep -q '^FAILED: .*all_to_all on ep (world rank 2)' <<<\"\$out\" && grep -q '^p2p *ep .* OK' <<<\"\$out\"" \
  "ep=4, rank 2's rows arrive corrupted: rc $rc, $(grep -m1 '^all_to_all' <<<"$out" | cut -c1-140)" || echo "$out"

# A rank that misses the all-to-all: the watchdog names the operation and group `ep` (exit 3).
# Operation 7 on ep is the all_to_allv (after the collectives' 5 and the all_to_all of counts).
out=$(T3D_FAULT=skip:1:ep:7 timeout 120 "$titan3d" selfcheck "${ep[@]}" --set run.dir="$work/ep_skip" \
      --set parallel.timeout_s=4 2>&1); rc=$?
check "[ $rc -eq 3 ] && grep -q 'waited more than 4 s (parallel.timeout_s) in all_to_allv on group .ep. (members world ranks {0,1,2,3})' <<<\"\$out\"" \
  "ep=4, rank 1 skips the all_to_allv: rc $rc, $(grep -m1 -o 'in all_to_allv on group[^;]*' <<<"$out")" || echo "$out"
exit $fail
