# Helpers for the cluster tests (sourced). They build real infrastructure (SLURM daemons, network
# namespaces) and so need root and Debian packages; where either is missing they skip LOUDLY:
# print "SKIPPED: why" and exit with the code ctest's SKIP_RETURN_CODE maps to "Skipped".
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
readonly SKIP_CODE=77

skip() {
  echo "SKIPPED: $*"
  exit $SKIP_CODE
}

# need_root WHAT: skip unless root (daemons, namespaces and apt-get all need it).
need_root() {
  [ "$(id -u)" -eq 0 ] || skip "$1: needs root (running as uid $(id -u))"
}

# need_packages PKG...: install the missing ones with apt-get (idempotent), or skip.
need_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing ${missing[*]}"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
           "${missing[@]}" > "${TMPDIR:-/tmp}/t3d_apt_$$.log" 2>&1 ||
         { apt-get update -q > /dev/null 2>&1 &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
             "${missing[@]}" > "${TMPDIR:-/tmp}/t3d_apt_$$.log" 2>&1; }; }; then
    tail -3 "${TMPDIR:-/tmp}/t3d_apt_$$.log"
    rm -f "${TMPDIR:-/tmp}/t3d_apt_$$.log"
    skip "cannot install ${missing[*]} with apt-get"
  fi
  rm -f "${TMPDIR:-/tmp}/t3d_apt_$$.log"
}

# wait_for SECONDS CMD...: polls CMD every half second until it succeeds; fails after SECONDS.
wait_for() {
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" > /dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

fail=0
# check CONDITION DESCRIPTION: prints ok/FAIL, remembers a failure; returns the condition's status.
check() {
  if eval "$1"; then echo "ok   $2"; return 0; fi
  echo "FAIL $2"
  fail=1
  return 1
}
