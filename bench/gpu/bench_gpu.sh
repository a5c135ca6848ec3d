#!/usr/bin/env bash
# titan3d against the same LLaMA in PyTorch on one GPU, side by side in one call (issue 40's first
# speed figure; issue 41's benchmark): a ~125 M model (dim 768, 12 layers, seq 1024) and a ~1 B
# one (dim 2048, 16 layers, 16 heads of 128 with 8 kv heads, seq 2048), 32k vocabulary, bf16:
#   - titan3d: `titan3d train`, hardware.device = cuda, train.precision = bf16, one rank;
#   - PyTorch eager: bench/e2e/llama_torch.py --device cuda --bf16 (autocast) --sdpa --fused;
#   - PyTorch compiled: the same with --compile.
# And, with SIZES="moe moe_dense", issue 41's mixture of experts: 8 experts, top 2 (softmax router,
# normalised gates), ~1.2 B parameters of which ~0.39 B active a token (dim 1024, 16 layers, expert
# FFN 2816), against the dense model of equal active parameters (FFN 5632); the line
#   moe-bench: <GPU> moe / dense-active tokens/s: titan3d 0.85x eager 0.40x compile 0.70x
# Each reports median-step tokens/s, titan3d its snapshots' stall (SNAPSHOT_SIZES, default 125m:
# a `snapshot-bench:` line) and its step-time breakdown (its last 3 steps' GPU
# time by kind of op: GEMM, attention, ..., and what no GPU op covers); MFU is titan3d's own figure (against the GPU's datasheet bf16
# peak, docs/metrics.md) scaled by the tokens/s ratio for PyTorch, so both use one FLOP count and
# one peak. The last line summarises the ~1 B row:
#   gpu-bench: <GPU> eager 1.23x compile 1.05x mfu 47.1%
# Usage: bench_gpu.sh BUNDLE_ROOT REPO LOG_DIR (scripts/gpu_check.sh runs it from the bundle;
# SIZES="125m" for one size, STEPS=10; DEVICE=cpu SIZES=tiny checks the script where no GPU is,
# PyTorch then eager only, without its fused attention and AdamW).
set -uo pipefail
# root, repo, logs; the bundle's binaries, Open MPI and libraries first on the paths: the bundle's
# own gpu_env.sh, so that the paths are the ones its layout needs.
source "$1/bin/gpu_env.sh" "$@"
python=$(command -v python3 || command -v python)
steps=${STEPS:-10} device=${DEVICE:-cuda}
corpus=$root/data/corpus.txt
cd "$repo" || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "GPU: ${gpu:-none}; host: $(lscpu | sed -n 's/^Model name: *//p')"
# size: dim layers heads kv_heads seq batch hbm_gib experts ffn (experts 0: dense; ffn 0: the
# default 8·dim/3 rounded, else the dense FFN or one expert's)
declare -A shape=([125m]="768 12 12 12 1024 8 20 0 0" [1b]="2048 16 16 8 2048 4 70 0 0"
                  [moe]="1024 16 16 8 2048 4 70 8 2816" [moe_dense]="1024 16 16 8 2048 4 70 0 5632"
                  [tiny]="64 2 4 2 64 2 1 0 0" [tinymoe]="64 2 4 2 64 2 1 4 64"
                  [tinymoe_dense]="64 2 4 2 64 2 1 0 128")
fast=(--sdpa --fused)
[ "$device" = cuda ] || fast=()
status=0
for size in ${SIZES:-125m 1b}; do
  read -r dim layers heads kv seq batch hbm experts ffn <<<"${shape[$size]}"
  model=(--set model.vocab_size=32000 --set model.dim=$dim --set model.n_layers=$layers
         --set model.n_heads=$heads --set model.n_kv_heads=$kv --set model.seq_len=$seq)
  shape_torch=()
  if [ "$experts" -gt 0 ]; then
    model+=(--set model.n_experts=$experts --set model.experts_per_token=2 --set model.moe_ffn_dim=$ffn)
    shape_torch=(--n_experts $experts --experts_per_token 2 --moe_ffn_dim $ffn)
  elif [ "$ffn" -gt 0 ]; then
    model+=(--set model.ffn_dim=$ffn)
    shape_torch=(--ffn_dim $ffn)
  fi
  # Snapshots (SNAPSHOT_SIZES, default the ~125 M model: its 1.5 GB states; the ~1 B model's
  # are 11 GB each): every steps/2 steps, asynchronous, their stall read back below.
  snap=(--set snapshot.every=0)
  [[ " ${SNAPSHOT_SIZES-125m} " == *" $size "* ]] &&
    snap=(--set snapshot.every=$((steps / 2)) --set snapshot.async=true
          --set snapshot.dir="$logs/titan3d_$size/snapshots")
  T3D_GPU_OP_TIMES=3 titan3d train recipes/default.toml "${model[@]}" --set parallel.pp=1 --set parallel.dp=1 \
    --set parallel.tp=1 --set train.global_batch=$batch --set train.micro_batches=1 \
    --set train.steps=$steps --set train.warmup_steps=2 --set train.val_every=0 \
    "${snap[@]}" --set train.precision=bf16 --set hardware.device=$device \
    --set hardware.hbm_gib=$hbm --set data.path="$corpus" --set run.dir="$logs/titan3d_$size" \
    > "$logs/titan3d_$size.log" 2>&1 || { echo "FAIL: titan3d $size exited $?"; tail -n 5 "$logs/titan3d_$size.log"; status=1; }
  rm -rf "$logs/titan3d_$size/snapshots"  # the GPU machine's disk is small
  torch=(--device $device --bf16 "${fast[@]}" --vocab_size 32000 --dim $dim --n_layers $layers
         --n_heads $heads --n_kv_heads $kv --seq_len $seq --batch $batch --steps $((steps + 2))
         --warmup 3 --data "$corpus" "${shape_torch[@]}")
  "$python" bench/e2e/llama_torch.py "${torch[@]}" > "$logs/torch_eager_$size.json" 2> "$logs/torch_eager_$size.log" ||
    { echo "FAIL: PyTorch eager $size"; tail -n 3 "$logs/torch_eager_$size.log"; status=1; }
  [ "$device" = cuda ] || continue
  "$python" bench/e2e/llama_torch.py "${torch[@]}" --compile > "$logs/torch_compile_$size.json" 2> "$logs/torch_compile_$size.log" ||
    { echo "FAIL: PyTorch compile $size"; tail -n 3 "$logs/torch_compile_$size.log"; status=1; }
done
"$python" - "$logs" "${gpu:-unknown GPU}" ${SIZES:-125m 1b} <<'PY'
import json, sys
logs, gpu, sizes = sys.argv[1], sys.argv[2], sys.argv[3:]
def read(path, *keys):
    try:
        d = json.load(open(path))
        for k in keys:
            d = d[k]
        return d
    except (OSError, ValueError, KeyError, TypeError):
        return None
print(f"{'model':13} {'titan3d tok/s':>14} {'MFU':>7} {'mem GiB':>8} {'eager tok/s':>12} {'MFU':>7} {'compile tok/s':>14} {'MFU':>7}  titan3d / eager, / compile")
last, rows = None, {}
for size in sizes:
    perf = read(f"{logs}/titan3d_{size}/summary.json", "performance") or {}
    t, mfu, mem = perf.get("tokens_per_s"), perf.get("mfu"), perf.get("peak_mem_gib")
    e = read(f"{logs}/torch_eager_{size}.json", "tokens_per_s")
    c = read(f"{logs}/torch_compile_{size}.json", "tokens_per_s")
    def cell(x, fmt):
        return format(x, fmt) if x is not None else format("-", ">" + fmt.split(",")[0].split(".")[0])
    def pct(x):
        return format(f"{x:.1f}%" if x is not None else "-", ">7")
    def torch_mfu(x):
        return 100 * mfu * x / t if x and t and mfu else None
    ratio = lambda x: f"{t / x:.2f}x" if t and x else "-"
    print(f"{size:13} {cell(t, '14,.0f')} {pct(100 * mfu if mfu is not None else None)} {cell(mem, '8.1f')} "
          f"{cell(e, '12,.0f')} {pct(torch_mfu(e))} {cell(c, '14,.0f')} {pct(torch_mfu(c))}  {ratio(e)}, {ratio(c)}")
    rows[size] = (t, e, c)
    if not size.endswith("moe") and not size.endswith("moe_dense"):
        last = (size, t, e, c, mfu)
if last:
    size, t, e, c, mfu = last
    r = lambda x: f"{t / x:.2f}x" if t and x else "-"
    print(f"gpu-bench: {gpu} ({size}) eager {r(e)} compile {r(c)} mfu {100 * mfu:.1f}%" if mfu is not None
          else f"gpu-bench: {gpu} ({size}) eager {r(e)} compile {r(c)} mfu -")
# Snapshots out of the step (issue 41's target: every 100 steps, stall <= 1 % of the step time).
for size in sizes:
    stalls, steps = [], []
    try:
        for line in open(f"{logs}/titan3d_{size}/metrics.jsonl"):
            m = json.loads(line)
            if "snapshot_stall_s" in m:
                stalls.append(m["snapshot_stall_s"])
            elif m.get("step_time_s"):
                steps.append(m["step_time_s"])
    except (OSError, ValueError):
        continue
    if stalls and steps:
        stall, step = sorted(stalls)[len(stalls) // 2], sorted(steps)[len(steps) // 2]
        print(f"snapshot-bench: {gpu} ({size}) stall {1e3 * stall:.1f} ms per snapshot, median step "
              f"{1e3 * step:.1f} ms: every 100 steps {100 * stall / (100 * step):.3f}% of the step time")
for moe in ("moe", "tinymoe"):  # the mixture against the dense model of equal active parameters
    if moe in rows and moe + "_dense" in rows:
        q = [f"{m / d:.2f}x" if m and d else "-" for m, d in zip(rows[moe], rows[moe + "_dense"])]
        print(f"moe-bench: {gpu} ({moe}) moe / dense-active tokens/s: titan3d {q[0]} eager {q[1]} compile {q[2]}")
PY
# Where titan3d's step time goes: its last 3 steps timed op by op on the GPU (T3D_GPU_OP_TIMES=3,
# docs/gpu.md; the median step above is an untimed one).
for size in ${SIZES:-125m 1b}; do
  grep -ho "GPU time per step.*" "$logs/titan3d_$size/logs/rank0.log" 2>/dev/null | sed "s/^/$size: /"
done
exit $status
