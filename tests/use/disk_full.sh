#!/usr/bin/env bash
# A real full disk under every file a verb writes for the user: small tmpfs file systems (in a
# private mount namespace) sized so that the disk fills at different points (the first file, a
# later one). Every run must end with exit 0 and its files whole, or exit 2 saying the disk is
# full and leave nothing behind (no *.tmp, no half file, no half export or import). A training
# run whose run directory fills ends with exit 2 naming metrics.jsonl, on every rank; output to
# /dev/full (generate, tokenize --decode, eval on one rank or several) is exit 2 too.
# Skipped (exit 77) where this machine cannot mount a tmpfs.
set -u
source "$(dirname "$0")/../e2e/mount_ns.sh"
source "$(dirname "$0")/common.sh"

"$titan3d" train "${tiny[@]}" --set train.steps=2 --set train.val_every=0 --set snapshot.every=2 \
  --set run.dir="$work/run" >"$work/train.log" 2>&1
check "[ \$? -eq 0 ]" "train tiny" || cat "$work/train.log"
snap=$work/run/snapshots/step_00000002.h5
"$titan3d" export "$snap" --out "$work/hf" >/dev/null 2>&1
head -c 200000 "$corpus" >"$work/text.txt"
"$titan3d" tokenize "$work/text.txt" --tokenizer bytes --out "$work/t.bin" >/dev/null 2>&1

# leftovers DIR: what DIR holds besides the filler (nothing, after a failure).
leftovers() { find "$1" -mindepth 1 -not -name fill | sort | tr '\n' ' '; }
# on_disk WHAT KB DIR CHECK COMMAND...: runs COMMAND with DIR on a KB KiB tmpfs (0: a full one);
# exit 0 must pass CHECK (a shell condition), exit 2 must say the disk is full and leave DIR empty.
failed=0 succeeded=0
on_disk() {
  local what=$1 kb=$2 mnt=$3 ok=$4; shift 4
  full_tmpfs "$mnt" $((kb > 0 ? kb : 64)) || { echo "FAIL: mount of ${kb}k"; fail=1; return; }
  [ "$kb" -gt 0 ] || fill "$mnt"
  local out rc
  out=$(timeout 120 "$@" 2>&1); rc=$?
  echo "$out" >>"$work/messages.txt"
  if [ $rc -eq 0 ]; then
    succeeded=$((succeeded + 1))
    check "$ok" "$what, ${kb} KiB: exit 0, the output is whole" || echo "$out"
  else
    failed=$((failed + 1))
    check "[ $rc -eq 2 ] && grep -q 'No space left on device' <<<\"\$out\"" \
      "$what, ${kb} KiB: exit 2 saying the disk is full (rc $rc)" || echo "$out"
    check "[ -z \"\$(leftovers $mnt)\" ]" "$what, ${kb} KiB: nothing partial left" ||
      echo "  left: $(leftovers "$mnt")"
  fi
  umount "$mnt"
}

# export: model.safetensors, then config.json (sizes around the first: it or the second does
# not fit); the directory is the export's own.
st_kb=$(( ($(stat -c %s "$work/hf/model.safetensors") + 4095) / 4096 * 4 ))
for kb in 0 $((st_kb / 2)) $((st_kb - 4)) $st_kb $((st_kb + 4)) $((st_kb + 8)) $((st_kb + 64)); do
  on_disk "export" $kb "$work/x$kb" "cmp -s $work/x$kb/hf/model.safetensors $work/hf/model.safetensors && cmp -s $work/x$kb/hf/config.json $work/hf/config.json" \
    "$titan3d" export "$snap" --out "$work/x$kb/hf"
done
check "grep -q 'cannot write .*/config.json' $work/messages.txt" \
  "an export whose second file does not fit removes the first"
# import: the shard, then the index; the directory is the import's own.
for kb in 0 400 800 2048; do
  on_disk "import" $kb "$work/i$kb" "[ -s $work/i$kb/imp/step_00000000.h5 ]" \
    "$titan3d" import "$work/hf" --out "$work/i$kb/imp"
done
# tokenize: a token file (391 KiB), a trained tokenizer model, decoded text.
for kb in 0 200; do
  on_disk "tokenize --out" $kb "$work/t$kb" "cmp -s $work/t$kb/t.bin $work/t.bin" \
    "$titan3d" tokenize "$work/text.txt" --tokenizer bytes --out "$work/t$kb/t.bin"
  on_disk "tokenize --decode --out" $kb "$work/d$kb" "cmp -s $work/d$kb/d.txt $work/text.txt" \
    "$titan3d" tokenize "$work/t.bin" --decode --tokenizer bytes --out "$work/d$kb/d.txt"
done
on_disk "tokenize --vocab" 0 "$work/m0" "false" \
  "$titan3d" tokenize "$work/text.txt" --vocab 400 --tokenizer "$work/m0/m.model"
check "grep -q 'm.model. (--tokenizer)' $work/messages.txt" "a tokenizer model that does not fit names --tokenizer"
# eval --json: the result file, whole or absent.
on_disk "eval --json" 0 "$work/e0" "false" "$titan3d" eval "$snap" --json "$work/e0/e.json"

# whole_json_files DIR: no temporary in DIR, and every *.json file there parses.
whole_json_files() {
  [ -z "$(find "$1" -name '*.tmp')" ] || return 1
  local j
  for j in "$1"/*.json; do
    [ ! -e "$j" ] || /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$j" 2>/dev/null || return 1
  done
}
# Training with its run directory filling up: the metrics writer fails, and every rank ends with
# exit 2 naming the file (it used to end with exit 0 and no metrics); or, with room for the metrics,
# exit 0 with all 60 steps. Either way metrics.jsonl holds whole lines, and gemm_choice.json and
# summary.json are whole or absent (summary.json was left empty).
for run in "16 1" "24 1" "16 2" "32 1"; do
  set -- $run
  mnt=$work/r$1x$2
  full_tmpfs "$mnt" "$1"
  out=$(timeout 120 "$titan3d" train "${tiny[@]}" --set parallel.dp="$2" --set train.steps=60 \
        --set train.val_every=0 --set run.dir="$mnt/run" 2>&1); rc=$?
  what="train with a ${1} KiB run directory on $2 rank(s)"
  check "! grep -qi 'internal error' <<<\"\$out\" && { [ $rc -eq 2 ] && grep -q 'metrics file .*metrics.jsonl.*No space left' <<<\"\$out\" || { [ $rc -eq 0 ] && [ \$(grep -c '\"loss\"' $mnt/run/metrics.jsonl) -eq 60 ]; }; }" \
    "$what: exit 2 naming metrics.jsonl, or exit 0 with every step (rc $rc)" || echo "$out" | tail -5
  check "[ -f $mnt/run/metrics.jsonl ] && awk '!/^[{].*[}]\$/ { bad = 1 } END { exit bad }' $mnt/run/metrics.jsonl" \
    "$what: metrics.jsonl holds whole lines only" || tail -c 300 "$mnt/run/metrics.jsonl"
  check "whole_json_files $mnt/run" \
    "$what: every JSON file there is whole, no temporary left" || ls -la "$mnt/run"
  umount "$mnt"
done

# Standard output that cannot be written is an error, not a lost result.
out=$(timeout 60 "$titan3d" generate "$snap" --prompt "The " --max-tokens 20 2>&1 >/dev/full); rc=$?
check "[ $rc -eq 2 ] && grep -q 'standard output' <<<\"\$out\"" "generate >/dev/full: exit 2 (rc $rc)" || echo "$out"
out=$(timeout 60 "$titan3d" tokenize "$work/t.bin" --decode --tokenizer bytes 2>&1 >/dev/full); rc=$?
check "[ $rc -eq 2 ] && grep -q 'standard output' <<<\"\$out\"" "tokenize --decode >/dev/full: exit 2 (rc $rc)" || echo "$out"
# eval prints its result from rank 0 of the ranks it launches, through mpirun, which drops a
# failed write: the launcher relays that output and checks it. One rank and two, with --json.
out=$(timeout 60 "$titan3d" eval "$snap" 2>&1 >/dev/full); rc=$?
check "[ $rc -eq 2 ] && grep -q 'standard output' <<<\"\$out\"" "eval >/dev/full: exit 2 (rc $rc)" || echo "$out"
out=$(timeout 60 "$titan3d" eval "$snap" --set parallel.dp=2 --json "$work/e2.json" 2>&1 >/dev/full); rc=$?
check "[ $rc -eq 2 ] && grep -q 'standard output' <<<\"\$out\"" "eval on 2 ranks --json >/dev/full: exit 2 (rc $rc)" || echo "$out"
timeout 60 "$titan3d" eval "$snap" --set parallel.dp=2 2>"$work/closed.err" | true; rc=${PIPESTATUS[0]}
check "[ $rc -eq 2 ] && grep -q 'standard output failed: Broken pipe' $work/closed.err" \
  "eval on 2 ranks into a closed pipe: exit 2 (rc $rc)" || cat "$work/closed.err"

echo "runs that failed on a full disk: $failed; that fitted: $succeeded"
check "[ $failed -gt 0 ] && [ $succeeded -gt 0 ]" "the sweep saw both failed and whole outputs"
exit $fail
