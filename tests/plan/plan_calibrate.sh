#!/bin/bash
# `titan3d plan --calibrate` on the local machine: the probe runs under mpirun with the recipe's
# ranks (tiny model, tp 2: both the block and the tp all-reduce are measured), prints what it
# measured, writes its cache as a cluster file `--cluster` accepts, and the local plan uses it,
# then and on later runs without --calibrate (so the prediction changes from the guesses). A
# mixture of experts on ep 2 also gets its all-to-all measured, which a dense model does not need.
set -euo pipefail
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export XDG_CACHE_HOME=$tmp/cache  # never the user's own cache
cd "$tmp"
plan=("$bin" plan "$src/recipes/tiny.toml" --set parallel.tp=2 --set run.dir="$tmp/run" --top 1)
own() { grep "The recipe's own layout" <<<"$1"; }

guess=$("${plan[@]}")
grep -q "^calibration:" <<<"$guess" && fail "a calibration was used before any ran: $guess"

out=$("${plan[@]}" --calibrate)
grep -Eq "^calibrate: 2 rank\(s\) here: [0-9.e+]+ GFLOP/s per rank" <<<"$out" \
  || fail "no calibration line: $out"
grep -q "^calibration: $tmp/cache/titan3d/calibration-" <<<"$out" \
  || fail "the plan did not use the calibration: $out"
cache=$(ls "$tmp"/cache/titan3d/calibration-*.toml) || fail "no cache written"
grep -q "^peak_tflops = " "$cache" || fail "cache has no compute rate: $(cat "$cache")"
grep -q "^intra_node_latency_us = " "$cache" || fail "cache has no MPI latency: $(cat "$cache")"
grep -q "^all_to_all_gbps" "$cache" && fail "a dense model's calibration measured an all-to-all"
[ "$(own "$out")" != "$(own "$guess")" ] || fail "calibration left the prediction unchanged: $out"

again=$("${plan[@]}")
grep -q "^calibration: $cache" <<<"$again" || fail "a later plan ignored the cache: $again"
[ "$(own "$again")" = "$(own "$out")" ] || fail "cached and fresh calibration disagree: $again"
"$bin" plan "$src/recipes/tiny.toml" --set parallel.tp=2 --cluster "$cache" --top 1 >/dev/null \
  || fail "the cache is not a valid cluster file: $(cat "$cache")"
echo "plan --calibrate OK: $(own "$guess" | sed 's/.*: //') -> $(own "$out" | sed 's/.*: //')"

moe=("$bin" plan "$src/recipes/tiny.toml" --set parallel.tp=1 --set parallel.dp=2 --set parallel.ep=2
     --set model.n_experts=4 --set model.experts_per_token=2 --set model.moe_ffn_dim=32
     --set run.dir="$tmp/run" --top 1)
out=$("${moe[@]}" --calibrate)
cache=$(grep "^calibration: " <<<"$out" | sed 's/^calibration: //; s/ .*//')
grep -Eq "^all_to_all_gbps = [0-9.e+]+$" "$cache" || fail "no all-to-all bandwidth: $(cat "$cache")"
grep -Eq "^all_to_all_latency_us = [0-9.e+-]+$" "$cache" || fail "no all-to-all latency: $(cat "$cache")"
echo "plan --calibrate of a MoE recipe: $(grep '^all_to_all' "$cache" | tr '\n' ' ')"
