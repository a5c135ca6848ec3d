# Shared by the snapshot e2e tests: a work directory, a tiny corpus and loss comparisons.
titan3d=$1 recipe=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A few hundred lines of text are plenty for a handful of steps.
for i in $(seq 1 300); do echo "Line $i: the quick brown fox jumps over the lazy dog, again and again."; done > "$work/data.txt"
# A failing job must end, not restart (restarts: tests/e2e/restart.sh).
common=(--set data.path="$work/data.txt" --set train.val_every=0 --set run.log_level=warn
        --set run.max_restarts=0)
fail=0
check() { if eval "$1"; then echo "ok: $2"; else echo "FAIL: $2"; fail=1; return 1; fi; }

# "step loss" of every training row of a metrics.jsonl.
losses() { grep '"loss"' "$1" | sed -E 's/.*"step": ([0-9]+), "loss": ([^,]+),.*/\1 \2/'; }
# The rows of $1 from step $2 on.
losses_from() { losses "$1" | awk -v s="$2" '$1 >= s'; }
# Same steps, losses equal within relative tolerance $3.
close_losses() {
  paste <(losses_from "$1" "$4") <(losses "$2") |
    awk -v tol="$3" '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > tol * ($2 < 0 ? -$2 : $2)) bad = 1; n++ }
                     END { exit (bad || n == 0) }'
}
