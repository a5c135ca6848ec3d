#!/bin/bash
# `titan3d plan` from the command line: the ranked table, --explain, --write-recipe (a recipe the
# planner accepts again), --schedule with --svg, --schedule of layouts that train (the one layout
# rule), and exit code 2 with a named key on a bad cluster.
set -euo pipefail
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

plan13=("$bin" plan "$src/recipes/llama13b_64npu.toml" --cluster "$src/recipes/clusters/npu64.toml")

out=$("${plan13[@]}" --zero 0 --top 3 --explain 1 --write-recipe "$tmp/best.toml")
grep -q "layouts evaluated" <<<"$out" || fail "no table: $out"
grep -Eq "^ +64 +1 +1 +OOM" <<<"$out" || fail "DP=64 not OOM: $out"
grep -Eq "^ +16 +4 +1 +OOM" <<<"$out" || fail "TP=4 DP=16 not OOM: $out"
grep -Eq "^ +8 +4 +2 +fits" <<<"$out" || fail "TP=4 PP=2 DP=8 does not fit: $out"
grep -q "tokens/s/device = " <<<"$out" || fail "--explain printed no arithmetic: $out"
grep -q '^tp = ' "$tmp/best.toml" || fail "written recipe has no parallel.tp"
"$bin" plan "$tmp/best.toml" --cluster "$src/recipes/clusters/npu64.toml" --top 1 >/dev/null \
  || fail "the written recipe is not accepted back"

# The same model on 64 H100s (device.gpu = "h100-sxm": 80 GB, 989.4 TFLOP/s from the datasheet):
# TP=4 DP=16, OOM in the NPUs' 32 GB, fits.
out=$("$bin" plan "$src/recipes/llama13b_64npu.toml" --cluster "$src/recipes/clusters/h100_64.toml" --zero 0 --top 1)
grep -q "80 GiB, 989.4 TFLOP/s" <<<"$out" || fail "the GPU cluster's figures are not the H100's: $out"
grep -Eq "^ +16 +4 +1 +fits" <<<"$out" || fail "TP=4 DP=16 does not fit on 80 GB H100s: $out"

# Without --cluster: the recipe's hardware.cluster (relative to the working directory); a recipe
# with no cluster and far more ranks than cores here is told how to name one.
out=$(cd "$src" && "$bin" plan recipes/llama13b_64npu.toml --zero 0 --top 3)
grep -q "cluster: 64 × Ascend 910" <<<"$out" && grep -Eq "^ +8 +4 +2 +fits" <<<"$out" ||
  fail "plan without --cluster did not plan for the recipe's hardware.cluster: $out"
out=$("$bin" plan "$src/recipes/llama13b_64npu.toml" --set 'hardware.cluster=""' --zero 0 --top 3)
grep -q "is it meant for a cluster? Give --cluster FILE or set hardware.cluster" <<<"$out" ||
  fail "64 ranks planned on this machine without a word: $out"

out=$("${plan13[@]}" --schedule --svg "$tmp/timeline.svg")
grep -q "bubble" <<<"$out" || fail "--schedule printed no summary: $out"
grep -q "<svg" "$tmp/timeline.svg" || fail "no SVG written"

# --schedule of recipes that train (tiny.toml with these, run for real in issue 39): chunks of
# unequal layer counts, interleaved_1f1b with one chunk per stage, ep folded over dp × cp. The
# planner asks recipe validation's rule (layout_problem), so what trains is not refused.
tiny=("$bin" plan "$src/recipes/tiny.toml")
for sets in "model.n_layers=3 parallel.pp=2" \
  "parallel.pp=2 parallel.schedule=interleaved_1f1b train.micro_batches=2" \
  "model.n_experts=4 parallel.cp=2 parallel.ep=2"; do
  args=()
  for s in $sets; do args+=(--set "$s"); done
  "$bin" train "$src/recipes/tiny.toml" --dry-run --set data.path="$0" "${args[@]}" >/dev/null ||
    fail "tiny.toml with $sets is no longer a recipe that trains"
  out=$("${tiny[@]}" "${args[@]}" --schedule 2>&1) || fail "--schedule refused $sets: $out"
  grep -q "bubble" <<<"$out" || fail "--schedule of $sets printed no summary: $out"
done
# The search leaves out the tp whose experts' width does not split (it used to price it and stop
# on the model's assertion, exit 1).
out=$("${tiny[@]}" --set model.n_experts=4 --set model.moe_ffn_dim=1 --set train.global_batch=64 \
  --cluster "$src/recipes/clusters/npu64.toml" --top 1 2>&1) || fail "MoE search: $out"
grep -Eq "^ +64 +1 +1 " <<<"$out" || fail "MoE search: no tp = 1 mesh: $out"

printf '[cluster]\nnodes = 8\ndevices_per_node = 8\n[device]\nhbm_gb = 32\n' >"$tmp/bad.toml"
set +e
err=$("$bin" plan "$src/recipes/llama13b_64npu.toml" --cluster "$tmp/bad.toml" 2>&1)
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "bad cluster: exit $rc, expected 2: $err"
grep -q "device.hbm_gib" <<<"$err" || fail "bad cluster: no suggestion: $err"

# --calibrate measures the CPU: a recipe training on a GPU is refused before any probe runs (here
# no GPU is visible, so cuda names none; on a GPU machine it names the GPU), pointing at --cluster.
set +e
err=$("${tiny[@]}" --calibrate --set hardware.device=cuda 2>&1)
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "calibrate on a GPU recipe: exit $rc, expected 2: $err"
grep -q "measures this machine's CPU.*--cluster" <<<"$err" || fail "calibrate on a GPU: $err"
echo OK
