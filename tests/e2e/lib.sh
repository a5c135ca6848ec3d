# Helpers for the end-to-end tests (sourced).
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
corpus=$repo/data/fortunes.txt
# make_work_dir: $work, a temporary directory removed when the script exits.
make_work_dir() {
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
}
require_corpus() {
  [ -s "$corpus" ] || { echo "FAIL: $corpus is missing: run scripts/get_data.sh (scripts/test.sh does)"; exit 1; }
}
# losses FILE: the per-step training losses of a metrics.jsonl, one per line.
losses() { sed -n 's/.*"loss": \([^,]*\),.*/\1/p' "$1"; }
# field FILE NAME: a metrics.jsonl field's value per step, one per line.
field() { sed -n "s/.*\"$2\": \\([^,}]*\\).*/\\1/p" "$1"; }
# guard_trace LOG: the functions of the backtrace a guarded run printed when something outside the
# ops touched device memory (T3D_GUARD_DEVICE_MEMORY=1, kernels/memory_guard.h), where addr2line is.
guard_trace() {
  command -v addr2line > /dev/null || return 0
  sed -n '/touched outside an op/,$p' "$1" | grep -o 'titan3d(+0x[0-9a-f]*)' | head -16 |
    sed 's/.*(+\(0x[0-9a-f]*\))/\1/' | xargs -r addr2line -f -C -e "$titan3d" | paste - - | cut -c1-160
}
# compare_losses A B RTOL [FIELD]: both files log as many steps, and every step's loss (or FIELD)
# agrees within RTOL relative; prints the worst.
compare_losses() {
  local na nb
  na=$(field "$1" "${4:-loss}" | wc -l) nb=$(field "$2" "${4:-loss}" | wc -l)
  [ "$na" -eq "$nb" ] || { echo "FAIL: $na steps in $1, $nb in $2"; return 1; }
  paste <(field "$1" "${4:-loss}") <(field "$2" "${4:-loss}") | awk -v rtol="$3" -v a="$1" -v b="$2" '
    { n++; d = ($1 - $2); if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > worst) worst = r;
      if (r > rtol) bad++ }
    END { if (n == 0) { print "FAIL: no losses in " a " or " b; exit 1 }
          printf "%d steps, worst relative difference %.2e (tolerance %g)\n", n, worst, rtol;
          exit bad > 0 }'
}
# counted_losses FILE: metrics.jsonl with each step once, the last line that logged it (a restart
# logs the steps after its snapshot again; the later line is the one that counts), in step order.
counted_losses() {
  sed -n 's/^{"step": \([0-9]*\), .*/\1 &/p' "$1" | awk '{ s = $1; sub(/^[0-9]+ /, ""); l[s] = $0 }
    END { for (s in l) print s, l[s] }' | sort -n | cut -d' ' -f2-
}
# Runs of a supervised job (restart.sh, lineage.sh): RUN names $work/RUN.
# final_losses METRICS: per step, the loss of the last line that logged it (a restart logs the
# steps after its snapshot again; the later line is the one that counts), "step loss" in order.
final_losses() {
  sed -n 's/^{"step": \([0-9]*\), "loss": \([^,]*\),.*/\1 \2/p' "$1" | awk '{ l[$1] = $2 } END { for (s in l) print s, l[s] }' | sort -n
}
last_step() { sed -n 's/^{"step": \([0-9]*\),.*/\1/p' "$1" 2>/dev/null | tail -1; }
wait_for_step() {  # wait_for_step RUN STEP: until its metrics.jsonl logs step >= STEP (60 s at most)
  local s
  for _ in $(seq 1 600); do
    s=$(last_step "$work/$1/metrics.jsonl"); [ -n "$s" ] && [ "$s" -ge "$2" ] && return 0
    sleep 0.1
  done
  return 1
}
rank_pid() { cut -d" " -f1 "$work/$1/pids/rank${2:-0}.pid" 2>/dev/null; }  # rank_pid RUN [RANK]
# run NAME [--set ...]: trains recipes/tiny.toml with the script's ${common[@]} and the settings
# given into $work/NAME (its output in $work/NAME.log); a failure ends the script.
run() {
  local name=$1; shift
  "$titan3d" train "$repo/recipes/tiny.toml" "${common[@]}" --set run.dir="$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { echo "FAIL: $name exited $?"; tail -20 "$work/$name.log"; exit 1; }
}
# The tiny mixture of experts of moe.sh and expert_parallel.sh, on top of tiny.toml: block 0
# dense, blocks 1-3 with 4 routed experts (2 per token) of width 32 and a shared expert, the
# selection bias and the auxiliary loss.
tiny_moe=(--set model.dim=64 --set model.n_layers=4 --set model.n_heads=4 --set model.n_kv_heads=2
          --set model.seq_len=32 --set train.global_batch=8 --set train.warmup_steps=5
          --set train.val_every=0 --set train.log_every=100000 --set hardware.hbm_gib=0.25
          --set run.log_level=warn --set model.n_experts=4 --set model.experts_per_token=2
          --set model.n_shared_experts=1 --set model.moe_ffn_dim=32 --set model.dense_layers=1
          --set model.router_bias_rate=1e-3 --set model.router_aux_coef=1e-2)
# check CONDITION MESSAGE: prints "ok: MESSAGE" or "FAIL: MESSAGE"; a failure sets fail=1 and
# returns 1, so that `check ... || show_why` prints what explains it.
fail=0
check() {
  if eval "$1"; then echo "ok: $2"; else echo "FAIL: $2"; fail=1; return 1; fi
}
# Supervised runs of $steps steps against the uninterrupted run $work/straight (restart.sh,
# memory_tier.sh). params_hash RUN: SHA-256 of its final snapshot's exported parameters.
params_hash() {
  "$titan3d" export "$work/$1/snapshots/step_$(printf %08d $steps).h5" --out "$work/$1.export" \
    > /dev/null 2>&1 && sha256sum < "$work/$1.export/model.safetensors" | cut -c1-16
}
same_as_straight() {  # same_as_straight RUN WHAT
  check "diff <(final_losses $work/straight/metrics.jsonl) <(final_losses $work/$1/metrics.jsonl) > /dev/null && [ \$(final_losses $work/$1/metrics.jsonl | wc -l) -eq $steps ]" \
    "$2: all $steps losses bit-identical to the uninterrupted run"
  check "h=\$(params_hash $1) && [ -n \"\$h\" ] && [ \"\$h\" = \"\$(params_hash straight)\" ]" \
    "$2: final parameters bit-identical"
}
# choose_bf16 [--set ...]: bf16=(...) the settings of a bf16 run of tiny.toml with those
# settings, and bf16_gemm the GEMM it runs: oneDNN's bf16 GEMMs, or where oneDNN cannot run
# them (no AVX-512) bf16 storage and traffic with OpenBLAS fp32 GEMMs, saying so.
choose_bf16() {
  bf16=(--set train.precision=bf16 --set hardware.gemm=onednn) bf16_gemm=onednn-bf16
  if ! "$titan3d" train "$repo/recipes/tiny.toml" "$@" --set train.steps=1 \
       --set run.dir="$work/probe_bf16" "${bf16[@]}" > "$work/probe_bf16.log" 2>&1; then
    grep -q "oneDNN cannot run" "$work/probe_bf16.log" ||
      { echo "FAIL: bf16 probe"; tail "$work/probe_bf16.log"; exit 1; }
    echo "NOTE: no bf16 GEMMs on this CPU: the bf16 runs below use fp32 GEMMs (bf16 storage)"
    bf16=(--set train.precision=bf16 --set hardware.gemm=openblas) bf16_gemm=openblas-fp32
  fi
}
