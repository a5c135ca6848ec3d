#!/usr/bin/env bash
# hardware.device and the staging of a GPU stage's collectives, on a machine without a GPU:
#   - hardware.device = cuda exits 2 naming the key (no GPU visible, or no CUDA backend built);
#     auto trains on the CPU and the rank's log, the performance table and summary.json say so;
#   - the tensor collectives a GPU stage stages through host memory (parallel/staged_comm.h)
#     change no bit, and nothing outside the ops touches device memory: layouts with pipeline,
#     tensor (with sequence parallelism), context and data parallelism (ZeRO 1-3, the experts' edp
#     group), expert parallelism's rows and gates (the ep group's all-to-alls), fp32 and bf16 (bf16
#     wire and TP traffic), each trained 4 steps with the mesh's MPI groups and again with
#     T3D_GUARD_DEVICE_MEMORY=1 (the device memory guarded as a GPU's, kernels/memory_guard.h,
#     and so the staged path): every loss and gradient norm equal, and the guarded runs' logs say
#     they staged;
#   - parallel.device_comm = nccl exits 2 naming the key where the ranks compute on the CPU (the
#     recipe check with hardware.device = cpu, the ranks alike with auto).
# Usage: device_staging.sh TITAN3D
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
common=(--set data.path="$corpus" --set model.dim=64 --set model.n_layers=4 --set model.n_heads=4
        --set model.n_kv_heads=2 --set model.seq_len=32 --set train.global_batch=8
        --set train.micro_batches=2 --set train.steps=4 --set train.val_every=0
        --set hardware.hbm_gib=0.25 --set snapshot.every=0 --set hardware.gemm=openblas
        --set hardware.threads_per_rank=1)
fail=0
check() {  # check NAME [--set ...]: direct vs guarded (staged)
  local name=$1; shift
  "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" "$@" --set run.dir="$work/$name" \
    > "$work/$name.log" 2>&1 || { echo "FAIL: $name exited $?"; tail "$work/$name.log"; fail=1; return; }
  T3D_GUARD_DEVICE_MEMORY=1 "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" "$@" \
    --set run.dir="$work/$name.staged" > "$work/$name.staged.log" 2>&1 ||
    { echo "FAIL: $name guarded exited $?"; tail "$work/$name.staged.log"; guard_trace "$work/$name.staged.log"
      fail=1; return; }
  grep -q "staged through host memory (T3D_GUARD_DEVICE_MEMORY=1)" "$work/$name.staged/logs/rank0.log" ||
    { echo "FAIL: $name: the guarded run's log does not say it staged"; fail=1; return; }
  if diff <(field "$work/$name/metrics.jsonl" loss; field "$work/$name/metrics.jsonl" grad_norm) \
          <(field "$work/$name.staged/metrics.jsonl" loss; field "$work/$name.staged/metrics.jsonl" grad_norm) \
          > "$work/$name.diff"; then
    echo "ok   $name: $(field "$work/$name/metrics.jsonl" loss | wc -l) steps bit-identical staged and guarded"
  else
    echo "FAIL: $name: staged differs (< direct, > staged):"; cat "$work/$name.diff"; fail=1
  fi
}
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "skip hardware.device without a GPU: this machine has one"
else
  out=$("$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=1 \
    --set run.dir="$work/cuda" --set hardware.device=cuda 2>&1); rc=$?
  if [ $rc -ne 2 ] || ! grep -qF 'hardware.device = "cuda", but this' <<<"$out"; then
    echo "FAIL hardware.device = cuda without a GPU: rc=$rc $out"; fail=1
  else echo "ok   hardware.device = cuda without a GPU: exit 2, $(grep -F 'hardware.device' <<<"$out" | head -1)"; fi
  out=$("$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=1 \
    --set run.dir="$work/auto" --set hardware.device=auto 2>&1); rc=$?
  if [ $rc -ne 0 ] || ! grep -q 'device: cpu$' "$work/auto/logs/rank0.log" ||
     ! grep -q "devices  *1 (rank 0's: cpu)" <<<"$out" ||
     ! python3 -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["performance"]["device"] != "cpu")' "$work/auto/summary.json"; then
    echo "FAIL hardware.device = auto: rc=$rc $out"; fail=1
  else echo "ok   hardware.device = auto trains on the CPU; its log, table and summary.json say cpu"; fi
  # parallel.device_comm = "nccl" where the ranks compute on the CPU: refused before any rank
  # starts, naming the key (auto and staged train as before: the runs below use the default).
  out=$("$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=1 \
    --set run.dir="$work/nccl" --set parallel.device_comm=nccl 2>&1); rc=$?
  if [ $rc -ne 2 ] || ! grep -qF 'parallel.device_comm' <<<"$out"; then
    echo "FAIL parallel.device_comm = nccl on the CPU: rc=$rc $out"; fail=1
  else echo "ok   parallel.device_comm = nccl on the CPU: exit 2, $(grep -F 'parallel.device_comm' <<<"$out" | head -1)"; fi
  # hardware.device = auto passes the recipe check; the ranks, finding no GPU, refuse it alike.
  out=$("$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$corpus" --set train.steps=1 \
    --set run.dir="$work/nccl_auto" --set hardware.device=auto --set parallel.device_comm=nccl \
    --set parallel.dp=2 2>&1); rc=$?
  if [ $rc -ne 2 ] || ! grep -qF 'parallel.device_comm = "nccl", but the tensor collectives' <<<"$out"; then
    echo "FAIL parallel.device_comm = nccl with device auto on the CPU: rc=$rc $out"; fail=1
  else echo "ok   parallel.device_comm = nccl, hardware.device = auto, no GPU: both ranks exit 2 saying why"; fi
fi
check pp2_tp2_sp --set train.precision=fp32 --set parallel.pp=2 --set parallel.tp=2 \
  --set parallel.sequence_parallel=true
check cp2_tp2_bf16 --set train.precision=bf16 --set parallel.cp=2 --set parallel.tp=2
check pp2_zb_v_bf16 --set train.precision=bf16 --set parallel.pp=2 --set parallel.schedule=zb_v
check dp2_zero1 --set train.precision=fp32 --set parallel.dp=2 --set parallel.zero=1 \
  --set parallel.bucket_mb=0.05
check pp2_dp2_tp2_zero3 --set train.precision=fp32 --set parallel.pp=2 --set parallel.dp=2 \
  --set parallel.tp=2 --set parallel.zero=3 --set parallel.bucket_mb=0.05
check dp2_ep2_moe_zero2 --set train.precision=fp32 --set parallel.dp=2 --set parallel.ep=2 \
  --set parallel.zero=2 --set model.n_experts=4 --set model.experts_per_token=2 \
  --set model.moe_ffn_dim=48
check dp2_ep2_moe_bf16_aux --set train.precision=bf16 --set parallel.dp=2 --set parallel.ep=2 \
  --set model.n_experts=4 --set model.experts_per_token=2 --set model.moe_ffn_dim=48 \
  --set model.router_aux_coef=0.01
exit $fail
