#!/usr/bin/env bash
# `train --trace` on pp2×dp2×tp2 writes one Chrome trace (valid JSON) with spans from all 8 ranks:
# forward/backward per micro-batch and chunk, collectives with group and bytes, sends/receives, the
# optimizer, snapshot staging. The run also ends with the performance table and summary.json.
set -u
titan3d=$1
source "$(dirname "$0")/../e2e/lib.sh"
require_corpus
make_work_dir
out=$("$titan3d" train "$repo/recipes/3d_pp2_dp2_tp2.toml" --trace --set data.path="$corpus" \
      --set train.steps=3 --set train.val_every=0 --set snapshot.every=2 --set model.dim=64 \
      --set run.dir="$work/run" 2>&1); rc=$?
fail=0
[ $rc -eq 0 ] || { echo "FAIL: train exited $rc"; echo "$out" | tail -20; exit 1; }
python3 - "$work/run/trace.json" <<'PY' || fail=1
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
spans = [e for e in events if e["ph"] == "X"]
ranks = sorted({e["pid"] for e in spans})
names = {e["name"] for e in spans}
need = {"forward", "backward", "optimizer", "all_reduce", "isend", "recv", "step", "snapshot staging"}
groups = {e["args"].get("group") for e in spans if e["cat"] == "comm"}
ok = ranks == list(range(8)) and need <= names and {"tp", "dp_cp", "pp", "world"} <= groups
ok = ok and all(e["dur"] >= 0 and "bytes" in e["args"] for e in spans if e["cat"] == "comm")
ok = ok and all({"mb", "chunk"} <= e["args"].keys() for e in spans if e["name"] == "backward")
print(("ok  " if ok else "FAIL"), f"trace: {len(spans)} spans from ranks {ranks}; names {sorted(names)}; groups {sorted(g for g in groups if g)}")
sys.exit(0 if ok else 1)
PY
[ "$(ls "$work/run/trace" | wc -l)" -eq 8 ] && echo "ok   8 per-rank trace files" || { echo "FAIL: per-rank trace files"; fail=1; }
for row in "layout  *pp2 dp2 tp2" "devices  *8" "tokens/s per device" "communication share TP" \
           "communication share DP" "communication share PP" "pipeline bubble" "MFU"; do
  grep -qE "$row" <<<"$out" || { echo "FAIL: performance table lacks '$row'"; fail=1; }
done
python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["performance"]; sys.exit(0 if p["devices"] == 8 and p["tokens_per_s"] > 0 else 1)' \
  "$work/run/summary.json" && echo "ok   performance table printed and in summary.json" || { echo "FAIL: summary.json"; fail=1; }
exit $fail
