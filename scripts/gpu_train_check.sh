#!/usr/bin/env bash
# titan3d training on a GPU, from the unpacked bundle (scripts/gpu_bundle.sh; run by
# scripts/gpu_check.sh): recipes/tiny.toml for 20 steps, fp32, one rank,
#   1. on the CPU and on the GPU (hardware.device = cuda): the losses agree within 1e-4 relative
#      (the same arithmetic summed in another order, compounded over 20 updates);
#   2. on the GPU twice: the same losses, bit for bit (deterministic);
#   3. resumed on the GPU from its step-10 snapshot: steps 11-20 give the uninterrupted run's bits
#      (the snapshot holds the device's state exactly, and the GEMM algorithms it ran);
#   4. pp2 × dp2 × tp2 with ZeRO-1 (eight ranks sharing the GPU, their collectives staged through
#      host memory) against the same layout on the CPU, within 1e-4 relative;
#   5. across devices: the GPU's step-10 snapshot resumed on the CPU and the CPU's on the GPU, steps
#      11-20 within 1e-4 of the run they continue; eval of the GPU's step-20 snapshot on the GPU
#      and on the CPU within 1e-6 relative;
#   6. bf16 on the GPU: recipes/default.toml's model on one rank, 200 steps, in fp32 and in bf16:
#      the bf16 losses within 2% of the fp32 run's at every step;
#   7. selfcheck's device rows on two ranks sharing the GPU (GEMM TFLOP/s against the datasheet,
#      pinned copy GB/s): the run passes, and the rows are printed;
#   8. a mixture of experts: recipes/moe.toml (pp2 × dp2, four ranks sharing the GPU; the router
#      bias's balancing) with the auxiliary loss on, 20 fp32 steps, on the CPU and on the GPU, and
#      again with expert parallelism (ep2: the rows' all-to-alls staged through host memory): the
#      GPU's losses within 1e-4 relative of the CPU's (the MoE ops' CUDA twins, docs/moe.md);
#   9. snapshots beside the step: a full asynchronous snapshot after every step, once as is and
#      once serialised (CUDA_LAUNCH_BLOCKING=1: each launch and copy done before the host goes on,
#      so the copy stream never overlaps the compute stream), and as is again: every snapshot's
#      /model and /optim bit-identical across the three (h5py), and so the losses. A copy that
#      raced the optimizer (before_state_changes missed on a path) would differ; compute-sanitizer
#      cannot see such a race between streams. Two runs as is: issue 40's snapshot bytes.
# Usage: gpu_train_check.sh BUNDLE_ROOT REPO LOG_DIR. DEVICE=cpu runs the "GPU" runs on the CPU
# instead (to check this script and the bundle where no GPU is). Exit 0 when all nine hold.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" "$@"  # root, repo, logs, device, here; the paths
common=(--set data.path="$root/data/corpus.txt" --set train.steps=20 --set train.val_every=0
        --set train.precision=fp32 --set hardware.gemm=openblas --set snapshot.every=10
        --set snapshot.async=false)
# A run that fails is reported and the others still run (a GPU is lent for minutes: every
# finding of one call counts); the comparisons that need it then fail.
failed=0
run() {  # run NAME DEVICE [titan3d args...]: trains (or resumes) into $logs/NAME
  local name=$1 dev=$2; shift 2
  out_of_time "$name" && { failed=1; return; }
  if "$@" "${common[@]}" --set hardware.device="$dev" --set run.dir="$logs/$name" \
    > "$logs/$name.log" 2>&1; then
    grep -h "device:" "$logs/$name/logs/rank0.log" | head -n 1 | sed "s/^.*device:/$name: device:/"
  else
    echo "FAIL: $name exited $?"; tail -n 20 "$logs/$name.log"; failed=1
  fi
}
cd "$repo" || exit 1
run cpu cpu titan3d train recipes/tiny.toml
run gpu "$device" titan3d train recipes/tiny.toml
run gpu_again "$device" titan3d train recipes/tiny.toml
run gpu_resumed "$device" titan3d resume "$logs/gpu/snapshots/step_00000010.h5" \
  --set snapshot.dir="$logs/gpu_resumed/snapshots"
run cpu_from_gpu cpu titan3d resume "$logs/gpu/snapshots/step_00000010.h5" \
  --set snapshot.dir="$logs/cpu_from_gpu/snapshots"
run gpu_from_cpu "$device" titan3d resume "$logs/cpu/snapshots/step_00000010.h5" \
  --set snapshot.dir="$logs/gpu_from_cpu/snapshots"
# The resumed run installs the GEMM algorithms its snapshot recorded (runtime/machine/
# gpu_gemm_table.h): the same algorithm per shape, so the same bits (check 3).
if [ "$device" = cuda ]; then
  if grep -q "algorithms recorded in" "$logs/gpu_resumed/logs/rank0.log"; then
    echo "gpu_resumed: the snapshot's GEMM algorithms installed"
  else
    echo "FAIL: gpu_resumed did not take its snapshot's GEMM algorithms"; failed=1
    grep -h "GEMM" "$logs/gpu_resumed/logs/rank0.log" | head -n 2
  fi
fi
for dev in cpu "$device"; do
  out_of_time "eval_$dev" && { failed=1; continue; }
  titan3d eval "$logs/gpu/snapshots/step_00000020.h5" --set hardware.device="$dev" \
    --json "$logs/eval_$dev.json" > "$logs/eval_$dev.log" 2>&1 ||
    { echo "FAIL: eval on $dev exited $?"; tail -n 5 "$logs/eval_$dev.log"; failed=1; }
done
layout=(--set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2 --set parallel.zero=1)
run cpu_3d cpu titan3d train recipes/tiny.toml "${layout[@]}"
run gpu_3d "$device" titan3d train recipes/tiny.toml "${layout[@]}"
for ep in 1 2; do
  run cpu_moe_ep$ep cpu titan3d train recipes/moe.toml --set model.router_aux_coef=0.01 \
    --set parallel.ep=$ep
  run gpu_moe_ep$ep "$device" titan3d train recipes/moe.toml --set model.router_aux_coef=0.01 \
    --set parallel.ep=$ep
done
one=(--set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1 --set data.path="$root/data/corpus.txt"
     --set train.val_every=0 --set snapshot.every=0 --set hardware.device="$device")
for precision in fp32 bf16; do
  out_of_time "default_$precision" && { failed=1; continue; }
  titan3d train recipes/default.toml "${one[@]}" --set train.precision=$precision \
    --set run.dir="$logs/default_$precision" > "$logs/default_$precision.log" 2>&1 ||
    { echo "FAIL: default_$precision exited $?"; tail -n 20 "$logs/default_$precision.log"; failed=1; }
done
# 9: after every step (--set after common's: the later value wins).
for name in snap snap_serial snap_again; do
  out_of_time "gpu_$name" && { failed=1; continue; }
  serial=0; [ $name = snap_serial ] && serial=1
  CUDA_LAUNCH_BLOCKING=$serial titan3d train recipes/tiny.toml "${common[@]}" \
    --set hardware.device="$device" --set snapshot.every=1 --set snapshot.async=true \
    --set snapshot.full_every=1 --set snapshot.keep=20 --set run.dir="$logs/gpu_$name" \
    > "$logs/gpu_$name.log" 2>&1 ||
    { echo "FAIL: gpu_$name exited $?"; tail -n 20 "$logs/gpu_$name.log"; failed=1; }
done
# h5py: the GPU machine's python3 has it; Debian's (python3-h5py) where another python3 lacks it.
h5python=python3
python3 -c 'import h5py' 2>/dev/null || h5python=/usr/bin/python3
"$h5python" - "$logs" "$here" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
from gpu_losses import snapshot_differences, losses
logs = sys.argv[1]
ok = True
for other in ("snap_serial", "snap_again"):
    n, diffs = snapshot_differences(f"{logs}/gpu_snap/snapshots", f"{logs}/gpu_{other}/snapshots")
    same = losses(logs, "gpu_snap") == losses(logs, f"gpu_{other}") != {}
    print(f"GPU snapshots after every step vs {other}: {n} steps, "
          + ("every /model and /optim bit-identical" if n == 20 and not diffs else
             f"DIFFERENT: {diffs[:3]}") + (", losses the same" if same else ", losses DIFFERENT"))
    ok &= n == 20 and not diffs and same
sys.exit(0 if ok else 1)
PY
[ $? -eq 0 ] || failed=1
python3 - "$logs" "$device" "$here" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[3])
from gpu_losses import worst, losses as losses_in
logs = sys.argv[1]
def losses(name):
    return losses_in(logs, name)
cpu, gpu, again, resumed = (losses(n) for n in ("cpu", "gpu", "gpu_again", "gpu_resumed"))
ok = True
w = worst(gpu, cpu)
print(f"GPU vs CPU over {len(cpu)} steps: largest relative difference {w:.2e} (within 1e-4)")
ok &= len(cpu) == 20 and len(gpu) == len(cpu) and w <= 1e-4
same = bool(gpu) and gpu == again
print(f"GPU twice: {'the same bits' if same else 'DIFFERENT: ' + str([(s, gpu[s], again.get(s)) for s in gpu if gpu[s] != again.get(s)][:3])}")
ok &= same
tail = {s: gpu.get(s) for s in resumed}
resumed_ok = len(resumed) == 10 and resumed == tail
print(f"GPU resumed from step 10: {'steps 11-20 bit-identical' if resumed_ok else 'DIFFERENT: ' + str(resumed) + ' vs ' + str(tail)}")
ok &= resumed_ok
for name, ref in (("cpu_from_gpu", gpu), ("gpu_from_cpu", cpu)):
    cont = losses(name)
    wc = worst(cont, {s: ref[s] for s in cont}) if len(cont) == 10 else float("inf")
    print(f"{name}: steps 11-20 of {len(cont)} within {wc:.2e} of the run it continues (within 1e-4)")
    ok &= wc <= 1e-4
def eval_loss(dev):
    try:
        return json.load(open(f"{logs}/eval_{dev}.json"))["loss"]
    except (OSError, ValueError, KeyError):
        return float("nan")
e_cpu, e_gpu = eval_loss("cpu"), eval_loss(sys.argv[2])
we = abs(e_gpu - e_cpu) / abs(e_cpu) if e_cpu == e_cpu and e_gpu == e_gpu else float("inf")
print(f"eval of the GPU's step-20 snapshot: {e_gpu:.9f} on the GPU, {e_cpu:.9f} on the CPU, {we:.1e} apart (within 1e-6)")
ok &= we <= 1e-6
cpu4, gpu4 = losses("cpu_3d"), losses("gpu_3d")
w4 = worst(gpu4, cpu4)
print(f"GPU vs CPU, pp2 x dp2 x tp2 ZeRO-1 on 8 ranks: largest relative difference {w4:.2e} (within 1e-4)")
ok &= len(cpu4) == 20 and len(gpu4) == len(cpu4) and w4 <= 1e-4
for ep in (1, 2):
    cpu_moe, gpu_moe = losses(f"cpu_moe_ep{ep}"), losses(f"gpu_moe_ep{ep}")
    wm = worst(gpu_moe, cpu_moe)
    print(f"GPU vs CPU, recipes/moe.toml (pp2 x dp2 ep{ep}, aux loss) on 4 ranks: largest relative difference {wm:.2e} (within 1e-4)")
    ok &= len(cpu_moe) == 20 and len(gpu_moe) == len(cpu_moe) and wm <= 1e-4
fp32, bf16 = losses("default_fp32"), losses("default_bf16")
w16 = worst(bf16, fp32)
print(f"bf16 vs fp32 on the GPU, default model, {len(bf16)} steps: largest relative difference {w16:.2e} at a step (within 2e-2)")
ok &= len(fp32) == 200 and len(bf16) == 200 and w16 <= 2e-2
sys.exit(0 if ok else 1)
PY
trained=$?
out_of_time selfcheck && exit 1
titan3d selfcheck recipes/tiny.toml --quick --set parallel.dp=2 --set hardware.device="$device" \
  --set data.path="$root/data/corpus.txt" --set run.dir="$logs/selfcheck" > "$logs/selfcheck.log" 2>&1
checked=$?
grep -E "^device" "$logs/selfcheck.log"
[ $checked -eq 0 ] || { echo "FAIL: selfcheck on $device exited $checked"; tail -n 5 "$logs/selfcheck.log"; }
[ $failed -eq 0 ] && [ $trained -eq 0 ] && [ $checked -eq 0 ]
