# Shared by the eval/generate/export end-to-end tests (sourced): a work directory, the corpus,
# checks, and one tiny model trained on it.
titan3d=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
corpus=$repo/data/fortunes.txt
[ -s "$corpus" ] || { echo "FAIL: $corpus is missing: run scripts/get_data.sh"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$repo"  # recipes name data/fortunes.txt relative to the repository
fail=0
check() { if eval "$1"; then echo "ok: $2"; else echo "FAIL: $2"; fail=1; return 1; fi; }
# The tiny recipe with grouped-query attention (2 kv heads for 4 query heads).
tiny=("$repo/recipes/tiny.toml" --set model.n_kv_heads=2 --set run.log_level=warn)
# json_loss FILE: the "loss" of an eval --json or torch_eval.py output.
json_loss() { sed -E 's/.*"loss": ([^,}]+).*/\1/' "$1"; }
# val_loss METRICS STEP: the val_loss the trainer logged at STEP.
val_loss() { grep "\"step\": $2," "$1" | grep -v '"val_loss": null' | sed -E 's/.*"val_loss": ([^,}]+).*/\1/'; }
# rel_close A B RTOL: |A - B| <= RTOL |B|; prints the relative difference.
rel_close() {
  awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { if (a == "" || b == "") exit 1; d = a - b; if (d < 0) d = -d;
    r = d / (b < 0 ? -b : b); printf "  %s vs %s: relative difference %.2e (tolerance %g)\n", a, b, r, t; exit !(r <= t) }'
}
# greedy_agrees GENERATED_TEXT TORCH_JSON PROMPT: the byte ids after the prompt are the JSON's.
greedy_agrees() {
  /usr/bin/python3 -c 'import json, sys
out, want, prompt = open(sys.argv[1], "rb").read(), json.load(open(sys.argv[2]))["tokens"], sys.argv[3].encode()
got = list(out[len(prompt):-1]) if out.startswith(prompt) and out.endswith(b"\n") else None
print("  titan3d:", got); print("  PyTorch:", want); sys.exit(got != want)' "$@"
}
same_family() {  # A B: config.json of A and B name the same architectures and model_type
  /usr/bin/python3 -c 'import json, sys; a, b = (json.load(open(d + "/config.json")) for d in sys.argv[1:]); sys.exit(any(a[k] != b[k] for k in ("architectures", "model_type")))' "$@"
}
same_losses() {  # A B RTOL: both metrics.jsonl have 20 steps whose losses agree within RTOL
  paste <(grep -o '"loss": [^,]*' "$1") <(grep -o '"loss": [^,]*' "$2") | sed 's/"loss"://g' |
    awk -v t="$3" '{ d = $1 - $2; if (d < 0) d = -d; r = d / $2; if (r > worst) worst = r; n++ }
      END { printf "  %d steps, largest relative difference %.2e (tolerance %g)\n", n, worst, t; exit !(n == 20 && worst <= t) }'
}
# check_family HF NAME WHAT [IMPORT_LOG_PATTERN]: a model directory HF in Hugging Face's layout,
# written by safetensors_tool.py from its family's definition: imported (into $work/NAME_imp, its
# log matching the pattern where one is given), evaluated by titan3d in fp32 on tp1 and tp2 over
# $work/part.txt within 1e-6 relative of torch_eval.py's float64 forward of the definition,
# exported back with the file's tensors bit for bit in its family, and its greedy generate equal
# to the definition's greedy tokens. $py runs PyTorch.
check_family() {
  local hf=$1 name=$2 what=$3 pattern=${4:-} rc tp
  local tools snap torch_json
  tools=$(dirname "${BASH_SOURCE[0]}")
  "$titan3d" import "$hf" --out "$work/${name}_imp" >"$work/${name}_imp.log" 2>&1
  rc=$?
  check "[ $rc -eq 0 ] && { [ -z '$pattern' ] || grep -q '$pattern' $work/${name}_imp.log; }" \
    "import a $what" || cat "$work/${name}_imp.log"
  snap=$work/${name}_imp/step_00000000.h5
  torch_json=$work/${name}_torch.json
  "$py" "$tools/torch_eval.py" "$hf" "$work/part.txt" >"$torch_json" 2>"$work/${name}_torch.err"
  rc=$?
  check "[ $rc -eq 0 ]" "PyTorch forward of the definition of $what" || cat "$work/${name}_torch.err"
  for tp in 1 2; do
    "$titan3d" eval "$snap" --data "$work/part.txt" --set parallel.tp=$tp \
      --json "$work/${name}_tp$tp.json" >"$work/${name}_eval.log" 2>&1
    rc=$?
    check "[ $rc -eq 0 ]" "titan3d eval of the import of $what on tp$tp" || cat "$work/${name}_eval.log"
    check "rel_close \$(json_loss $work/${name}_tp$tp.json) \$(json_loss $torch_json) 1e-6" \
      "$what, tp$tp: titan3d eval (fp32) equals PyTorch's forward of the definition (rel 1e-6)"
  done
  "$titan3d" export "$snap" --out "$work/${name}_out" >/dev/null 2>&1
  check "\"$py\" \"$tools/safetensors_tool.py\" same $hf/model.safetensors $work/${name}_out/model.safetensors && same_family $hf $work/${name}_out" \
    "$what: the re-export's tensors are the file's bit for bit, in its family"
  "$titan3d" generate "$snap" --prompt "The " --max-tokens 24 --temperature 0 \
    >"$work/${name}_gen.txt" 2>"$work/${name}_gen.err"
  rc=$?
  check "[ $rc -eq 0 ]" "generate from the import of $what" || cat "$work/${name}_gen.err"
  "$py" "$tools/torch_eval.py" "$hf" --greedy "The " 24 >"$work/${name}_greedy.json" 2>"$work/${name}_torch.err"
  check "greedy_agrees $work/${name}_gen.txt $work/${name}_greedy.json 'The '" \
    "$what: greedy generate equals PyTorch's greedy tokens of the definition" || cat "$work/${name}_torch.err"
}
