#!/usr/bin/env bash
# Single-bit flips over a snapshot's index and a shard (fixed pseudo-random positions, so a
# failure reproduces): each damaged copy is read by `generate` (one process) and, for every
# fourth flip, by `train` with snapshot.resume = latest. Every run must end within its time limit
# with exit 2 naming the damaged file, or with exit 0 and exactly the undamaged result (`latest`:
# falling back to the good step-2 snapshot): no crash, no hang, no silent wrong result.
set -u
source "$(dirname "$0")/common.sh"
tiny=(--set model.dim=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=2
      --set model.seq_len=16 --set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1)
base=(train "$recipe" "${common[@]}" "${tiny[@]}" --set snapshot.every=2 --set snapshot.full_every=1)
T=30  # seconds per run
gen=(--prompt "Line 1" --max-tokens 8)

timeout $T "$titan3d" "${base[@]}" --set train.steps=4 --set run.dir="$work/good" >/dev/null 2>&1
idx=step_00000004.h5 shard=step_00000004/rank00000.h5
check "[ -f $work/good/snapshots/$shard ]" "a good run leaves snapshots 2 and 4" || exit 1
ref=$(timeout $T "$titan3d" generate "$work/good/snapshots/$idx" "${gen[@]}" 2>/dev/null)
check "[ \${#ref} -gt 6 ]" "the undamaged snapshot generates text" || exit 1
# The straight run's losses after step 2: what a fallback to snapshot 2 must reproduce.
timeout $T "$titan3d" "${base[@]}" --set train.steps=6 --set run.dir="$work/straight" >/dev/null 2>&1

seed=12345
next() { seed=$(( (seed * 1103515245 + 12345) % 2147483648 )); }
n=0
for file in $idx $shard; do
  size=$(stat -c %s "$work/good/snapshots/$file")
  for i in $(seq 1 16); do
    next; off=$(( (seed >> 4) % size )); next; bit=$(( (seed >> 16) % 8 ))  # high bits: an LCG's low ones cycle
    n=$((n + 1))
    rm -rf "$work/d" && cp -r "$work/good" "$work/d"
    f=$work/d/snapshots/$file
    byte=$(od -An -tu1 -j $off -N1 "$f" | tr -d ' ')
    printf "$(printf '\\%03o' $(( byte ^ (1 << bit) )))" | dd of="$f" bs=1 seek=$off conv=notrunc status=none
    what="$file byte $off bit $bit"
    out=$(timeout $T "$titan3d" generate "$work/d/snapshots/$idx" "${gen[@]}" 2>&1); rc=$?
    if [ $rc -eq 0 ]; then
      check "[ \"\$out\" = \"\$ref\" ]" "$what: generate exit 0 with the undamaged text" || echo "$out"
    else
      check "[ $rc -eq 2 ] && grep -q \"$(basename "$file")\" <<<\"\$out\"" \
        "$what: generate exit $rc (2, naming the file)" || echo "$out"
    fi
    if [ $((n % 4)) -eq 0 ]; then
      rm -f "$work/d/metrics.jsonl"
      out=$(timeout $T "$titan3d" "${base[@]}" --set train.steps=6 --set run.dir="$work/d" \
            --set snapshot.resume=latest --set run.log_level=info 2>&1); rc=$?
      resumed=$(grep -o 'after step [0-9]*' <<<"$out" | head -1 | grep -o '[0-9]*$')
      check "[ $rc -eq 0 ] && [ -n \"$resumed\" ] && diff <(losses_from $work/straight/metrics.jsonl $((resumed + 1))) <(losses $work/d/metrics.jsonl) >/dev/null" \
        "$what: resume = latest exit $rc from step ${resumed:-?}, continuing the straight run's losses" || echo "$out"
    fi
  done
done
exit $fail
