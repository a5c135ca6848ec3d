#!/usr/bin/env bash
# titan3d's layouts on one GPU, from the unpacked bundle (scripts/gpu_bundle.sh; run by
# scripts/gpu_check.sh after gpu_train_check.sh). Every rank of a layout shares the one GPU, so
# their collectives are staged through host memory (parallel::StagedComm). A 4-layer model of
# recipes/tiny.toml's shape, fp32, 4 micro-batches, 8 steps, all on the GPU:
#   1. pp2 with each schedule (1f1b, gpipe, zb_h1, interleaved_1f1b with 2 virtual stages, zb_v):
#      the one-rank run's losses, bit for bit (a pipeline moves activations; it sums nothing in
#      another order);
#   2. dp2 with ZeRO 1, 2 and 3, as on the CPU: ZeRO-1 gives the dp2 ZeRO-0 run's losses and
#      ZeRO-3 the ZeRO-2 run's, bit for bit (sharding what is kept changes no sum); ZeRO-2 sums
#      each micro-batch over dp before the micro-batches (an order of its own), within 1e-5 of
#      ZeRO-0;
#   3. tp2 with sequence parallelism, cp2, and pp2 × dp2 × tp2: the one-rank run's losses within
#      1e-5 relative (the CPU path's tolerance: sums in another order); a mixture of experts with
#      ep2 over dp2: its dp2 ep1 run's within 1e-5;
#   4. a restart: dp2 with rank 1 killed (kill -9) after step 5, run.max_restarts = 1, a snapshot
#      every 4 steps: the job continues from step 4 and every loss equals the uninterrupted dp2
#      run's, bit for bit;
#   5. compute-sanitizer (memcheck) over a 3-step one-rank training run started by mpirun: no
#      error reported;
#   6. `generate --device cuda` (the decoder's weights and KV cache in device memory) from the
#      dp2 run's last snapshot: 60 greedy tokens, the same text as `--device cpu`.
# Usage: gpu_layout_check.sh BUNDLE_ROOT REPO LOG_DIR. DEVICE=cpu runs everything on the CPU (to
# check this script where no GPU is; check 5 then runs without the sanitizer). Exit 0 when all
# hold.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" "$@"  # root, repo, logs, device, here; the paths
common=(--set data.path="$root/data/corpus.txt" --set model.n_layers=4 --set train.steps=8
        --set train.micro_batches=4 --set train.warmup_steps=2 --set train.val_every=0
        --set train.precision=fp32 --set hardware.gemm=openblas --set snapshot.every=0
        --set hardware.device="$device" --set run.max_restarts=0)
moe=(--set model.n_experts=4 --set model.experts_per_token=2 --set model.n_shared_experts=1
     --set model.moe_ffn_dim=32 --set model.dense_layers=1 --set parallel.dp=2)
failed=0
run() {  # run NAME [titan3d train args...]: trains recipes/tiny.toml into $logs/NAME
  local name=$1; shift
  out_of_time "$name" && { failed=1; return; }
  titan3d train recipes/tiny.toml "${common[@]}" --set run.dir="$logs/$name" "$@" \
    > "$logs/$name.log" 2>&1 || { echo "FAIL: $name exited $?"; tail -n 15 "$logs/$name.log"; failed=1; }
}
cd "$repo" || exit 1
run one
for s in 1f1b gpipe zb_h1 zb_v; do run "pp2_$s" --set parallel.pp=2 --set parallel.schedule=$s; done
run pp2_interleaved_1f1b --set parallel.pp=2 --set parallel.schedule=interleaved_1f1b \
  --set parallel.virtual_stages=2
for z in 0 1 2 3; do run "dp2_zero$z" --set parallel.dp=2 --set parallel.zero=$z --set parallel.bucket_mb=0.05; done
run tp2_sp --set parallel.tp=2 --set parallel.sequence_parallel=true
run cp2 --set parallel.cp=2
run pp2_dp2_tp2 --set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2
run moe_dp2 "${moe[@]}"
run moe_dp2_ep2 "${moe[@]}" --set parallel.ep=2
# 4. kill -9 of rank 1 once step 5 is logged (past the step-4 snapshot); its steps slowed to
# 0.3 s (T3D_FAULT=slow_step) so that the kill lands mid-run.
restart=(--set parallel.dp=2 --set snapshot.every=4 --set snapshot.async=false)
run dp2_straight "${restart[@]}"
if out_of_time dp2_killed; then
  failed=1
else
  T3D_FAULT=slow_step:1:300 run dp2_killed "${restart[@]}" --set run.max_restarts=1 &
  job=$!
  for _ in $(seq 1 600); do  # 60 s at most
    step=$(sed -n 's/^{"step": \([0-9]*\),.*/\1/p' "$logs/dp2_killed/metrics.jsonl" 2>/dev/null | tail -n 1)
    [ -n "$step" ] && [ "$step" -ge 5 ] && break
    sleep 0.1
  done
  kill -KILL "$(cut -d" " -f1 "$logs/dp2_killed/pids/rank1.pid" 2>/dev/null)" 2>/dev/null ||
    { echo "FAIL: no rank 1 of dp2_killed to kill (reached step ${step:-none})"; failed=1; }
  wait $job
  grep -q '"action": "restart' "$logs/dp2_killed/incidents.jsonl" 2>/dev/null ||
    { echo "FAIL: dp2_killed did not restart"; tail -n 10 "$logs/dp2_killed.log"; failed=1; }
fi
# 5. The sanitizer sees the rank's own process: mpirun starts it, titan3d joins (no self-launch).
# The toolkit's bin/ need not be on PATH (gpu_check.sh looks in /usr/local/cuda/bin too): mpirun
# would not find a bare compute-sanitizer. Without one the run goes unsanitized and says so.
sanitizer=() unsanitized="not run (cpu)"
if [ "$device" != cpu ]; then
  cs=$(command -v compute-sanitizer || { [ -x /usr/local/cuda/bin/compute-sanitizer ] &&
    echo /usr/local/cuda/bin/compute-sanitizer; })
  if [ -n "$cs" ]; then
    sanitizer=("$cs" --tool memcheck --error-exitcode 9)
  else
    unsanitized="not run (compute-sanitizer not found)"
  fi
fi
if out_of_time sanitized; then
  failed=1
else
  mpirun --allow-run-as-root -np 1 "${sanitizer[@]}" "$(command -v titan3d)" train recipes/tiny.toml \
    "${common[@]}" --set train.steps=3 --set run.dir="$logs/sanitized" > "$logs/sanitized.log" 2>&1
  rc=$?
  if grep -qi "device not supported" "$logs/sanitized.log"; then  # a sandbox's GPU (gVisor's)
    echo "compute-sanitizer memcheck over a 3-step training run on $device: not run (compute-sanitizer refused this GPU: $(grep -i -m1 -o 'device not supported[^.]*' "$logs/sanitized.log"))"
  elif [ $rc -eq 0 ] && ! grep -q "ERROR SUMMARY: [1-9]" "$logs/sanitized.log"; then
    echo "compute-sanitizer memcheck over a 3-step training run on $device: $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$logs/sanitized.log" || echo "$unsanitized")"
  else
    echo "FAIL: the sanitized run exited $rc"; grep -E "ERROR SUMMARY|Invalid|=========" "$logs/sanitized.log" | head -n 20; failed=1
  fi
fi
# 6. Decoding on the device, greedy, against the CPU's.
for dev in cpu "$device"; do
  out_of_time "generate_$dev" && { failed=1; continue; }
  titan3d generate "$logs/dp2_straight/snapshots/step_00000008.h5" --prompt "The " \
    --max-tokens 60 --temperature 0 --device "$dev" > "$logs/generate_$dev.txt" 2> "$logs/generate_$dev.log" ||
    { echo "FAIL: generate on $dev exited $?"; tail -n 5 "$logs/generate_$dev.log"; failed=1; }
done
if [ ! -s "$logs/generate_cpu.txt" ] || [ ! -s "$logs/generate_$device.txt" ]; then
  echo "FAIL: generate not compared (a run left no tokens)"; failed=1
elif cmp -s "$logs/generate_cpu.txt" "$logs/generate_$device.txt"; then
  echo "generate --device $device: the CPU's 60 greedy tokens ($(tail -n 1 "$logs/generate_$device.log" | cut -c1-90))"
else
  echo "FAIL: generate on $device differs from the CPU's:"; cat "$logs/generate_cpu.txt" "$logs/generate_$device.txt"; failed=1
fi
python3 - "$logs" "$here" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
from gpu_losses import worst, losses as losses_in
logs = sys.argv[1]
def losses(name):
    return losses_in(logs, name)
ok = True
def same(name, ref):
    global ok
    a, b = losses(name), losses(ref)
    good = len(b) == 8 and a == b
    print(f"{name} vs {ref}: {'bit-identical, 8 steps' if good else 'DIFFERENT: ' + str([(s, a.get(s), b[s]) for s in b if a.get(s) != b[s]][:3])}")
    ok &= good
def close(name, ref, rtol=1e-5):
    global ok
    a, b = losses(name), losses(ref)
    w = worst(a, b)
    good = len(b) == 8 and w <= rtol
    print(f"{name} vs {ref}: largest relative difference {w:.2e} (within {rtol:g})")
    ok &= good
for s in ("1f1b", "gpipe", "zb_h1", "zb_v", "interleaved_1f1b"):
    same(f"pp2_{s}", "one")
same("dp2_zero1", "dp2_zero0")
same("dp2_zero3", "dp2_zero2")
close("dp2_zero2", "dp2_zero0")
for name in ("tp2_sp", "cp2", "pp2_dp2_tp2"):
    close(name, "one")
close("moe_dp2_ep2", "moe_dp2")
same("dp2_killed", "dp2_straight")
sys.exit(0 if ok else 1)
PY
compared=$?
[ $failed -eq 0 ] && [ $compared -eq 0 ]
