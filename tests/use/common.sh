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
