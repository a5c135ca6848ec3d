#!/usr/bin/env bash
# Snapshots at the sizes users train, one model per line (1 rank, fp32, vocab 32000):
#   bash bench/snapshot/bench_scale.sh [build/apps/titan3d] [snapshot dir] [sizes]
# sizes: any of 0.2b 0.5b 1b (default all three). For each model it measures
#  - ROUNDS (default 3) runs with a snapshot every 2 steps: write rate of each full snapshot (bytes
#    / write time of the slowest rank, from metrics.jsonl), the stall per snapshot, the step time of
#    the steps without one, and the stall as a share of step time at snapshot.every = 10 and 100;
#  - after each of those runs, the file system's sequential rate: dd of the same bytes as one full
#    snapshot into the snapshot directory, fsynced, through the page cache and with O_DIRECT, the
#    better of the two; write/seq is the median over the rounds of each run's ratio to it;
#  - and the same dd, both paths, while the same training runs without snapshots (seq_tr, the
#    better of the two; write/seq_tr as above): what the file system gives a writer that shares
#    the cores with training, as the snapshot writer does;
#  - peak host memory (max RSS of the rank) with snapshots and without (snapshot.every = 0);
#  - restore: resuming the snapshot before the last, the time rank 0's log gives for it ("resumed
#    from ... in T s": choosing, verifying and reading), and that the resumed run's first loss
#    equals the straight run's (bit for bit).
# STEPS (default 6) and EVERY (default 2) change the run. Prints the CPU and disk first.
# MEMORY=1 adds a second table per model, the memory tier (snapshot.memory_every) against the disk
# tier: a run with a memory snapshot every EVERY steps and no disk one (write and stall per memory
# snapshot, from metrics.jsonl), then for each tier a run killed with kill -9 of its rank once a
# snapshot of step 2·EVERY committed, restarted by the launcher: the restore time of the relaunch
# ("resumed from ... in T s") and the recovery time, from the kill to the first step the relaunch
# logs (backoff, launch, restore and that step), and whether the relaunch used the tier meant.
set -u
titan3d=$(realpath "${1:-build/apps/titan3d}")
snapdir=${2:-/tmp/t3d_bench_scale}
sizes=${3:-"0.2b 0.5b 1b"}
steps=${STEPS:-6} every=${EVERY:-2}
repo=$(cd "$(dirname "$0")/../.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
mkdir -p "$snapdir"
work=$(mktemp -d -p "$snapdir")
trap 'rm -rf "$work"' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; $(grep -c avx512f /proc/cpuinfo | head -1 | sed 's/^0$/no AVX-512/;s/^[1-9].*/AVX-512/')"
echo "disk: $(df -h "$snapdir" | awk 'NR == 2 { print $1, $2 }') ($(findmnt -no FSTYPE -T "$snapdir")); memory $(free -g | awk '/Mem:/ { print $2 }') GiB"

model_args() {  # size -> --set for [model] and the arena
  case $1 in
    0.2b) echo "--set model.dim=1024 --set model.n_layers=8 --set model.n_heads=16 --set hardware.hbm_gib=4" ;;
    0.5b) echo "--set model.dim=1536 --set model.n_layers=12 --set model.n_heads=16 --set hardware.hbm_gib=9" ;;
    1b) echo "--set model.dim=2048 --set model.n_layers=16 --set model.n_heads=16 --set hardware.hbm_gib=17" ;;
  esac
}
median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
field() { sed -n "s/.*\"$1\": \\([0-9.e+-]*\\).*/\\1/p"; }
max_rss_gib() { sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$1" | sort -n | tail -1 | awk '{ printf "%.2f", $1 / 2^20 }'; }

printf '%-5s %7s %9s %9s %7s %9s %9s %11s %9s %9s %8s %8s %9s %9s %9s %9s\n' model params state_GB seq_MB/s write full/seq seq_tr full/seq_tr stall_s step_s "%@10" "%@100" rss_snap rss_none restore_s resumed
for size in $sizes; do
  base=(train "$repo/recipes/tiny.toml" $(model_args "$size") --set model.vocab_size=32000
        --set model.seq_len=128 --set train.global_batch=2 --set train.steps=$steps
        --set train.warmup_steps=1 --set train.val_every=0 --set data.path="$repo/data/fortunes.txt"
        --set hardware.gemm=openblas --set train.precision=fp32 --set run.max_restarts=0
        --set run.log_level=info)
  # ROUNDS runs with snapshots, each followed by the file system's sequential rate for the same
  # bytes: dd with fdatasync through the page cache (bs=64M) and with O_DIRECT (bs=8M), the better
  # of the two (which one wins swings with the CPU load: the page-cache copy needs a core).
  # write/seq is the median of the rounds' ratios, each against the rate measured right after it.
  dd_rate() {  # dd's "copied, T s, R MB/s" in MB/s
    dd if=/dev/zero of="$work/dd.bin" "$@" conv=fdatasync 2>&1 |
      sed -n 's/.* s, \([0-9.]*\) \([GM]B\)\/s/\1 \2/p' | awk '{ print ($2 == "GB") ? $1 * 1000 : $1 }'
    rm -f "$work/dd.bin"
  }
  # seq_beside_training: dd_rate's both paths while the same model trains without snapshots
  # (started in a session of its own, ended with SIGKILL once dd is done), the better of the two.
  seq_beside_training() {  # BYTES -> "page-cache direct better" in MB/s
    local dir=$work/$size.beside pid b d
    rm -rf "$dir"
    setsid "$titan3d" "${base[@]}" --set train.steps=100000 --set snapshot.every=0 \
      --set run.dir="$dir" > "$dir.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 1200); do grep -qs '"step": 2,' "$dir/metrics.jsonl" && break; sleep 0.25; done
    b=$(dd_rate bs=64M count=$(( ($1 + 67108863) / 67108864 )))
    d=$(dd_rate bs=8M count=$(( ($1 + 8388607) / 8388608 )) oflag=direct)
    kill -KILL -- -"$pid" 2> /dev/null; wait "$pid" 2> /dev/null
    rm -rf "$dir"
    echo "$b ${d:-0} $(awk -v a="$b" -v b="${d:-0}" 'BEGIN { print (a > b) ? a : b }')"
  }
  rounds=${ROUNDS:-3} writes=() seqs=() ratios=() stalls=() steps=() seqs_tr=() ratios_tr=()
  for ((round = 1; round <= rounds; ++round)); do
    rm -rf "$work/$size"
    /usr/bin/time -v "$titan3d" "${base[@]}" --set snapshot.every=$every --set snapshot.keep=2 \
      --set run.dir="$work/$size" > "$work/$size.log" 2>&1 || { echo "$size: training failed"; tail -5 "$work/$size.log"; continue 2; }
    m=$work/$size/metrics.jsonl
    bytes=$(grep '"snapshot_ok": 1' "$m" | head -1 | field snapshot_raw_bytes)
    buffered=$(dd_rate bs=64M count=$(( (${bytes%.*} + 67108863) / 67108864 )))
    direct=$(dd_rate bs=8M count=$(( (${bytes%.*} + 8388607) / 8388608 )) oflag=direct)
    seq=$(awk -v a="$buffered" -v b="${direct:-0}" 'BEGIN { print (a > b) ? a : b }')
    read -r buffered_tr direct_tr seq_tr <<< "$(seq_beside_training "${bytes%.*}")"
    # Full snapshots: write rate (median), stall (every one); step time of steps without a snapshot.
    write=$(grep '"snapshot_ok": 1' "$m" | grep '"snapshot_incremental": 0' |
            awk '{ match($0, /"snapshot_bytes": [0-9.e+]+/); b = substr($0, RSTART + 18, RLENGTH - 18); match($0, /"snapshot_write_s": [0-9.e+-]+/); w = substr($0, RSTART + 20, RLENGTH - 20); print b / w / 1e6 }' | median)
    writes+=("$write") seqs+=("$seq") ratios+=("$(awk -v w="$write" -v s="$seq" 'BEGIN { print w / s }')")
    seqs_tr+=("$seq_tr") ratios_tr+=("$(awk -v w="$write" -v s="$seq_tr" 'BEGIN { print w / s }')")
    stalls+=($(grep '"snapshot_ok": 1' "$m" | field snapshot_stall_s))
    steps+=($(grep '"loss"' "$m" | awk -v e=$every '{ match($0, /"step": [0-9]+/); s = substr($0, RSTART + 8, RLENGTH - 8) + 0; match($0, /"step_time_s": [0-9.e+-]+/); t = substr($0, RSTART + 15, RLENGTH - 15); if (s > 1 && (s - 1) % e != 0) print t }'))
    echo "      round $round: write $(printf %.0f "$write") MB/s; dd $buffered MB/s through the page cache, ${direct:-refused} with O_DIRECT; beside training $buffered_tr and $direct_tr; load $(cut -d' ' -f1 /proc/loadavg)" >> "$work/rounds.txt"
  done
  write=$(printf '%s\n' "${writes[@]}" | median) seq=$(printf '%s\n' "${seqs[@]}" | median)
  ratio=$(printf '%s\n' "${ratios[@]}" | median)
  seq_tr=$(printf '%s\n' "${seqs_tr[@]}" | median) ratio_tr=$(printf '%s\n' "${ratios_tr[@]}" | median)
  stall=$(printf '%s\n' "${stalls[@]}" | median) step=$(printf '%s\n' "${steps[@]}" | median)
  /usr/bin/time -v "$titan3d" "${base[@]}" --set snapshot.every=0 --set run.dir="$work/$size.none" \
    > "$work/$size.none.log" 2>&1
  params=$(sed -n 's/.*model: .*; \([0-9.]*\) M parameters in all.*/\1/p' "$work/$size.log" | head -1)
  state=$(sed -n 's/.*memory bytes: params \([0-9]*\) grads \([0-9]*\) optimizer \([0-9]*\) .*/\1 \2 \3/p' "$work/$size.log" | head -1 | awk '{ printf "%.2f", ($1 + $2 + $3) / 1e9 }')
  # Restore: resume the snapshot before the last one and run to the end.
  last=$(ls "$work/$size/snapshots" | sed -n 's/^step_\([0-9]*\)\.h5$/\1/p' | sort -n | tail -2 | head -1)
  "$titan3d" resume "$work/$size/snapshots/step_$last.h5" \
    --set run.dir="$work/$size.r" --set run.log_level=info > "$work/$size.r.log" 2>&1
  restore=$(sed -n 's/.*resumed from .* in \([0-9.]*\) s$/\1/p' "$work/$size.r/logs/rank0.log" | head -1)
  want=$(grep "\"step\": $((10#$last + 1))," "$m" | field loss)
  got=$(grep "\"step\": $((10#$last + 1))," "$work/$size.r/metrics.jsonl" | field loss)
  same=$([ -n "$want" ] && [ "$want" = "$got" ] && echo bit-exact || echo "DIFFERS ($want vs $got)")
  [ -n "$want" ] || same="(no step $((10#$last + 1)) in the straight run)"
  printf '%-5s %6sM %9s %9.0f %7.0f %9.2f %9.0f %11.2f %9.2f %9.2f %8.2f %8.3f %9s %9s %9s %9s\n' "$size" "$params" "$state" \
    "$seq" "$write" "$ratio" "$seq_tr" "$ratio_tr" "$stall" "$step" \
    "$(awk -v a="$stall" -v s="$step" 'BEGIN { print 100 * a / (10 * s) }')" \
    "$(awk -v a="$stall" -v s="$step" 'BEGIN { print 100 * a / (100 * s) }')" \
    "$(max_rss_gib "$work/$size.log")" "$(max_rss_gib "$work/$size.none.log")" "$restore" "$same"
  grep -o 'snapshot step [0-9]* ([^)]*)[^;]*; stall [^,]*,[^>]*' "$work/$size.log" | sed 's/^/      /' | cut -c1-220
  cat "$work/rounds.txt" && rm -f "$work/rounds.txt"
  rm -rf "$work/$size" "$work/$size.none" "$work/$size.r"
done

[ "${MEMORY:-0}" = 1 ] || exit 0
echo
echo "memory tier vs disk tier (kill -9 of the rank after the snapshot of step $((2 * every)) committed):"
printf '%-5s %12s %12s %12s %12s %12s %12s\n' model mem_write_s mem_stall_s restore_mem restore_disk recover_mem recover_disk
# killed_run SIZE TIER ARGS...: kill -9 of the rank once TIER's snapshot of step 2*EVERY committed;
# prints "restore_s recovery_s tier_used".
killed_run() {
  local size=$1 tier=$2 dir=$work/$1.$2; shift 2
  local want=$((2 * every)) key
  [ "$tier" = memory ] && key=memory_snapshot_step || key=snapshot_step
  "$titan3d" "${base[@]}" "$@" --set train.steps=$((2 * every + 2)) --set run.max_restarts=1 \
    --set run.dir="$dir" > "$dir.log" 2>&1 &
  local job=$! t_kill
  until grep -q "\"$key\": $want," "$dir/metrics.jsonl" 2> /dev/null; do sleep 0.05; done
  kill -KILL "$(cat "$dir/pids/rank0.pid")"
  t_kill=$(date +%s.%N)
  local lines
  lines=$(grep -c . "$dir/metrics.jsonl")
  # The first step the relaunch logs: a "step" line past those before the kill.
  until [ "$(sed -n "$((lines + 1)),\$ p" "$dir/metrics.jsonl" 2> /dev/null | grep -c '^{"step"')" -gt 0 ]; do sleep 0.05; done
  local t_step
  t_step=$(date +%s.%N)
  wait $job
  local restore used
  restore=$(sed -n 's/.*resumed from .* in \([0-9.]*\) s.*/\1/p' "$dir/logs/rank0.log" | tail -1)
  used=$(sed -n 's/.*"event": "restore", "tier": "\([a-z]*\)".*/\1/p' "$dir/incidents.jsonl" | tail -1)
  echo "$restore $(awk -v a="$t_kill" -v b="$t_step" 'BEGIN { printf "%.1f", b - a }') ${used:-disk}"
  rm -rf "$dir"
}
for size in $sizes; do
  base=(train "$repo/recipes/tiny.toml" $(model_args "$size") --set model.vocab_size=32000
        --set model.seq_len=128 --set train.global_batch=2 --set train.warmup_steps=1
        --set train.val_every=0 --set data.path="$repo/data/fortunes.txt"
        --set hardware.gemm=openblas --set train.precision=fp32 --set run.log_level=info)
  "$titan3d" "${base[@]}" --set train.steps=$steps --set snapshot.every=0 \
    --set snapshot.memory_every=$every --set run.max_restarts=0 --set run.dir="$work/$size.mem" \
    > "$work/$size.mem.log" 2>&1 || { echo "$size: memory-tier run failed"; tail -5 "$work/$size.mem.log"; continue; }
  m=$work/$size.mem/metrics.jsonl
  mw=$(grep '"memory_snapshot_ok": 1' "$m" | field memory_snapshot_write_s | median)
  ms=$(grep '"memory_snapshot_ok": 1' "$m" | field memory_snapshot_stall_s | median)
  rm -rf "$work/$size.mem"
  read -r rm_ rc_m um < <(killed_run "$size" memory --set snapshot.every=1000 --set snapshot.memory_every=$every)
  read -r rd_ rc_d ud < <(killed_run "$size" disk --set snapshot.every=$every)
  printf '%-5s %12.2f %12.2f %12s %12s %12s %12s\n' "$size" "$mw" "$ms" "$rm_ ($um)" "$rd_ ($ud)" "$rc_m" "$rc_d"
done
