#!/usr/bin/env bash
# titan3d vs PyTorch (Debian's python3-torch) training the same LLaMA configuration on the same
# data with the same cores, side by side in one run: tokens/s (median over steps 3.., then over
# RUNS interleaved rounds, every configuration once per round so drifting load hits all alike).
#
#   PyTorch fp32 and PyTorch with bf16 autocast (its CPU mixed precision), 1 process × THREADS;
#   bf16 autocast both with passive OpenMP waiting and spinning (GOMP_SPINCOUNT=300000, what
#   titan3d's launcher gives a rank that owns its cores); PyTorch's best is the fastest of these
#   titan3d train.precision = fp32 and = auto (the precision and GEMM it measures fastest here),
#   each as 1 rank × THREADS threads and as dp = THREADS ranks × 1 thread
#
# Prints the CPU model, the measured hardware peaks (fp32 FMA, bf16 dot product) and the GEMM each
# titan3d run chose, then the ratios the targets in bench/README.md are stated in. PyTorch gets
# OpenBLAS's best kernels for this CPU; its fp32 runs wait passively (its OpenBLAS and OpenMP
# pools would otherwise spin against each other).
# Usage: bench/e2e/bench_vs_pytorch.sh [extra titan3d --set ...]
# On a CPU without avx512_bf16 (AMD EPYC Zen 3) the bf16 autocast rows are "not competitive" and
# not run; any bf16 run over TORCH_BF16_LIMIT_S (300) seconds is recorded so too.
# TITAN3D=/path/to/titan3d benchmarks that build instead of build/apps/titan3d.
# BASELINE=/path/to/an/older/titan3d also runs that binary (both layouts) in every round, with
# train.precision = BASELINE_PRECISION (default fp32; auto compares the bf16 paths before/after).
# EXPERTS=E (TOPK=K, MOE_FFN=F, default the dense ffn / K) benchmarks a mixture of experts instead
# (docs/moe.md; PyTorch: Hugging Face's Mixtral block), and adds titan3d's dense model with the
# same active parameters (ffn_dim = K·F) to every round.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
runs=${RUNS:-3} steps=${STEPS:-12} threads=${THREADS:-$(nproc)}
dim=${DIM:-512} layers=${LAYERS:-8} heads=${HEADS:-8} seq=${SEQ:-256} batch=${BATCH:-8}
experts=${EXPERTS:-0} topk=${TOPK:-2}
dense_ffn=$(( (8 * dim / 3 + 63) / 64 * 64 ))
moe_ffn=${MOE_FFN:-$(( dense_ffn / topk ))}
moe_sets=() moe_args=()
if [ "$experts" -gt 0 ]; then
  moe_sets=(--set model.n_experts="$experts" --set model.experts_per_token="$topk" --set model.moe_ffn_dim="$moe_ffn")
  moe_args=(--n_experts "$experts" --experts_per_token "$topk" --moe_ffn_dim "$moe_ffn")
fi
python=/usr/bin/python3  # Debian's interpreter: it sees python3-torch
$python -c "import torch" 2>/dev/null || { echo "needs Debian's python3-torch: apt-get install python3-torch"; exit 1; }
[ -s data/fortunes_train.bin ] || bash scripts/get_data.sh
bin=${TITAN3D:-build/apps/titan3d}  # TITAN3D=path: another build
"$bin" keys >/dev/null
# A stale build gives another commit's figures: say which binary runs, and warn when it is older
# than this checkout's last commit.
echo "titan3d: $(realpath "$bin"), built $(date -r "$bin" '+%F %T')"
if [ "$(stat -c %Y "$bin")" -lt "$(git log -1 --format=%ct 2>/dev/null || echo 0)" ]; then
  echo "WARNING: $bin is older than this checkout's last commit ($(git log -1 --format=%h)):" \
       "rebuild (bash scripts/build.sh), or these are another commit's figures"
fi
# The OpenBLAS kernels titan3d's launcher picks for this CPU (SkylakeX needs AVX-512: forced on a
# CPU without it, PyTorch dies with SIGILL at its first GEMM); empty: OpenBLAS's own detection.
# BENCH_CPU_FLAGS stands in for /proc/cpuinfo's flags (to check this script's CPU cases).
flags=" ${BENCH_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)} "
has_flag() { [[ "$flags" == *" $1 "* ]]; }
if has_flag avx512f && has_flag avx512bw && has_flag avx512vl && has_flag avx512dq; then auto_coretype=SkylakeX
elif has_flag avx2 && has_flag fma; then auto_coretype=Haswell
else auto_coretype=""; fi
coretype=${OPENBLAS_CORETYPE:-$auto_coretype}
# Without avx512_bf16 PyTorch's bf16 autocast emulates bf16 (measured on AMD EPYC Zen 3: 16
# tokens/s, 127 s a step of this model): not competitive, so it is recorded as such, not run for
# half an hour a round. A run over TORCH_BF16_LIMIT_S seconds is recorded the same way.
torch_bf16_native=1
has_flag avx512_bf16 || torch_bf16_native=0
torch_bf16_limit_s=${TORCH_BF16_LIMIT_S:-300}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

median() { awk '$1 != "nan"' | sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
field() { tail -n +3 "$1" | sed -n "s/.*\"$2\": \\([0-9.e+-]*\\).*/\\1/p" | median; }  # median over steps 3..
declare -A tok mfu gemm_mfu kind
record() { tok[$1]+="$2 " mfu[$1]+="$3 " gemm_mfu[$1]+="$4 "; }

# titan3d NAME BINARY [--set ...]: trains; records tokens/s, mfu, mfu_gemm; remembers the GEMM.
titan3d() {
  local name=$1 binary=$2; shift 2
  local dir=$work/$name.$round
  local model_sets=("${moe_sets[@]}")  # the dense model of equal active parameters: its own ffn
  [ "$name" != t_dense_active ] || model_sets=(--set model.ffn_dim=$((topk * moe_ffn)))
  "$binary" train recipes/tiny.toml --set model.dim="$dim" --set model.n_layers="$layers" \
    --set model.n_heads="$heads" --set model.n_kv_heads="$heads" --set model.seq_len="$seq" \
    --set train.global_batch="$batch" --set train.micro_batches=1 --set train.steps="$steps" \
    --set train.val_every=0 --set data.path=data/fortunes_train.bin --set data.val_fraction=0 \
    --set hardware.hbm_gib=8 --set run.dir="$dir" "${model_sets[@]}" "$@" > "$dir.log" 2>&1 ||
    { tail "$dir.log" >&2; exit 1; }
  record "$name" "$(field "$dir/metrics.jsonl" tokens_per_s)" "$(field "$dir/metrics.jsonl" mfu)" \
         "$(field "$dir/metrics.jsonl" mfu_gemm)"
  kind[$name]=$(sed -n 's/.*GEMM: \([a-z0-9-]*\) .*/\1/p' "$dir.log" | head -1)
  [ -n "${kind[$name]}" ] || kind[$name]=fp32
  peaks_line=$(grep -h "MFU against" "$dir.log" | head -1 | sed 's/.*MFU against/MFU against/' || true)
  [ -z "$peaks_line" ] || echo "$peaks_line" >> "$work/peaks"
}
declare -A not_competitive
pytorch() {  # pytorch NAME passive|spin [--bf16]
  local name=$1 wait=$2; shift 2
  local policy=(OMP_WAIT_POLICY=PASSIVE) limit=()
  [ "$wait" = passive ] || policy=(GOMP_SPINCOUNT=300000)
  if [ "${1:-}" = --bf16 ]; then
    if [ "$torch_bf16_native" = 0 ]; then
      not_competitive[$name]="no avx512_bf16: PyTorch emulates bf16; not run"
      record "$name" nan nan nan; return
    fi
    [ -z "${not_competitive[$name]:-}" ] || { record "$name" nan nan nan; return; }
    limit=(timeout "$torch_bf16_limit_s")
  fi
  local status=0
  env ${coretype:+OPENBLAS_CORETYPE=$coretype} "${policy[@]}" OMP_NUM_THREADS=$threads \
    "${limit[@]}" $python bench/e2e/llama_torch.py --dim "$dim" --n_layers "$layers" --n_heads "$heads" \
    --n_kv_heads "$heads" --seq_len "$seq" --batch "$batch" --steps "$steps" --threads "$threads" \
    "${moe_args[@]}" "$@" > "$work/$name.$round.json" || status=$?
  if [ "$status" = 124 ]; then
    not_competitive[$name]="over $torch_bf16_limit_s s for $steps steps; later rounds not run"
    record "$name" nan nan nan; return
  fi
  [ "$status" = 0 ] || { echo "PyTorch ($name) exited $status" >&2; exit 1; }
  record "$name" "$(sed -n 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/p' "$work/$name.$round.json")" nan nan
}

for round in $(seq "$runs"); do
  pytorch torch_fp32 passive
  titan3d t_fp32_1rank "$bin" --set train.precision=fp32 --set hardware.threads_per_rank="$threads" "$@"
  titan3d t_auto_1rank "$bin" --set train.precision=auto --set hardware.threads_per_rank="$threads" "$@"
  pytorch torch_bf16 passive --bf16
  pytorch torch_bf16_spin spin --bf16
  titan3d t_fp32_dp "$bin" --set train.precision=fp32 --set parallel.dp="$threads" --set hardware.threads_per_rank=1 "$@"
  titan3d t_auto_dp "$bin" --set train.precision=auto --set parallel.dp="$threads" --set hardware.threads_per_rank=1 "$@"
  [ "$experts" = 0 ] ||
    titan3d t_dense_active "$bin" --set train.precision=auto --set hardware.threads_per_rank="$threads" "$@"
  if [ -n "${BASELINE:-}" ]; then
    titan3d base_1rank "$BASELINE" --set train.precision="${BASELINE_PRECISION:-fp32}" --set hardware.threads_per_rank="$threads" "$@"
    titan3d base_dp "$BASELINE" --set train.precision="${BASELINE_PRECISION:-fp32}" --set parallel.dp="$threads" --set hardware.threads_per_rank=1 "$@"
  fi
  line="round $round:"
  for n in "${!tok[@]}"; do line+=" $n $(echo "${tok[$n]}" | awk '{ print $NF }')"; done
  echo "$line tok/s"
done

med() { printf '%s\n' $1 | median; }
echo
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p') (family $(lscpu | sed -n 's/^CPU family: *//p'), model $(lscpu | sed -n 's/^Model: *//p')), $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
sort -u "$work/peaks" | sed 's/^/titan3d: /'
echo "PyTorch: $(cat "$work/torch_fp32.1.json")"
for n in "${!not_competitive[@]}"; do echo "$n: not competitive (${not_competitive[$n]})"; done
echo "model: dim $dim, $layers layers, $heads heads, seq $seq, batch $batch, vocab 256, $threads threads; medians over $runs rounds"
[ "$experts" = 0 ] || echo "mixture of experts: $experts experts, $topk per token, expert ffn $moe_ffn (dense ffn of equal active parameters: $((topk * moe_ffn)))"
printf '%-42s %9s %8s %10s  %s\n' configuration tokens/s MFU mfu_gemm GEMM
names=(torch_fp32 torch_bf16 torch_bf16_spin t_fp32_1rank t_fp32_dp t_auto_1rank t_auto_dp)
[ -n "${BASELINE:-}" ] && names+=(base_1rank base_dp)
[ "$experts" = 0 ] || names+=(t_dense_active)
declare -A label=([torch_fp32]="PyTorch fp32, 1 × $threads threads" [torch_bf16]="PyTorch bf16 autocast, 1 × $threads threads"
  [torch_bf16_spin]="PyTorch bf16 autocast, spinning OpenMP"
  [t_fp32_1rank]="titan3d fp32, 1 rank × $threads threads" [t_fp32_dp]="titan3d fp32, dp=$threads × 1 thread"
  [t_auto_1rank]="titan3d auto, 1 rank × $threads threads" [t_auto_dp]="titan3d auto, dp=$threads × 1 thread"
  [base_1rank]="baseline ${BASELINE_PRECISION:-fp32}, 1 rank × $threads threads" [base_dp]="baseline ${BASELINE_PRECISION:-fp32}, dp=$threads × 1 thread"
  [t_dense_active]="titan3d dense, equal active params, auto")
pct() { awk -v m="$1" 'BEGIN { if (m == "nan") print "-"; else printf "%.1f%%", 100 * m }'; }
for n in "${names[@]}"; do
  printf "%-42s %9s %8s %10s  %s\n" "${label[$n]}" "$(awk -v t="$(med "${tok[$n]}")" 'BEGIN { if (t == "nan") print "-"; else printf "%.0f", t }')" \
    "$(pct "$(med "${mfu[$n]}")")" "$(pct "$(med "${gemm_mfu[$n]}")")" "${kind[$n]:-}"
done
awk -v pf="$(med "${tok[torch_fp32]}")" -v pb="$(med "${tok[torch_bf16]}")" \
    -v ps="$(med "${tok[torch_bf16_spin]}")" \
    -v a1="$(med "${tok[t_auto_1rank]}")" -v ad="$(med "${tok[t_auto_dp]}")" \
    -v f1="$(med "${tok[t_fp32_1rank]}")" -v fd="$(med "${tok[t_fp32_dp]}")" \
    -v m1="$(med "${mfu[t_auto_1rank]}")" -v md="$(med "${mfu[t_auto_dp]}")" 'BEGIN {
  p = pf; if (pb != "nan" && pb + 0 > p + 0) p = pb; if (ps != "nan" && ps + 0 > p + 0) p = ps; t = a1 > ad ? a1 : ad; m = a1 > ad ? m1 : md
  printf "titan3d best / PyTorch best:            %.2fx (target >= 1.3x)\n", t / p
  printf "titan3d best layout, MFU:                %.1f%% of the hardware peak (target >= 70%%)\n", 100 * m
  printf "1 rank x n threads / dp=n x 1 thread:    %.2fx auto, %.2fx fp32 (target >= 0.95x)\n", a1 / ad, f1 / fd
  printf "titan3d fp32 best / PyTorch fp32:        %.2fx\n", (f1 > fd ? f1 : fd) / pf }'
if [ "$experts" -gt 0 ]; then
  awk -v a="$(med "${tok[t_auto_1rank]}")" -v d="$(med "${tok[t_dense_active]}")" 'BEGIN {
    printf "titan3d MoE / dense of equal active params: %.2fx (1 rank, auto; target >= 0.8x)\n", a / d }'
fi
