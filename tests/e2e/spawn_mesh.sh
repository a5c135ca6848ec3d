#!/usr/bin/env bash
# `titan3d train` outside any launcher re-executes itself under mpirun with pp·dp·cp·tp ranks;
# the 8 ranks of pp2×dp2×tp2 build their communicators and report their coordinates.
set -u
titan3d=$1 recipe=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf 'A few words of text for a data file.\n' > "$work/data.txt"
out=$("$titan3d" train "$recipe" --set run.dir="$work/run" --set data.path="$work/data.txt" \
      --set train.steps=0 2>&1)
echo "$out"
fail=0
for r in 0 1 2 3 4 5 6 7; do
  grep -q "rank   $r \[pp$((r / 4)) dp$((r / 2 % 2)) tp$((r % 2))\]" <<<"$out" || { echo "FAIL: rank $r missing or misplaced"; fail=1; }
done
grep -q "communicators verified" <<<"$out" || { echo "FAIL: no verification line"; fail=1; }
[ "$(ls "$work/run/logs" | wc -l)" -eq 8 ] || { echo "FAIL: expected 8 rank logs"; fail=1; }
# The world must match the recipe: --np with a fixed dp is refused before spawning.
out=$("$titan3d" train "$recipe" --set run.dir="$work/run2" --set data.path="$work/data.txt" --np 4 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "parallel" <<<"$out" || { echo "FAIL: --np 4 on an 8-rank recipe: rc=$rc $out"; fail=1; }
# dp = -1 takes the rest of the world.
out=$("$titan3d" train "$recipe" --set run.dir="$work/run3" --set data.path="$work/data.txt" \
      --set parallel.dp=-1 --set parallel.pp=1 --set train.steps=0 --set train.global_batch=6 --set train.micro_batches=1 --np 6 2>&1)
grep -q "mesh pp=1 dp=3 cp=1 tp=2 = 6 ranks" <<<"$out" || { echo "FAIL: dp=-1 with --np 6: $out"; fail=1; }
exit $fail
