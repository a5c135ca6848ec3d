#!/usr/bin/env bash
# Snapshot integrity end to end (docs/snapshot-format.md, "Integrity guarantees"): a damaged or
# edited index is refused as bytes by every verb before HDF5 parses it; `latest` falls back past
# it, and refuses (exit 2) when every snapshot is damaged; ranks restore the one snapshot rank 0
# resolved; a second live job in a run directory is refused and a dead one's lock taken over; an
# unwritable snapshot.dir stops the run at start; string values with control characters, and
# snapshot paths with TOML syntax in them, resume; eval refuses a --set that changes the model.
set -u
source "$(dirname "$0")/common.sh"
tiny=(--set model.dim=64 --set model.n_layers=2 --set model.n_heads=4 --set model.n_kv_heads=2
      --set model.seq_len=32)
one=(--set parallel.pp=1 --set parallel.dp=1 --set parallel.tp=1)
base=(train "$recipe" "${common[@]}" "${tiny[@]}" "${one[@]}" --set train.steps=4
      --set snapshot.every=2 --set snapshot.full_every=1)
T=60  # seconds any one command may take

timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/good" >"$work/good.log" 2>&1
check "[ -f $work/good/snapshots/step_00000002.h5 ] && [ -f $work/good/snapshots/step_00000004.h5 ]" \
  "a good run leaves snapshots 2 and 4" || cat "$work/good.log"
copy() { rm -rf "$work/$1"; cp -r "$work/good" "$work/$1"; }
# flip FILE OFFSET: xor one bit of the byte at OFFSET.
flip() {
  local byte
  byte=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "$(printf '\\%03o' $(( byte ^ 0x04 )))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

# --- A damaged index: every verb refuses it as bytes, `latest` falls back to step 2. ---
copy flipped
idx=$work/flipped/snapshots/step_00000004.h5
flip "$idx" $(( $(stat -c %s "$idx") / 3 ))
out=$(timeout $T "$titan3d" resume "$idx" "${common[@]}" --set run.dir="$work/flipped.r" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'index .*step_00000004.h5. is damaged: its hash' <<<\"\$out\"" \
  "resume of a flipped index: exit 2 naming the index (rc $rc)" || echo "$out"
out=$(timeout $T "$titan3d" eval "$idx" "${common[@]}" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'step_00000004.h5. is damaged' <<<\"\$out\"" "eval refuses it (rc $rc)" || echo "$out"
out=$(timeout $T "$titan3d" export "$idx" --out "$work/hf" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'step_00000004.h5. is damaged' <<<\"\$out\" && [ ! -e $work/hf/model.safetensors ]" \
  "export refuses it (rc $rc)" || echo "$out"
out=$(timeout $T "$titan3d" generate "$idx" --prompt "The " --max-tokens 4 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'step_00000004.h5. is damaged' <<<\"\$out\"" "generate refuses it (rc $rc)" || echo "$out"
out=$(timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/flipped" --set snapshot.resume=latest \
      --set train.steps=6 --set run.log_level=info 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q 'skipping step_00000004.h5: .*is damaged' <<<\"\$out\" && grep -q 'resumed from .*step_00000002.h5 after step 2' <<<\"\$out\"" \
  "latest skips the damaged index, naming it, and resumes step 2 (rc $rc)" || echo "$out"

# An index without the trailer (cut off, or from a titan3d without index checksums): refused.
copy old
idx=$work/old/snapshots/step_00000004.h5
truncate -s -24 "$idx"
out=$(timeout $T "$titan3d" eval "$idx" "${common[@]}" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'step_00000004.h5. has no integrity trailer' <<<\"\$out\"" \
  "an index without its trailer is refused (rc $rc)" || echo "$out"

# The state counters are covered: an index whose /state@step says 1 instead of 4 is refused.
copy edited
idx=$work/edited/snapshots/step_00000004.h5
# /state@step is an int64 4 stored after the attribute's name; make it 1, as an editor would.
python3 - "$idx" <<'PY'
import sys
b = bytearray(open(sys.argv[1], 'rb').read())
at = b.rindex(b'\x08\x00step\x00')  # the last `step` attribute: /state's
four = (4).to_bytes(8, 'little')
v = b.index(four, at)
b[v] = 1
open(sys.argv[1], 'wb').write(b)
PY
check "h5dump -a /state/step $idx | grep -q '(0): 1'" "the edit changed /state@step to 1" || h5dump -a /state/step "$idx"
out=$(timeout $T "$titan3d" resume "$idx" "${common[@]}" --set run.dir="$work/edited.r" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'is damaged: its hash' <<<\"\$out\"" \
  "an index with an edited counter is refused (rc $rc)" || echo "$out"

# Every snapshot damaged: `latest` says so and exits 2, it does not start from scratch.
copy alldamaged
for s in 2 4; do flip "$work/alldamaged/snapshots/step_0000000$s.h5" 100; done
out=$(timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/alldamaged" --set snapshot.resume=latest 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'none of the 2 snapshot(s) in .* can be restored' <<<\"\$out\" && [ \$(grep -c '\"loss\"' $work/alldamaged/metrics.jsonl) -eq 4 ]" \
  "latest with every snapshot damaged: exit 2, no training (rc $rc)" || echo "$out"

# --- Ranks restore what rank 0 resolved. Rank 0's listing misses snapshot 4 (a stale cache, as
# T3D_TEST_STALE_LISTING simulates): every rank restores step 2, none step 4; the losses continue
# the straight run's exactly. Resolved per rank (the old code), rank 1 would restore step 4.
two=(train "$recipe" "${common[@]}" "${tiny[@]}" --set parallel.pp=1 --set parallel.dp=2
     --set parallel.tp=1 --set snapshot.every=2 --set snapshot.full_every=1)
timeout $T "$titan3d" "${two[@]}" --set train.steps=6 --set run.dir="$work/straight" >/dev/null 2>&1
timeout $T "$titan3d" "${two[@]}" --set train.steps=4 --set run.dir="$work/agree" >/dev/null 2>&1
rm -f "$work/agree/metrics.jsonl"
out=$(T3D_TEST_STALE_LISTING=0 timeout $T "$titan3d" "${two[@]}" --set train.steps=6 \
      --set run.dir="$work/agree" --set snapshot.resume=latest --set run.log_level=info 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q 'after step 2' $work/agree/logs/rank0.log && grep -q 'after step 2' $work/agree/logs/rank1.log && ! grep -q 'after step 4' $work/agree/logs/rank1.log" \
  "both ranks restore step 2, the snapshot rank 0 resolved (rc $rc)" || { echo "$out"; tail -3 $work/agree/logs/rank1.log; }
check "diff <(losses_from $work/straight/metrics.jsonl 3) <(losses $work/agree/metrics.jsonl) >/dev/null" \
  "the resumed losses are the straight run's" || diff <(losses_from $work/straight/metrics.jsonl 3) <(losses $work/agree/metrics.jsonl)

# --- One live job per run directory. ---
timeout $T "$titan3d" "${base[@]}" --set train.steps=100000 --set snapshot.every=0 \
  --set run.dir="$work/locked" --set run.log_level=info >/dev/null 2>&1 &
first=$!
for _ in $(seq 1 300); do grep -qs 'communicators verified' "$work/locked/logs/rank0.log" && break; sleep 0.1; done
holder=$(sed -n 's/^pid=//p' "$work/locked/lock" 2>/dev/null)
out=$(timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/locked" 2>&1); rc=$?
check "[ -n \"$holder\" ] && [ $rc -eq 2 ] && grep -q \"is in use by another titan3d job (host $(hostname), pid $holder\" <<<\"\$out\"" \
  "a second train into a live job's run directory is refused, naming the holder (rc $rc)" || echo "$out"
check "grep -q 'communicators verified' $work/locked/logs/rank0.log" \
  "the refused job left the holder's log alone"
# The holder and its launcher die without removing the lock (the launcher, frozen first, cannot
# release it as it does after its job ended): the next job takes it over with a warning.
pkill -STOP -P "$first"; kill -KILL "$holder" 2>/dev/null; pkill -KILL -P "$first"; wait "$first" 2>/dev/null
out=$(timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/locked" --set run.log_level=warn 2>&1); rc=$?
check "[ $rc -eq 0 ] && grep -q 'taking over the lock of a job that is gone (host $(hostname), pid $holder' <<<\"\$out\" && [ ! -e $work/locked/lock ]" \
  "a dead job's lock is taken over with a warning, and released at exit (rc $rc)" || echo "$out"

# --- snapshot.dir that can never be written: exit 2 at start, naming the key. ---
touch "$work/afile"
out=$(timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/nodir" --set snapshot.dir="$work/afile/snaps" 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshot.dir.: cannot write into' <<<\"\$out\" && ! grep -q '\"loss\"' $work/nodir/metrics.jsonl 2>/dev/null" \
  "an unwritable snapshot.dir stops the run before training (rc $rc)" || echo "$out"
out=$(timeout $T "$titan3d" "${base[@]}" --set run.dir="$work/procdir" --set snapshot.dir=/proc/t3d_snaps 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'snapshot.dir.: cannot write into ./proc/t3d_snaps' <<<\"\$out\"" \
  "snapshot.dir under /proc: exit 2 naming the key (rc $rc)" || echo "$out"

# --- A control character in a string value, and a path with TOML syntax in it, resume. ---
weird="$work/it's \"q\" #x"
timeout $T "$titan3d" "${base[@]}" --set 'run.name="a\nb\u0001c"' --set run.dir="$weird" >/dev/null 2>&1
out=$(timeout $T "$titan3d" resume "$weird/snapshots/step_00000004.h5" "${common[@]}" \
      --set train.steps=5 --set run.dir="$work/weird.r" 2>&1); rc=$?
check "[ $rc -eq 0 ] && [ \$(grep -c '\"loss\"' $work/weird.r/metrics.jsonl) -eq 1 ]" \
  "a snapshot with a newline in run.name, under a path with ' \" #, resumes (rc $rc)" || echo "$out"

# --- eval refuses a model that differs from the snapshot's, as resume does. ---
out=$(timeout $T "$titan3d" eval "$work/good/snapshots/step_00000004.h5" "${common[@]}" \
      --set model.n_layers=1 2>&1); rc=$?
check "[ $rc -eq 2 ] && grep -q 'cannot evaluate .*step_00000004.h5.: model.n_layers is 2 in the snapshot but 1' <<<\"\$out\"" \
  "eval --set model.n_layers=1 on a 2-layer snapshot is refused (rc $rc)" || echo "$out"
exit $fail
