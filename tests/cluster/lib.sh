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

# make_two_hosts LETTER NET WORK_TEMPLATE: two hosts for a test, network namespaces $ns_a and
# $ns_b (host names hosta and hostb, addresses 10.NET.0.1 and 10.NET.0.2) joined by a veth pair
# whose host-b end is $link_b, and $work/agent, Open MPI's stand-in for ssh: `agent HOST
# COMMAND...` runs COMMAND through a shell (as sshd would) in that host's network namespace, under
# its host name. Sets ns_a, ns_b, link_b and work (mktemp -d WORK_TEMPLATE; kept with T3D_KEEP=1),
# and an EXIT trap that kills every process in the namespaces and deletes them. Skips where the
# machine cannot make or enter namespaces (LETTER keeps two tests' names apart).
make_two_hosts() {
  local letter=$1 net=$2 tag=$$
  ns_a=t3d_${letter}a_$tag ns_b=t3d_${letter}b_$tag
  local link_a=t3${letter}a$tag
  link_b=t3${letter}b$tag
  work=$(mktemp -d "$3")
  trap _remove_two_hosts EXIT
  ip netns add "$ns_a" 2> "$work/netns.err" ||
    skip "cannot create a network namespace here: $(cat "$work/netns.err")"
  ip netns add "$ns_b" 2> "$work/netns.err" ||
    skip "cannot create a second network namespace here: $(cat "$work/netns.err")"
  # Making a namespace is not entering one: some sandboxes allow the first and refuse the second.
  ip netns exec "$ns_a" unshare --uts true 2> "$work/netns.err" ||
    skip "cannot enter a network and UTS namespace here: $(cat "$work/netns.err")"
  ip link add "$link_a" netns "$ns_a" type veth peer name "$link_b" netns "$ns_b" \
    2> "$work/netns.err" ||
    skip "cannot link two network namespaces (veth) here: $(cat "$work/netns.err")"
  ip -n "$ns_a" addr add "10.$net.0.1/24" dev "$link_a"
  ip -n "$ns_b" addr add "10.$net.0.2/24" dev "$link_b"
  for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
  ip -n "$ns_a" link set "$link_a" up
  ip -n "$ns_b" link set "$link_b" up
  cat > "$work/agent" <<AGENT
#!/bin/sh
host=\$1; shift
case \$host in
  10.$net.0.1|hosta) ns=$ns_a name=hosta ;;
  10.$net.0.2|hostb) ns=$ns_b name=hostb ;;
  *) echo "agent: no such test host: \$host" >&2; exit 255 ;;
esac
exec ip netns exec \$ns unshare --uts sh -c "hostname \$name; \$*"
AGENT
  chmod +x "$work/agent"
}

_remove_two_hosts() {
  local ns pid
  for ns in "$ns_a" "$ns_b"; do
    # Every process in our namespaces is ours: mpirun, orted, ranks.
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
    ip netns del "$ns" 2> /dev/null
  done
  [ -n "${T3D_KEEP:-}" ] || rm -rf "$work"  # T3D_KEEP=1: keep for a look
}
