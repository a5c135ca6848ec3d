#!/usr/bin/env bash
# `titan3d eval / generate / export` end to end on tiny models trained on the corpus:
#  - eval of a snapshot (the recipe's validation data) equals the val_loss the trainer logged at
#    that step: on 1 rank, and on tp2×pp2 for a tp2×pp2 run (the trainer prints 9 digits);
#  - eval agrees across layouts (1 rank vs tp2×pp2, dp2, tp2 + SP) within fp32 tolerance, on incremental
#    snapshots, on a whole --data file whose last batch is partial;
#  - greedy generate is deterministic and writes only characters of the corpus; seeded sampling
#    repeats itself;
#  - export writes model.safetensors and config.json; bad input is exit code 2.
set -u
source "$(dirname "$0")/common.sh"

# One rank: snapshots at 30 (full) and 60 (incremental on 30), validation at both.
"$titan3d" train "${tiny[@]}" --set train.steps=60 --set train.val_every=30 --set snapshot.every=30 \
  --set snapshot.full_every=2 --set snapshot.incremental_min_unchanged=0 --set run.dir="$work/one" >"$work/one.log" 2>&1
check "[ \$? -eq 0 ]" "train tiny on 1 rank" || cat "$work/one.log"
snap=$work/one/snapshots/step_00000060.h5
for step in 30 60; do
  "$titan3d" eval "$work/one/snapshots/step_000000$step.h5" --json "$work/e$step.json" >"$work/e$step.log" 2>&1
  check "[ \$? -eq 0 ] && rel_close \$(json_loss $work/e$step.json) \$(val_loss $work/one/metrics.jsonl $step) 5e-9" \
    "eval at step $step equals the trainer's val_loss (1 rank)" || cat "$work/e$step.log"
done
"$titan3d" eval "$snap" --set parallel.tp=2 --set parallel.pp=2 --json "$work/e60tp.json" >"$work/e60tp.log" 2>&1
check "[ \$? -eq 0 ] && rel_close \$(json_loss $work/e60tp.json) \$(json_loss $work/e60.json) 1e-5" \
  "eval of the 1-rank snapshot on tp2×pp2 agrees (rel 1e-5)" || cat "$work/e60tp.log"

# A tp2×pp2 run: eval on its own layout repeats its validation; on 1 rank, on dp2 and on tp2 with
# sequence parallelism it agrees.
"$titan3d" train "${tiny[@]}" --set parallel.tp=2 --set parallel.pp=2 --set train.steps=8 \
  --set train.val_every=8 --set snapshot.every=8 --set run.dir="$work/mesh" >"$work/mesh.log" 2>&1
check "[ \$? -eq 0 ]" "train tiny on tp2×pp2" || cat "$work/mesh.log"
msnap=$work/mesh/snapshots/step_00000008.h5
"$titan3d" eval "$msnap" --set parallel.tp=2 --set parallel.pp=2 --json "$work/m.json" >"$work/m.log" 2>&1
check "[ \$? -eq 0 ] && rel_close \$(json_loss $work/m.json) \$(val_loss $work/mesh/metrics.jsonl 8) 5e-9" \
  "eval at step 8 on tp2×pp2 equals the trainer's val_loss (same layout)" || cat "$work/m.log"
for layout in "" "--set parallel.dp=2" "--set parallel.tp=2 --set parallel.sequence_parallel=true" \
              "--set parallel.cp=2"; do
  "$titan3d" eval "$msnap" $layout --json "$work/m1.json" >"$work/m1.log" 2>&1
  check "[ \$? -eq 0 ] && rel_close \$(json_loss $work/m1.json) \$(json_loss $work/m.json) 1e-5" \
    "eval of the tp2×pp2 snapshot on ${layout:-1 rank} agrees (rel 1e-5)" || cat "$work/m1.log"
done

# A whole file: 628 windows of 32 tokens in batches of 8, so the last batch has 4 ignored rows.
head -c 20100 "$corpus" >"$work/part.txt"
"$titan3d" eval "$snap" --data "$work/part.txt" --json "$work/p1.json" >"$work/p1.log" 2>&1
check "[ \$? -eq 0 ] && grep -q '\"windows\": 628, \"tokens\": 20096, \"batches\": 79' $work/p1.json" \
  "eval --data covers every window once (628 windows, 79 batches)" || cat "$work/p1.log" "$work/p1.json"
"$titan3d" eval "$snap" --data "$work/part.txt" --set parallel.pp=2 --set parallel.dp=2 --json "$work/p4.json" >"$work/p4.log" 2>&1
check "[ \$? -eq 0 ] && rel_close \$(json_loss $work/p4.json) \$(json_loss $work/p1.json) 1e-5" \
  "eval --data on pp2×dp2 agrees with 1 rank, partial last batch included (rel 1e-5)" || cat "$work/p4.log"
"$titan3d" eval "$snap" --data "$work/part.txt" --batches 2 --json "$work/b2.json" >/dev/null 2>&1
check "grep -q '\"windows\": 16' $work/b2.json" "eval --batches 2 scores 2 batches of 8 windows"

# generate: greedy twice gives the same text; every byte of it occurs in the corpus.
gen() { "$titan3d" generate "$snap" --prompt "The " --max-tokens 120 "$@" 2>"$work/gen.err"; }
gen --temperature 0 >"$work/g1.txt"
check "[ \$? -eq 0 ]" "generate (greedy) runs" || cat "$work/gen.err"
gen --temperature 0 >"$work/g2.txt"
check "cmp -s $work/g1.txt $work/g2.txt" "greedy generate is deterministic"
check "[ \$(head -c 4 $work/g1.txt) = The ] && [ \$(wc -c <$work/g1.txt) -eq 125 ]" \
  "generate prints the prompt, 120 tokens and a newline"
bytes_of() { od -An -v -tu1 "$1" | tr -s ' ' '\n' | grep -v '^$' | LC_ALL=C sort -u; }
bytes_of "$corpus" >"$work/corpus.bytes"
check "[ -z \"\$(head -c 124 $work/g1.txt | tail -c 120 >$work/new.txt; LC_ALL=C comm -23 <(bytes_of $work/new.txt) $work/corpus.bytes)\" ]" \
  "generated text is made of the corpus's characters"
echo "  greedy: $(head -c 125 "$work/g1.txt" | tr '\n' '|')"
gen --temperature 0.8 --top-k 20 --seed 3 >"$work/s1.txt"
gen --temperature 0.8 --top-k 20 --seed 3 >"$work/s2.txt"
gen --temperature 0.8 --top-k 20 --seed 4 >"$work/s3.txt"
check "cmp -s $work/s1.txt $work/s2.txt && ! cmp -s $work/s1.txt $work/s3.txt" \
  "sampling repeats itself for a seed and differs for another"
# Past the 32-position context: the cache is rebuilt from the last half and generation goes on.
"$titan3d" generate "$snap" --prompt "Q: " --max-tokens 100 --temperature 0 >"$work/long.txt" 2>/dev/null
check "[ \$(wc -c <$work/long.txt) -eq 104 ]" "generate runs past model.seq_len"

# export: the two files, loadable names (bit-exactness: test_use; PyTorch: use_torch_crosscheck).
"$titan3d" export "$snap" --out "$work/hf" >"$work/x.log" 2>&1
check "[ \$? -eq 0 ] && [ -s $work/hf/model.safetensors ] && grep -q LlamaForCausalLM $work/hf/config.json" \
  "export writes model.safetensors and config.json" || cat "$work/x.log"

# Bad input: exit code 2 and one message naming the problem.
expect_user_error() {  # description, expected text, command...
  local what=$1 text=$2; shift 2
  local out rc
  out=$("$@" 2>&1); rc=$?
  check "[ $rc -eq 2 ] && grep -qF -- \"$text\" <<<\"\$out\" && ! grep -qiE 'terminate called|Aborted' <<<\"\$out\"" \
    "$what: exit 2 naming it" || echo "  rc=$rc: $out"
}
expect_user_error "eval of a missing snapshot" "does not exist" "$titan3d" eval "$work/none.h5"
expect_user_error "eval with a missing --data" "--data" "$titan3d" eval "$snap" --data "$work/none.txt"
expect_user_error "eval with --batches -1" "--batches" "$titan3d" eval "$snap" --batches -1
printf 'x' >"$work/odd.bin"
expect_user_error "eval with a broken token file" "odd.bin" "$titan3d" eval "$snap" --data "$work/odd.bin"
expect_user_error "generate from a missing snapshot" "does not exist" "$titan3d" generate "$work/none.h5" --prompt x
expect_user_error "export of a missing snapshot" "does not exist" "$titan3d" export "$work/none.h5" --out "$work/o"
# Options out of range: bounded, exit 2 naming the option (not run until killed, not wrapped).
expect_user_error "eval --batches 0" "--batches" "$titan3d" eval "$snap" --batches 0
expect_user_error "generate --max-tokens 99999999999" "--max-tokens" \
  timeout 60 "$titan3d" generate "$snap" --prompt x --max-tokens 99999999999
expect_user_error "generate --top-k 99999999999" "--top-k" \
  timeout 60 "$titan3d" generate "$snap" --prompt x --top-k 99999999999
expect_user_error "generate --seed -1" "--seed" "$titan3d" generate "$snap" --prompt x --seed -1
expect_user_error "generate --seed 2^64" "--seed" \
  "$titan3d" generate "$snap" --prompt x --seed 18446744073709551616
expect_user_error "generate --temperature inf" "--temperature" \
  "$titan3d" generate "$snap" --prompt x --temperature inf
exit $fail
