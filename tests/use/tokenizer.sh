#!/usr/bin/env bash
# Subword tokenizers end to end (docs/tokenizers-and-import.md), on the default corpus:
#  - `titan3d tokenize` trains a 512-id BPE model; encode then --decode gives the corpus back byte
#    for byte; Python SentencePiece (python3-sentencepiece) encodes the corpus as titan3d did;
#  - a tiny model trained on text read through it (data.tokenizer) has falling loss; eval equals
#    its logged validation loss; generate prints text; export writes the tokenizer beside the
#    weights (tokenizer.model identical, tokenizer_config.json), which import takes back;
#  - data.bos: export writes add_bos_token as the run read text, import takes it back (true when
#    tokenizer_config.json is absent, LlamaTokenizer's default); generate then starts the prompt
#    with <s>, and export of that import says add_bos_token true;
#  - byte-level BPE (a Llama-3-style tokenizer.json from tests/data/fixtures/bpe): the corpus
#    encodes and decodes back byte for byte, a tiny model trains on text read through it, export
#    writes the same tokenizer.json (PreTrainedTokenizerFast), import takes it back, and eval of the
#    import equals the original's;
#  - a vocabulary too small for the tokenizer, a missing model file, a snapshot read with
#    another tokenizer (or a changed file), and data.bos with the byte tokenizer are exit 2,
#    naming the keys.
set -u
source "$(dirname "$0")/common.sh"
py=/usr/bin/python3
tok=$work/f512.model

"$titan3d" tokenize "$corpus" --vocab 512 --tokenizer "$tok" --out "$work/f512.bin" >"$work/tok.log" 2>&1
check "[ \$? -eq 0 ] && [ -s $tok ] && [ -s $work/f512.bin ]" "tokenize trains a 512-id BPE and encodes the corpus" \
  || cat "$work/tok.log"
sed 's/^/  /' "$work/tok.log"
"$titan3d" tokenize "$work/f512.bin" --decode --tokenizer "$tok" --out "$work/back.txt" >/dev/null 2>&1
check "cmp -s $work/back.txt $corpus" "decode(encode(corpus)) is the corpus, byte for byte"
check "[ \$(stat -c %s $work/f512.bin) -lt \$((1024 + 2 * \$(stat -c %s $corpus) * 3 / 4)) ]" \
  "BPE tokens are fewer than 3/4 of the bytes"
"$py" "$(dirname "$0")/sentencepiece_check.py" "$tok" "$corpus" "$work/f512.bin" >"$work/py.log" 2>&1
check "[ \$? -eq 0 ]" "Python SentencePiece encodes the corpus as titan3d did" ; sed 's/^/  /' "$work/py.log"

# A tiny model on the corpus read through the tokenizer (text, not the .bin: data.tokenizer).
# Pinned to the GEMM that eval of an import runs (openblas-fp32), so that the import's eval can
# equal the original's bit for bit whatever this machine's measurement would choose.
bpe=("${tiny[@]}" --set hardware.gemm=openblas --set model.vocab_size=512 --set "data.tokenizer=\"$tok\"")
"$titan3d" train "${bpe[@]}" --set train.steps=40 --set train.val_every=40 --set snapshot.every=40 \
  --set run.dir="$work/run" >"$work/train.log" 2>&1
check "[ \$? -eq 0 ]" "train tiny on BPE tokens" || cat "$work/train.log"
m=$work/run/metrics.jsonl
first=$(head -1 "$m" | sed -E 's/.*"loss": ([^,]+),.*/\1/'); last=$(grep '"loss"' "$m" | tail -1 | sed -E 's/.*"loss": ([^,]+),.*/\1/')
check "awk -v a=$first -v b=$last 'BEGIN { exit !(b < a - 0.8) }'" "loss falls by more than 0.8 nats ($first -> $last)"
snap=$work/run/snapshots/step_00000040.h5
"$titan3d" eval "$snap" --json "$work/e.json" >"$work/e.log" 2>&1
check "[ \$? -eq 0 ] && rel_close \$(json_loss $work/e.json) \$(val_loss $m 40) 5e-9" \
  "eval equals the trainer's val_loss at step 40" || cat "$work/e.log"
"$titan3d" generate "$snap" --prompt "The " --max-tokens 30 --seed 5 >"$work/g.txt" 2>"$work/g.err"
check "[ \$? -eq 0 ] && [ \$(head -c 4 $work/g.txt) = The ] && tail -c +5 $work/g.txt | grep -q '[a-z]'" \
  "generate prints the prompt and decoded text" || cat "$work/g.err"
echo "  sampled: $(tr '\n' '|' <"$work/g.txt")"
"$titan3d" export "$snap" --out "$work/hf" >"$work/x.log" 2>&1
check "[ \$? -eq 0 ] && cmp -s $work/hf/tokenizer.model $tok && grep -q LlamaTokenizer $work/hf/tokenizer_config.json && grep -q '\"bos_token_id\": 1' $work/hf/config.json" \
  "export writes tokenizer.model (the same bytes) and tokenizer_config.json" || cat "$work/x.log"

# The export imported back: its tokenizer.model becomes data.tokenizer (copied beside the
# snapshot), so eval of the import reads the same validation ids and gives the same loss.
"$titan3d" import "$work/hf" --out "$work/imp" >"$work/i.log" 2>&1
check "[ \$? -eq 0 ] && cmp -s $work/imp/tokenizer.model $tok && grep -q 'data.tokenizer = $work/imp/tokenizer.model' $work/i.log" \
  "import takes the exported tokenizer.model as data.tokenizer" || cat "$work/i.log"
"$titan3d" eval "$work/imp/step_00000000.h5" --json "$work/ei.json" >"$work/ei.log" 2>&1
check "[ \$? -eq 0 ] && [ \"\$(json_loss $work/ei.json)\" = \"\$(json_loss $work/e.json)\" ]" \
  "eval of the import equals the original's, through the imported tokenizer" || cat "$work/ei.log"

# data.bos travels through export and import; generate then starts the prompt with <s>.
check "grep -q '\"add_bos_token\": false' $work/hf/tokenizer_config.json && grep -q 'data.bos = false' $work/i.log" \
  "export says add_bos_token false (as the run read text) and import keeps data.bos = false" || cat "$work/i.log"
mkdir -p "$work/hfb" && cp "$work/hf/model.safetensors" "$work/hf/config.json" "$work/hf/tokenizer.model" "$work/hfb/"
"$titan3d" import "$work/hfb" --out "$work/impb" >"$work/ib.log" 2>&1
check "[ \$? -eq 0 ] && grep -q 'data.bos = true' $work/ib.log && grep -q 'no tokenizer_config.json' $work/ib.log" \
  "without tokenizer_config.json, import sets data.bos = true (LlamaTokenizer's default) and says so" || cat "$work/ib.log"
prompt_tokens() { sed -nE 's/.*prompt ([0-9]+) tokens.*/\1/p' "$1"; }
"$titan3d" generate "$work/imp/step_00000000.h5" --prompt "The lazy " --max-tokens 2 >/dev/null 2>"$work/g0.err"
"$titan3d" generate "$work/impb/step_00000000.h5" --prompt "The lazy " --max-tokens 2 >"$work/g1.txt" 2>"$work/g1.err"
n0=$(prompt_tokens "$work/g0.err"); n1=$(prompt_tokens "$work/g1.err")
check "[ -n \"$n0\" ] && [ \"$n1\" = \$((n0 + 1)) ] && grep -q 'BOS first' $work/g1.err && [ \"\$(head -c 9 $work/g1.txt)\" = 'The lazy ' ]" \
  "with data.bos, generate's prompt is <s> then the same ids ($n0 -> $n1 tokens), printed without it" \
  || cat "$work/g0.err" "$work/g1.err"
"$titan3d" export "$work/impb/step_00000000.h5" --out "$work/hfb2" >/dev/null 2>&1
check "grep -q '\"add_bos_token\": true' $work/hfb2/tokenizer_config.json" "export of that import says add_bos_token true"
"$titan3d" tokenize "$corpus" --tokenizer "$tok" --out "$work/f512_bos.bin" --bos >/dev/null 2>&1
count() { od -An -t d4 -j 8 -N 4 "$1" | tr -d ' '; }
first() { od -An -t u2 -j 1024 -N 2 "$1" | tr -d ' '; }
check "[ \$(count $work/f512_bos.bin) -eq \$((\$(count $work/f512.bin) + 1)) ] && [ \$(first $work/f512_bos.bin) -eq 1 ] && cmp -s <(tail -c +1027 $work/f512_bos.bin) <(tail -c +1025 $work/f512.bin)" \
  "tokenize --bos: the same ids after <s> (1)"
"$titan3d" train "${tiny[@]}" --set data.bos=true --set train.steps=1 --set run.dir="$work/bad" >"$work/bb.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'data.bos' $work/bb.log" \
  "data.bos with the byte tokenizer: exit 2 naming data.bos" || cat "$work/bb.log"

# Byte-level BPE, read from a tokenizer.json.
json_tok=$repo/tests/data/fixtures/bpe/llama3/tokenizer.json
"$titan3d" tokenize "$corpus" --tokenizer "$json_tok" --out "$work/bpe.bin" >"$work/bt.log" 2>&1
"$titan3d" tokenize "$work/bpe.bin" --decode --tokenizer "$json_tok" --out "$work/bpe_back.txt" >/dev/null 2>&1
check "cmp -s $work/bpe_back.txt $corpus && [ \$(stat -c %s $work/bpe.bin) -lt \$((1024 + 4 * \$(stat -c %s $corpus) / 2)) ]" \
  "byte-level BPE: decode(encode(corpus)) is the corpus, in fewer ids than half its bytes" || cat "$work/bt.log"
bbpe=("${tiny[@]}" --set hardware.gemm=openblas --set model.vocab_size=704 --set "data.tokenizer=\"$json_tok\"")
"$titan3d" train "${bbpe[@]}" --set train.steps=20 --set train.val_every=20 --set snapshot.every=20 \
  --set run.dir="$work/brun" >"$work/btrain.log" 2>&1
check "[ \$? -eq 0 ] && [ -s $work/brun/snapshots/step_00000020.h5 ]" "train tiny on byte-level BPE tokens" \
  || cat "$work/btrain.log"
bsnap=$work/brun/snapshots/step_00000020.h5
"$titan3d" eval "$bsnap" --json "$work/be.json" >/dev/null 2>&1
"$titan3d" export "$bsnap" --out "$work/bhf" >"$work/bx.log" 2>&1
check "[ \$? -eq 0 ] && cmp -s $work/bhf/tokenizer.json $json_tok && grep -q PreTrainedTokenizerFast $work/bhf/tokenizer_config.json && [ ! -e $work/bhf/tokenizer.model ]" \
  "export writes tokenizer.json (the same bytes) and a PreTrainedTokenizerFast config" || cat "$work/bx.log"
"$titan3d" import "$work/bhf" --out "$work/bimp" >"$work/bi.log" 2>&1
"$titan3d" eval "$work/bimp/step_00000000.h5" --json "$work/bei.json" >/dev/null 2>&1
check "cmp -s $work/bimp/tokenizer.json $json_tok && [ -n \"\$(json_loss $work/be.json)\" ] && [ \"\$(json_loss $work/bei.json)\" = \"\$(json_loss $work/be.json)\" ]" \
  "import takes tokenizer.json back; eval of the import equals the original's" || cat "$work/bi.log"

# Refusals, exit 2 with the keys named.
"$titan3d" train "${tiny[@]}" --set "data.tokenizer=\"$tok\"" --set train.steps=1 --set run.dir="$work/bad" >"$work/v.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'model.vocab_size is 256' $work/v.log && grep -q 'data.tokenizer' $work/v.log" \
  "a vocabulary smaller than the tokenizer's: exit 2 naming both" || cat "$work/v.log"
"$titan3d" train "${tiny[@]}" --set "data.tokenizer=\"$tok\"" --dry-run >"$work/d.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'model.vocab_size is 256' $work/d.log" \
  "--dry-run checks the tokenizer's ids against model.vocab_size" || cat "$work/d.log"
"$titan3d" train "${tiny[@]}" --set 'data.tokenizer="nope.model"' --set train.steps=1 --set run.dir="$work/bad" >"$work/n.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'data.tokenizer' $work/n.log && grep -q nope.model $work/n.log" \
  "a missing tokenizer model file: exit 2 naming data.tokenizer" || cat "$work/n.log"
"$titan3d" eval "$snap" --set data.tokenizer=bytes >"$work/b.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'byte tokenizer\|SentencePiece' $work/b.log" \
  "eval with another tokenizer than the snapshot's: exit 2" || cat "$work/b.log"
"$titan3d" tokenize "$corpus" --vocab 520 --tokenizer "$tok" >/dev/null 2>&1  # the file changes
"$titan3d" generate "$snap" --prompt "The " --max-tokens 3 >"$work/h.log" 2>&1
check "[ \$? -eq 2 ] && grep -q 'content hash' $work/h.log" \
  "a changed tokenizer file is refused by its content hash (exit 2)" || cat "$work/h.log"
exit $fail
