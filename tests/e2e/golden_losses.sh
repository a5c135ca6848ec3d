#!/usr/bin/env bash
# Golden losses: a covering set of recipes (1 rank; pp2×dp2×tp2 with each ZeRO stage; cp2; ZB-V;
# interleaved; activation checkpointing; bf16 storage; snapshot/resume and a resharded resume; a
# mixture of experts on those layouts and on expert parallelism)
# trains 4 steps, and every step's loss (printed to 9 significant digits, exact for fp32) and the
# SHA-256 of the final parameters (exported safetensors) must equal what the file
# tests/e2e/golden/GROUP.txt recorded. A restructuring that changes no arithmetic keeps them
# bit-identical; any change to what is computed, or to the order of a sum, shows here.
#
#   golden_losses.sh TITAN3D portable   fp32 GEMMs (OpenBLAS) and bf16 storage: the same bits on
#                                        every x86-64 CPU with AVX2 and FMA, because the kernels
#                                        are pinned (OPENBLAS_CORETYPE=Haswell, T3D_SIMD=avx2,
#                                        one thread per rank)
#   golden_losses.sh TITAN3D onednn     bf16 GEMMs through oneDNN: its kernels depend on the ISA
#                                        oneDNN picks, so there is one file per ISA,
#                                        golden/onednn-ISA.txt (its first line names it), and the
#                                        test skips (exit 77, saying why) on a CPU whose ISA has
#                                        none recorded yet
#
#   golden_losses.sh TITAN3D GROUP replayed   the same recipes with run.replay_every = 1 (every
#                                        step replayed on a peer and checked: docs/resilience.md,
#                                        Replay) give the same bits and no false alarm, the runs
#                                        with expert parallelism included
#
# GOLDEN_RECORD=1 writes the file instead of comparing: do that only on a commit whose arithmetic
# is trusted, and say why in the commit that changes a golden file. GOLDEN_KEEP=DIR keeps the runs
# (logs, metrics, snapshots) in DIR to look at a difference.
set -u
titan3d=$1 group=$2 variant=${3:-}
case $variant in "" | replayed) ;; *) echo "FAIL: the variant must be replayed, not '$variant'"; exit 1 ;; esac
source "$(dirname "$0")/lib.sh"
require_corpus
if [ -n "${GOLDEN_KEEP:-}" ]; then work=$GOLDEN_KEEP; mkdir -p "$work"; else make_work_dir; fi
golden=$repo/tests/e2e/golden/$group.txt
export OPENBLAS_CORETYPE=Haswell T3D_SIMD=avx2
grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo ||
  { echo "SKIP: this CPU lacks AVX2 or FMA, which the pinned kernels of the goldens need"; exit 77; }
common=(--set data.path="$corpus" --set model.dim=64 --set model.n_layers=4 --set model.n_heads=4
        --set model.n_kv_heads=2 --set model.seq_len=32 --set train.global_batch=8
        --set train.micro_batches=2 --set train.steps=4 --set train.warmup_steps=2
        --set train.val_every=2 --set train.val_batches=2 --set hardware.hbm_gib=0.25
        --set snapshot.every=2 --set hardware.openblas_coretype=Haswell
        --set hardware.threads_per_rank=1)
fp32=(--set train.precision=fp32 --set hardware.gemm=openblas)
bf16_storage=(--set train.precision=bf16 --set hardware.gemm=openblas)
bf16_gemm=(--set train.precision=bf16 --set hardware.gemm=onednn)
pp2_dp2_tp2=(--set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2)
# A mixture of experts with every part on: a dense first block, a shared expert, the selection
# bias and the auxiliary loss.
moe=(--set model.n_experts=4 --set model.experts_per_token=2 --set model.moe_ffn_dim=48
     --set model.n_shared_experts=1 --set model.dense_layers=1 --set model.router_bias_rate=1e-3
     --set model.router_aux_coef=1e-2)
results=$work/results.txt
if [ "$variant" = replayed ]; then
  common+=(--set run.replay_every=1)
  [ "${GOLDEN_RECORD:-0}" = 1 ] && { echo "FAIL: record without the replayed variant"; exit 1; }
fi
: > "$results"
recorder=record  # how train and resume record a run

# record NAME: appends NAME, its losses and validation losses, and its parameters' hash.
record() {
  local name=$1 snap
  snap=$(ls "$work/$name"/snapshots/step_*.h5 2>/dev/null | sort | tail -1)
  [ -n "$snap" ] || { echo "FAIL: $name wrote no snapshot"; exit 1; }
  "$titan3d" export "$snap" --out "$work/$name.export" > "$work/$name.export.log" 2>&1 ||
    { echo "FAIL: export of $name exited $?"; tail "$work/$name.export.log"; exit 1; }
  printf '%s\tloss %s\tval %s\tparams %s\n' "$name" \
    "$(losses "$work/$name/metrics.jsonl" | paste -sd,)" \
    "$(sed -n 's/.*"val_loss": \([^,}]*\).*/\1/p' "$work/$name/metrics.jsonl" | paste -sd,)" \
    "$(sha256sum < "$work/$name.export/model.safetensors" | cut -c1-16)" >> "$results"
}
# record_snapshot NAME: as record, the parameters' hash taken from the last snapshot's /model
# datasets (every parameter and router bias, by name, in little-endian binary) instead of an
# export, for models no Hugging Face layout can hold (a selection bias: docs/moe.md).
record_snapshot() {
  local name=$1 snap d
  snap=$(ls "$work/$name"/snapshots/step_*.h5 2>/dev/null | sort | tail -1)
  [ -n "$snap" ] || { echo "FAIL: $name wrote no snapshot"; exit 1; }
  for d in $(h5ls -r "$snap/model" | awk '$2 == "Dataset" { print $1 }' | sort); do
    h5dump -b LE -d "/model$d" -o "$work/dataset.bin" "$snap" > /dev/null ||
      { echo "FAIL: h5dump of /model$d in $snap"; exit 1; }
    printf '%s\n' "$d"; cat "$work/dataset.bin"
  done > "$work/$name.params"
  printf '%s\tloss %s\tval %s\tsnapshot params %s\n' "$name" \
    "$(losses "$work/$name/metrics.jsonl" | paste -sd,)" \
    "$(sed -n 's/.*"val_loss": \([^,}]*\).*/\1/p' "$work/$name/metrics.jsonl" | paste -sd,)" \
    "$(sha256sum < "$work/$name.params" | cut -c1-16)" >> "$results"
}
train() {  # train NAME [--set ...]
  local name=$1; shift
  "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir="$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { echo "FAIL: $name exited $?"; tail -20 "$work/$name.log"; exit 1; }
  "$recorder" "$name"
}
resume() {  # resume NAME FROM_RUN STEP [--set ...]: continues FROM_RUN's snapshot of STEP
  local name=$1 from=$2 step=$3; shift 3
  "$titan3d" resume "$work/$from/snapshots/step_$(printf %08d "$step").h5" "${common[@]}" \
    --set run.dir="$work/$name" --set snapshot.dir="$work/$name/snapshots" "$@" \
    > "$work/$name.log" 2>&1 ||
    { echo "FAIL: $name exited $?"; tail -20 "$work/$name.log"; exit 1; }
  "$recorder" "$name"
}

case $group in
  portable)
    train r1 "${fp32[@]}"
    for z in 0 1 2 3; do
      train "pp2_dp2_tp2_zero$z" "${fp32[@]}" "${pp2_dp2_tp2[@]}" --set parallel.zero=$z \
        --set parallel.bucket_mb=0.05
    done
    train cp2_tp2_sp "${fp32[@]}" --set parallel.cp=2 --set parallel.tp=2 \
      --set parallel.sequence_parallel=true
    train pp2_zb_v_ckpt "${fp32[@]}" --set parallel.pp=2 --set parallel.schedule=zb_v \
      --set train.activation_checkpoint=every:2
    train pp2_interleaved_ckpt "${fp32[@]}" --set parallel.pp=2 \
      --set parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2 \
      --set train.activation_checkpoint=full
    train pp2_dp2_cp2_zb_h1 "${fp32[@]}" --set parallel.pp=2 --set parallel.dp=2 --set parallel.cp=2 \
      --set parallel.zero=1 --set parallel.schedule=zb_h1
    resume r1_resumed r1 2 "${fp32[@]}"
    resume r1_resharded_pp2_dp2_zero3 r1 2 "${fp32[@]}" --set parallel.pp=2 --set parallel.dp=2 \
      --set parallel.zero=3
    train bf16_storage_r1 "${bf16_storage[@]}"
    train bf16_storage_pp2_dp2_tp2_sp_zero1 "${bf16_storage[@]}" "${pp2_dp2_tp2[@]}" \
      --set parallel.zero=1 --set parallel.sequence_parallel=true
    recorder=record_snapshot
    train moe_r1 "${fp32[@]}" "${moe[@]}"
    train moe_pp2_dp2_tp2_sp_zb_h1 "${fp32[@]}" "${moe[@]}" "${pp2_dp2_tp2[@]}" \
      --set parallel.sequence_parallel=true --set parallel.schedule=zb_h1
    train moe_dp2_ep2_zero3_capacity "${fp32[@]}" "${moe[@]}" --set parallel.dp=2 \
      --set parallel.ep=2 --set parallel.zero=3 --set model.capacity_factor=1.25
    resume moe_r1_resharded_dp2_ep2 moe_r1 2 "${fp32[@]}" "${moe[@]}" --set parallel.dp=2 \
      --set parallel.ep=2
    train moe_bf16_storage_dp2_ep2_ckpt "${bf16_storage[@]}" "${moe[@]}" --set parallel.dp=2 \
      --set parallel.ep=2 --set train.activation_checkpoint=full
    ;;
  onednn)
    if ! "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" "${bf16_gemm[@]}" \
         --set train.steps=1 --set snapshot.every=0 --set run.dir="$work/probe" > "$work/probe.log" 2>&1; then
      grep -q "oneDNN cannot run" "$work/probe.log" &&
        { echo "SKIP: $(grep -o 'oneDNN cannot run.*' "$work/probe.log" | head -1)"; exit 77; }
      echo "FAIL: a one-step bf16 run exited non-zero"; tail "$work/probe.log"; exit 1
    fi
    isa=$(grep -o 'cpu isa [a-z0-9_]*' "$work/probe/logs/rank0.log" | head -1)
    [ -n "$isa" ] || { echo "FAIL: rank 0's log does not name oneDNN's ISA"; exit 1; }
    echo "oneDNN $isa" >> "$results"
    golden=$repo/tests/e2e/golden/onednn-${isa#cpu isa }.txt
    if [ "${GOLDEN_RECORD:-0}" != 1 ] && [ ! -f "$golden" ]; then
      recorded=$(cd "$repo/tests/e2e/golden" && ls onednn-*.txt | sed 's/^onednn-//; s/\.txt$//' | paste -sd, -)
      echo "SKIP: this machine's oneDNN runs $isa, and its bf16 kernels sum in another order than the ISAs recorded ($recorded); record $golden with GOLDEN_RECORD=1 on a commit whose arithmetic is trusted"
      exit 77
    fi
    train bf16_r1 "${bf16_gemm[@]}"
    train bf16_dp2_zero3 "${bf16_gemm[@]}" --set parallel.dp=2 --set parallel.zero=3 \
      --set parallel.bucket_mb=0.05
    train bf16_pp2_dp2_tp2_sp_zero2 "${bf16_gemm[@]}" "${pp2_dp2_tp2[@]}" --set parallel.zero=2 \
      --set parallel.sequence_parallel=true
    resume bf16_r1_resharded_dp2 bf16_r1 2 "${bf16_gemm[@]}" --set parallel.dp=2
    ;;
  *) echo "FAIL: group must be portable or onednn, not '$group'"; exit 1 ;;
esac

if [ "${GOLDEN_RECORD:-0}" = 1 ]; then
  mkdir -p "$(dirname "$golden")"
  cp "$results" "$golden"
  echo "recorded $(grep -c . "$golden") lines into $golden"
  exit 0
fi
[ -f "$golden" ] || { echo "FAIL: no golden file $golden"; exit 1; }
expected=$golden
if [ "$variant" = replayed ]; then
  for run in $(cut -s -f1 "$results"); do
    grep -q '"replay_s"' "$work/$run/metrics.jsonl" ||
      { echo "FAIL: $run logged no replay_s: nothing was replayed"; exit 1; }
  done
fi
if diff "$expected" "$results" > "$work/diff.txt"; then
  echo "$(grep -c $'\tloss' "$results") runs bit-identical to $golden${variant:+ ($variant)}"
  exit 0
fi
echo "FAIL: results differ from $golden (< golden, > now):"
cat "$work/diff.txt"
exit 1
