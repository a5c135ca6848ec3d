#!/usr/bin/env bash
# data.path as a pattern of token-file shards (docs/data.md): the corpus's first 600,000 byte
# tokens cut into three files (llm.c version 1, nanoGPT raw uint16, llm.c version 1) train the
# tiny model to the same bits as the same tokens in one file, training and validation losses
# alike (the validation tail spans two shards), on 1 rank and on 2 (dp); a run
# resumed from the shards' snapshot continues bit for bit, and warns once a shard changed; eval --data takes the pattern and
# scores as the one file; a pattern that matches nothing is exit 2, naming the key.
set -u
titan3d=$1
source "$(dirname "$0")/lib.sh"
require_corpus
make_work_dir
python3 - "$corpus" "$work" <<'PY' || { echo "FAIL: writing the shards"; exit 1; }
import struct, sys
ids = open(sys.argv[1], "rb").read()[:600000]
def llmc(name, part):
    with open(f"{sys.argv[2]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(part), *([0] * 253)))
        f.write(struct.pack(f"<{len(part)}H", *part))
llmc("one.bin", ids)
llmc("shard_1.bin", ids[:250001])
with open(f"{sys.argv[2]}/shard_2.bin", "wb") as f:  # headerless: nanoGPT's layout
    f.write(struct.pack(f"<{580000 - 250001}H", *ids[250001:580000]))
llmc("shard_3.bin", ids[580000:])  # the validation tail starts in shard 2
PY
fail=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }
train() {  # train NAME DATA [--set ...]
  local name=$1 data=$2
  shift 2
  "$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$data" --set train.steps=8 \
    --set train.val_every=4 --set train.val_batches=2 --set hardware.gemm=openblas \
    --set run.dir="$work/$name" "$@" >"$work/$name.log" 2>&1 ||
    { bad "train $name exited $?"; tail -n 5 "$work/$name.log"; }
}
train one "$work/one.bin"
train shards "$work/shard_*.bin" --set snapshot.every=4
train one_dp2 "$work/one.bin" --set parallel.dp=2
train shards_dp2 "$work/shard_*.bin" --set parallel.dp=2
for field in loss val_loss; do
  for run in "" _dp2; do
    a=$(field "$work/one$run/metrics.jsonl" $field) b=$(field "$work/shards$run/metrics.jsonl" $field)
    if [ -n "$a" ] && [ "$a" = "$b" ]; then
      ok "shards$run: every step's $field equals the one file's, bit for bit"
    else
      bad "shards$run: $field differs from the one file's"; paste <(echo "$a") <(echo "$b") | head -n 4
    fi
  done
done
grep -q "570000 train tokens, 30000 validation" "$work/shards/logs/rank0.log" &&
  ok "the log counts the shards' tokens as one stream" ||
  bad "token counts: $(grep -o 'data: [^(]*' "$work/shards/logs/rank0.log")"
"$titan3d" resume "$work/shards/snapshots/step_00000004.h5" --set run.dir="$work/resumed" \
  >"$work/resumed.log" 2>&1 || { bad "resume exited $?"; tail -n 5 "$work/resumed.log"; }
if [ "$(field "$work/shards/metrics.jsonl" loss | tail -n 4)" = "$(field "$work/resumed/metrics.jsonl" loss)" ]; then
  ok "resumed from the shards' step-4 snapshot: steps 5-8 as the straight run"
else
  bad "the resumed run's losses differ"
fi
snap=$work/shards/snapshots/step_00000008.h5
e1=$("$titan3d" eval "$snap" --data "$work/one.bin" --batches 2 2>&1 | grep -o "loss [0-9.]*")
e2=$("$titan3d" eval "$snap" --data "$work/shard_*.bin" --batches 2 2>&1 | grep -o "loss [0-9.]*")
[ -n "$e1" ] && [ "$e1" = "$e2" ] && ok "eval --data PATTERN scores as the one file ($e2)" ||
  bad "eval: '$e1' (one file) vs '$e2' (pattern)"
# Another shard's content under the same names: the resume says the data changed.
cp "$work/shard_1.bin" "$work/shard_3.bin"
"$titan3d" resume "$work/shards/snapshots/step_00000004.h5" --set run.dir="$work/changed" \
  --set train.steps=5 >"$work/changed.log" 2>&1
grep -q "data.path \`$work/shard_\*.bin\` changed since" "$work/changed.log" &&
  ok "a resume over changed shards warns that the data changed" ||
  { bad "no warning for changed shards"; grep -i "warn" "$work/changed.log" | head -n 3; }
out=$("$titan3d" train "$repo/recipes/tiny.toml" --set data.path="$work/nothing_*.bin" \
      --set run.dir="$work/none" 2>&1); rc=$?
if [ $rc -eq 2 ] && grep -q "data.path\`: no file matches the pattern \`$work/nothing_\*.bin\`" <<<"$out"; then
  ok "a pattern matching nothing: exit 2, naming the key"
else
  bad "a pattern matching nothing: rc=$rc"; echo "$out" | tail -n 3
fi
exit $fail
