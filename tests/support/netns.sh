#!/usr/bin/env bash
# A network namespace of the test's own, joined to the host by a veth pair, so a gateway can run
# at a NON-loopback address that clawmux (on the host) reaches over a real interface.
#
#   tests/support/netns.sh up NAME HOST_ADDR NS_ADDR   create namespace NAME, veth pair
#                                                      vh-NAME (host, HOST_ADDR/30) <-> vn-NAME
#                                                      (inside NAME, NS_ADDR/30); both ends and
#                                                      `lo` inside NAME up
#   tests/support/netns.sh down NAME                   delete the veth pair and the namespace
#                                                      (idempotent: missing pieces are fine)
#   tests/support/netns.sh status NAME                 show both ends; exit 1 unless NAME exists
#
# NAME: 1..12 characters [A-Za-z0-9_-] (interface names are limited to 15 bytes).
# HOST_ADDR and NS_ADDR: two distinct host addresses of the same /30 inside 10.213.0.0/16, e.g.
#   10.213.0.1 and 10.213.0.2. Only our own test hosts use that range; no route, NAT or forwarding
#   is set up, so all traffic stays between the host and the namespace this script made.
# `up` refuses when NAME, either interface, or HOST_ADDR already exists on the host (a leftover of
# an earlier run: `down NAME` first; another concurrent run: pick another NAME and /30).
# Processes still running inside NAME are NOT killed by `down` (stop them by PID first, e.g.
# `tests/support/gateway.sh stop RUN_DIR`); `down` lists them as a warning.
#
# Requires root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and `ip` from iproute2
# (`apt-get install -y iproute2` where it is missing).
set -euo pipefail

die() { printf 'netns.sh: %s\n' "$*" >&2; exit 1; }
say() { printf 'netns.sh: %s\n' "$*" >&2; }

usage() {
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

need_ip() {
  command -v ip >/dev/null 2>&1 || die "'ip' (iproute2) is required: apt-get install -y iproute2"
  [ "$(id -u)" = 0 ] || die "must run as root (ip netns, veth)"
}

check_name() {
  [[ "$1" =~ ^[A-Za-z0-9_-]{1,12}$ ]] || die "NAME must be 1..12 characters [A-Za-z0-9_-], not '$1'"
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$1"; }
link_exists() { ip link show dev "$1" >/dev/null 2>&1; }

# check_pair HOST_ADDR NS_ADDR: both in 10.213.0.0/16, same /30, distinct, neither the /30's
# network nor its broadcast address.
check_pair() {
  python3 - "$1" "$2" <<'PY' || exit 1
import ipaddress, sys
try:
    h, n = (ipaddress.IPv4Address(a) for a in sys.argv[1:3])
except ValueError as e:
    sys.exit(f"netns.sh: not an IPv4 address: {e}")
pool = ipaddress.IPv4Network("10.213.0.0/16")
for a in (h, n):
    if a not in pool:
        sys.exit(f"netns.sh: {a} is outside 10.213.0.0/16")
net = ipaddress.IPv4Network(f"{h}/30", strict=False)
if n not in net:
    sys.exit(f"netns.sh: {h} and {n} are not in the same /30 ({net})")
if h == n:
    sys.exit("netns.sh: HOST_ADDR and NS_ADDR must differ")
for a in (h, n):
    if a in (net.network_address, net.broadcast_address):
        sys.exit(f"netns.sh: {a} is the network or broadcast address of {net}")
PY
}

cmd_up() {
  [ $# -eq 3 ] || usage
  local name="$1" host="$2" nsaddr="$3" vh vn
  check_name "$name"
  need_ip
  check_pair "$host" "$nsaddr"
  vh="vh-$name"
  vn="vn-$name"
  ns_exists "$name" && die "namespace $name already exists (run: $0 down $name)"
  link_exists "$vh" && die "interface $vh already exists (run: $0 down $name)"
  link_exists "$vn" && die "interface $vn already exists (run: $0 down $name)"
  if ip -o -4 addr show | awk '{print $4}' | cut -d/ -f1 | grep -qx -- "$host"; then
    die "$host is already assigned on this host (another run? pick another /30)"
  fi
  # From here on, undo what was made if a step fails.
  trap 'say "up failed; removing what was created"; cmd_down "$name" >/dev/null 2>&1 || true' ERR
  ip netns add "$name"
  ip link add "$vh" type veth peer name "$vn"
  ip link set "$vn" netns "$name"
  ip addr add "$host/30" dev "$vh"
  ip link set "$vh" up
  ip -n "$name" addr add "$nsaddr/30" dev "$vn"
  ip -n "$name" link set "$vn" up
  ip -n "$name" link set lo up
  trap - ERR
  # A veth end reports operstate "up" once both ends are up (milliseconds).
  local ok=0
  for _ in $(seq 1 50); do
    if [ "$(cat "/sys/class/net/$vh/operstate" 2>/dev/null)" = up ]; then ok=1; break; fi
    sleep 0.1
  done
  [ "$ok" = 1 ] || say "warning: $vh did not report operstate up within 5 s"
  say "up: namespace $name ($vn $nsaddr/30, lo up) <-> host $vh $host/30"
}

cmd_down() {
  [ $# -eq 1 ] || usage
  local name="$1" pids
  check_name "$name"
  need_ip
  if ns_exists "$name"; then
    pids="$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ' || true)"
    [ -z "${pids// /}" ] || say "warning: processes still in namespace $name: $pids(not killed)"
  fi
  # Deleting one end of a veth pair deletes both.
  if link_exists "vh-$name"; then ip link del "vh-$name" && say "deleted veth vh-$name"; fi
  if ns_exists "$name"; then
    if ip -n "$name" link show dev "vn-$name" >/dev/null 2>&1; then ip -n "$name" link del "vn-$name" || true; fi
    ip netns del "$name" && say "deleted namespace $name"
  fi
  return 0
}

cmd_status() {
  [ $# -eq 1 ] || usage
  local name="$1"
  check_name "$name"
  need_ip
  ns_exists "$name" || { say "no namespace $name"; return 1; }
  ip -br addr show dev "vh-$name" 2>/dev/null || say "no host interface vh-$name"
  ip -n "$name" -br addr show
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
case "$cmd" in
  up) cmd_up "$@" ;;
  down) cmd_down "$@" ;;
  status) cmd_status "$@" ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
