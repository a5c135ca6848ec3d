#!/usr/bin/env bash
# Every malformed recipe in bad_recipes/ must give exit code 2 and exactly one error message naming
# the key in its `# expect:` line, without a stack trace, before any rank starts.
set -u
titan3d=$1
here=$(cd "$(dirname "$0")" && pwd)
fail=0 n=0
for recipe in "$here"/bad_recipes/*.toml; do
  n=$((n + 1))
  expect=$(sed -n 's/^# expect: //p' "$recipe")
  out=$("$titan3d" train "$recipe" 2>&1 >/dev/null)
  rc=$?
  name=$(basename "$recipe")
  if [ "$rc" -ne 2 ]; then echo "FAIL $name: exit $rc, expected 2"; fail=1; continue; fi
  if ! grep -qF -- "$expect" <<<"$out"; then echo "FAIL $name: message lacks '$expect': $out"; fail=1; continue; fi
  if [ "$(grep -c '^titan3d: ' <<<"$out")" -ne 1 ]; then echo "FAIL $name: not exactly one error: $out"; fail=1; continue; fi
  if grep -qiE 'terminate called|stack|Aborted|mpirun' <<<"$out"; then echo "FAIL $name: crash noise: $out"; fail=1; continue; fi
  echo "ok   $name: $(head -1 <<<"$out")"
done
# A --set that breaks the recipe is named as such.
out=$("$titan3d" train "$here/../../recipes/tiny.toml" --set model.n_heads=3 2>&1)
rc=$?
if [ $rc -ne 2 ] || ! grep -qF -- '--set model.n_heads=3' <<<"$out"; then echo "FAIL --set: rc=$rc $out"; fail=1; else echo "ok   --set override named"; fi
# selfcheck with a recipe that is not there: a user error naming it, before any rank starts.
out=$("$titan3d" selfcheck nowhere.toml 2>&1); rc=$?
if [ $rc -ne 2 ] || ! grep -q 'nowhere.toml' <<<"$out"; then echo "FAIL selfcheck nowhere.toml: rc=$rc $out"; fail=1; else echo "ok   selfcheck nowhere.toml: $out"; fi
# resume of a file that is not there: a user error naming it.
out=$("$titan3d" resume x.h5 2>&1); rc=$?
if [ $rc -ne 2 ] || ! grep -q 'snapshot `x.h5` does not exist' <<<"$out"; then echo "FAIL resume x.h5: rc=$rc $out"; fail=1; else echo "ok   resume x.h5: $out"; fi
# Issue 13: a directory as the recipe, an unknown verb, nonsense command-line numbers, a --set
# with extra lines, and a recipe that --dry-run accepts without starting a rank.
tiny=$here/../../recipes/tiny.toml
expect_2() {  # expect_2 WHAT NEEDLE CMD...: exit 2 and one message containing NEEDLE
  local what=$1 needle=$2; shift 2
  out=$("$@" 2>&1); rc=$?
  if [ $rc -ne 2 ] || ! grep -qF -- "$needle" <<<"$out" || grep -qiE 'terminate called|internal error' <<<"$out"; then
    echo "FAIL $what: rc=$rc $out"; fail=1
  else echo "ok   $what: $(head -1 <<<"$out")"; fi
}
deep=$(mktemp --suffix=.toml); trap 'rm -f "$deep"' EXIT
{ echo "[model]"; printf 'dim = '; printf '[%.0s' $(seq 20000); printf ']%.0s' $(seq 20000); echo; } >"$deep"
expect_2 "arrays nested 20000 deep" "$deep:2: arrays or inline tables nested more than" "$titan3d" train "$deep"
expect_2 "directory as recipe" '`'"$here"'/bad_recipes` is a directory' "$titan3d" train "$here/bad_recipes"
expect_2 "unknown verb" 'unknown verb `trian`' "$titan3d" trian "$tiny"
expect_2 "--np 0" '--np' "$titan3d" train "$tiny" --np 0
expect_2 "plan --top -1" '--top' "$titan3d" plan "$tiny" --top -1
expect_2 "--set with two lines" 'spans several lines' "$titan3d" train "$tiny" --dry-run --set $'run.name=a\nb'
expect_2 "--set beyond 64 bits" '`train.steps`: integer 99999999999999999999 does not fit' \
  "$titan3d" train "$tiny" --dry-run --set train.steps=99999999999999999999
hosts=$(mktemp); printf 'nodeA slots=2\nnodeB slots=two\n' >"$hosts"; trap 'rm -f "$deep" "$hosts"' EXIT
expect_2 "--dry-run reads run.hostfile" "\`run.hostfile\`: cannot read the hostfile \`/nonexistent/hosts\`" \
  "$titan3d" train "$tiny" --dry-run --set data.path="$0" --set run.hostfile=/nonexistent/hosts
expect_2 "--dry-run checks run.hostfile's slots" "$hosts:2: \`slots=two\` is not a positive number" \
  "$titan3d" train "$tiny" --dry-run --set data.path="$0" --set run.hostfile="$hosts"
out=$("$titan3d" train "$tiny" --dry-run --set data.path="$0" 2>&1); rc=$?
if [ $rc -ne 0 ] || ! grep -q '^recipe ok: .*1 ranks' <<<"$out"; then echo "FAIL --dry-run: rc=$rc $out"; fail=1; else echo "ok   --dry-run: $out"; fi
[ $n -ge 12 ] || { echo "FAIL: only $n malformed recipes"; fail=1; }
exit $fail
