#!/usr/bin/env bash
# The launcher gives each rank the cores of its threads: one rank with n threads runs on n CPUs,
# n one-thread ranks on one CPU each, all different. Needs a machine with at least 2 CPUs that
# this process may use (skips with code 77 otherwise).
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
cpus=$(nproc)
[ "$cpus" -ge 2 ] || { echo "SKIP: $cpus CPU available; binding n threads needs n >= 2"; exit 77; }
n=2
fail=0
run() {  # run NAME [--set ...]
  local name=$1; shift
  "$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=2 \
    --set train.val_every=0 --set run.dir="$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { echo "FAIL: $name exited $?"; tail "$work/$name.log"; exit 1; }
}
cpu_count() { sed -n 's/.*CPU set [0-9,-]* (\([0-9]*\) CPUs*) for.*/\1/p' "$1" | head -1; }
cpu_list() { sed -n 's/.*CPU set \([0-9,-]*\) (.*/\1/p' "$1" | head -1; }
run one_rank --set hardware.threads_per_rank=$n
got=$(cpu_count "$work/one_rank/logs/rank0.log")
[ "$got" = "$n" ] && echo "1 rank × $n threads: bound to $got CPUs ($(cpu_list "$work/one_rank/logs/rank0.log"))" ||
  { echo "FAIL: 1 rank × $n threads runs on '${got}' CPUs, expected $n"; grep "CPU set" "$work/one_rank/logs/rank0.log"; fail=1; }
grep -q "may run on" "$work/one_rank/logs/rank0.log" && { echo "FAIL: warned about its binding"; fail=1; }
run dp --set parallel.dp=$n --set hardware.threads_per_rank=1
sets=$(for r in $(seq 0 $((n - 1))); do cpu_list "$work/dp/logs/rank$r.log"; done | sort -u | wc -l)
counts=$(for r in $(seq 0 $((n - 1))); do cpu_count "$work/dp/logs/rank$r.log"; done | sort -u)
[ "$counts" = "1" ] && [ "$sets" -eq "$n" ] && echo "dp=$n × 1 thread: each rank on its own CPU" ||
  { echo "FAIL: dp=$n × 1 thread: CPU counts '$counts', $sets distinct sets"; grep -h "CPU set" "$work"/dp/logs/rank*.log; fail=1; }
# Oversubscribed (more threads than cores): no rank pinned to one core, and a warning where a rank
# is left fewer CPUs than threads never appears because nothing is bound.
run over --set parallel.dp=$n --set hardware.threads_per_rank=$cpus
for r in $(seq 0 $((n - 1))); do
  got=$(cpu_count "$work/over/logs/rank$r.log")
  [ "$got" = "$cpus" ] || { echo "FAIL: oversubscribed rank $r runs on $got CPUs, expected all $cpus"; fail=1; }
done
[ $fail -eq 0 ] && echo "oversubscribed: every rank may use all $cpus CPUs"
exit $fail
