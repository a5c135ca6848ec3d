#!/usr/bin/env bash
# A real full disk under every file a verb writes for the user: small tmpfs file systems (in a
# private mount namespace) sized so that the disk fills at different points (the first file, a
# later one). Every run must end with exit 0 and its files whole, or exit 2 saying the disk is
# full and leave nothing behind (no *.tmp, no half file, no half export or import).
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
echo "runs that failed on a full disk: $failed; that fitted: $succeeded"
check "[ $failed -gt 0 ] && [ $succeeded -gt 0 ]" "the sweep saw both failed and whole outputs"
exit $fail
