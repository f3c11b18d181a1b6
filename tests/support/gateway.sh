#!/usr/bin/env bash
# Run the REAL OpenClaw gateway against the fake LLM (tests/support/fake_llm.py), on 127.0.0.1
# (or, with NETNS/BIND_HOST, inside a network namespace at a non-loopback address).
#
#   tests/support/gateway.sh start RUN_DIR [v4|v3]   start fake LLM + gateway, wait for /readyz,
#                                                    write RUN_DIR/env (see below)
#   tests/support/gateway.sh stop RUN_DIR            stop both (by recorded PID), and the gateway's
#                                                    child processes
#   tests/support/gateway.sh restart-gateway RUN_DIR kill -9 the gateway only, start it again on the
#                                                    same port, state dir, token, namespace and
#                                                    bind address; wait for /readyz
#   tests/support/gateway.sh status RUN_DIR          print RUN_DIR/env; exit 1 unless both run
#   tests/support/gateway.sh approve-device RUN_DIR [ID]
#                                                    approve a pending device pairing request with
#                                                    the gateway's own CLI (see below)
#
# RUN_DIR/env (KEY=VALUE lines, no quoting; also valid shell):
#   GATEWAY_URL=ws://<GATEWAY_HOST>:<port>   GATEWAY_HOST=<BIND_HOST or 127.0.0.1>
#   GATEWAY_TOKEN=<random hex>   GATEWAY_PORT=<port>
#   LLM_PORT=<port>   LLM_LOG=<RUN_DIR>/llm-requests.jsonl   GATEWAY_PID=<pid>   LLM_PID=<pid>
#   GATEWAY_FLAVOR=v4|v3   GATEWAY_LOG=<RUN_DIR>/gateway.log   LLM_BASE_URL=http://127.0.0.1:<port>/v1
#   (with NETNS that address is the namespace's own loopback, not reachable from the host)
#   RUN_DIR=<RUN_DIR>   NODE_BIN=<node>   OPENCLAW_MJS=<openclaw.mjs>
#   NETNS=<name or empty>   BIND_HOST=<addr or empty>
# The env file is written only once the gateway is ready.
#
# Env knobs:
#   GW_PORT, LLM_PORT            fixed ports (default: free loopback ports)
#   CLAWMUX_NODE_BIN, CLAWMUX_OPENCLAW_MJS   use this Node / openclaw.mjs (both must be set;
#                                default: whatever tests/support/install-openclaw.sh [v4|v3] prints,
#                                which installs on first use). They are used as given, so for v3
#                                point them at the 2026.4.12 install or leave them unset.
#   CLAWMUX_CACHE                cache dir (default $HOME/.cache/clawmux); holds the installs and
#                                gateway-tmp/ (the gateway's TMPDIR, kept so Node's compile cache
#                                stays warm: ~8 s to ready instead of ~12 s)
#   GATEWAY_READY_TIMEOUT        seconds to wait for /readyz (default 90)
#   FAKE_LLM_DELAY, FAKE_LLM_CHUNKS, FAKE_LLM_LOG_BODY   passed on to fake_llm.py
#   PROXY_PORT                   recorded in RUN_DIR/env (the port of clawmux's LLM proxy that
#                                PROVIDER_BASE_URL points at), so tests find it after a restart
#   PROVIDER_BASE_URL            the gateway's model provider baseUrl (default: the fake LLM, i.e.
#                                http://127.0.0.1:<LLM_PORT>/v1); point it at clawmux's LLM proxy to
#                                test billing attribution (the fake LLM is then the proxy's upstream)
#   NETNS=<name>                 run the fake LLM and the gateway inside this existing network
#                                namespace (`ip netns exec NAME ...`; needs root; create it with
#                                tests/support/netns.sh up). Readiness is probed inside it; `stop`
#                                works by PID as always. Kept in RUN_DIR/env for restart-gateway and
#                                approve-device.
#   BIND_HOST=<IPv4>             bind the gateway to this address instead of loopback (gateway.bind
#                                "custom" + gateway.customBindHost, `--bind custom`; the v4 gateway
#                                then also listens on 127.0.0.1 of its own namespace, which its local
#                                CLI uses); GATEWAY_URL uses it. Without NETNS the address must exist
#                                on this host.
#
# approve-device RUN_DIR [ID]: runs `openclaw devices list --json` of that gateway's own install
# against its config/state (same OPENCLAW_CONFIG_PATH, OPENCLAW_STATE_DIR, HOME, TMPDIR; the token
# comes from the config file, never from an argument; inside NETNS if any; the CLI reaches the
# gateway on its namespace's loopback, so it is a local, self-paired operator), picks the pending
# request whose requestId or deviceId equals ID (or the only pending one when ID is omitted; more
# than one is an error), approves it with `openclaw devices approve <requestId> --json` (the CLI
# wants the REQUEST id, not the device id) and prints one line on stdout:
#   approved requestId=<requestId> deviceId=<deviceId>
# plus the CLI's JSON answers on stderr. Exit 1 when nothing matches. Env: APPROVE_WAIT (seconds to
# wait for a matching pending request to show up, default 0).
#
# Files in RUN_DIR: openclaw.json (the config, mode 0600), home/, state/, gateway.log (stdout+stderr),
# gateway-file.log (the gateway's file log; v3 ignores it and writes /tmp/openclaw/ instead),
# fake_llm.log, llm-requests.jsonl, llm.port, gateway.pid, fake_llm.pid, env.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
READY_TIMEOUT="${GATEWAY_READY_TIMEOUT:-90}"

die() { printf 'gateway.sh: %s\n' "$*" >&2; exit 1; }
say() { printf 'gateway.sh: %s\n' "$*" >&2; }
now() { date +%s.%N; }
elapsed() { python3 -c 'import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))' "$1" "$(now)"; }

usage() {
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# ------------------------------------------------------------------ helpers

run_dir_abs() { # RUN_DIR -> absolute path (created); refuses odd characters (env file is unquoted)
  local d="$1"
  case "$d" in
    *[!A-Za-z0-9._/+@:-]*) die "RUN_DIR may only contain [A-Za-z0-9._/+@:-]: '$d'" ;;
  esac
  mkdir -p "$d"
  (cd "$d" && pwd -P)
}

# alive PID: running and not a zombie (orphans are reaped by PID 1, which may take a while)
alive() {
  local st
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
  st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

# ours PID WORD: PID is alive and its command line mentions WORD (guards against a stale pid
# file whose PID now belongs to an unrelated process)
ours() {
  alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "$2"
}

read_pid() { # FILE -> pid or empty
  if [ -f "$1" ]; then tr -dc '0-9' <"$1"; fi
}

descendants() { # PID -> all descendant pids, deepest last
  local c
  for c in $(pgrep -P "$1" 2>/dev/null || true); do
    echo "$c"
    descendants "$c"
  done
  return 0
}

# NSX: the command prefix that runs a command inside NETNS_V (empty without a namespace).
# Set by set_netns from NETNS_V / BIND_HOST_V (the env knobs, or RUN_DIR/env on restart).
NSX=()
set_netns() {
  NSX=()
  if [ -n "${NETNS_V:-}" ]; then
    [[ "$NETNS_V" =~ ^[A-Za-z0-9_.-]+$ ]] || die "NETNS may only contain [A-Za-z0-9_.-]: '$NETNS_V'"
    command -v ip >/dev/null 2>&1 || die "NETNS needs 'ip' (iproute2): apt-get install -y iproute2"
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$NETNS_V" ||
      die "network namespace $NETNS_V does not exist (tests/support/netns.sh up ...)"
    NSX=(ip netns exec "$NETNS_V")
  fi
  if [ -n "${BIND_HOST_V:-}" ]; then
    python3 -c 'import ipaddress, sys; ipaddress.IPv4Address(sys.argv[1])' "$BIND_HOST_V" 2>/dev/null ||
      die "BIND_HOST must be an IPv4 address (gateway.customBindHost), not '$BIND_HOST_V'"
  fi
  return 0
}

# gw_host: the address the gateway serves on (BIND_HOST, else loopback)
gw_host() { printf '%s\n' "${BIND_HOST_V:-127.0.0.1}"; }

free_port() { # a free port on 127.0.0.1 that is also free on [::1] (the gateway binds both);
  # with BIND_HOST_V: free on BIND_HOST and 127.0.0.1; in NETNS_V when set
  if [ -n "${BIND_HOST_V:-}" ]; then
    # custom bind: the gateway listens on BIND_HOST and 127.0.0.1 (in NETNS when set)
    "${NSX[@]}" python3 - "$BIND_HOST_V" <<'PY'
import socket, sys
host = sys.argv[1]
for _ in range(50):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    port = s.getsockname()[1]
    try:
        s2 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s2.bind(("127.0.0.1", port))
        finally:
            s2.close()
    except OSError:
        s.close()
        continue
    s.close()
    print(port)
    break
else:
    raise SystemExit("no free port found")
PY
    return
  fi
  "${NSX[@]}" python3 - <<'PY'
import socket
for _ in range(50):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        s6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            s6.bind(("::1", port))
        finally:
            s6.close()
    except OSError as e:
        if e.errno == 98:  # EADDRINUSE on ::1: try another
            s.close()
            continue
        # no IPv6 on this machine: the 127.0.0.1 check is enough
    s.close()
    print(port)
    break
else:
    raise SystemExit("no free port found")
PY
}

env_get() { # RUN_DIR KEY -> value from RUN_DIR/env
  sed -n "s/^$2=//p" "$1/env" | tail -1
}

# stop_pid NAME PID: TERM, wait up to 5 s, KILL; then the same for its descendants.
stop_pid() {
  local name="$1" pid="$2" kids k
  alive "$pid" || return 0
  kids="$(descendants "$pid")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    say "$name ($pid) ignored SIGTERM for 5 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  # children normally exit with the gateway; give them a moment, then TERM/KILL the rest by PID
  for k in $kids; do
    for _ in $(seq 1 20); do alive "$k" || break; sleep 0.1; done
    if alive "$k"; then kill -TERM "$k" 2>/dev/null || true; fi
  done
  for k in $kids; do
    for _ in $(seq 1 30); do alive "$k" || break; sleep 0.1; done
    if alive "$k"; then kill -KILL "$k" 2>/dev/null || true; fi
  done
  # reap/settle: wait until the main pid is really gone (zombies of a dead parent vanish at once)
  for _ in $(seq 1 20); do alive "$pid" || break; sleep 0.1; done
  return 0
}

# ------------------------------------------------------------------ gateway process

# in_gateway_env RUN_DIR NODE_BIN OPENCLAW_MJS ARGS...: EXECS `node openclaw.mjs ARGS...` in RUN_DIR with
# the gateway's isolated environment, inside NETNS_V when set. It replaces the calling shell, so call
# it in a subshell: `in_gateway_env ... &` (then $! is the gateway's PID) or `( in_gateway_env ... )`.
# The token lives only in the config file (gateway.auth.token), never in the environment.
# TMPDIR is persistent under the cache dir: the launcher keys Node's compile cache on os.tmpdir(),
# so a fresh TMPDIR per run costs ~4 s of start-up.
in_gateway_env() {
  local rd="$1" node="$2" mjs="$3"
  shift 3
  cd "$rd" || exit 1
  exec "${NSX[@]}" env -i \
      PATH="$(dirname "$node"):/usr/local/bin:/usr/bin:/bin" \
      HOME="$rd/home" \
      TMPDIR="$CACHE/gateway-tmp" \
      LANG=C.UTF-8 \
      OPENCLAW_CONFIG_PATH="$rd/openclaw.json" \
      OPENCLAW_STATE_DIR="$rd/state" \
      OPENCLAW_NO_AUTO_UPDATE=1 \
      OPENCLAW_DISABLE_BONJOUR=1 \
      DO_NOT_TRACK=1 \
      NO_COLOR=1 \
      "$node" "$mjs" "$@"
}

# launch_gateway RUN_DIR NODE_BIN OPENCLAW_MJS GW_PORT: start in the background, write gateway.pid.
# In NETNS_V, `ip netns exec` execs the gateway in place (same PID), so the PID file stays valid.
launch_gateway() {
  local rd="$1" node="$2" mjs="$3" port="$4" pid bind=loopback
  [ -z "${BIND_HOST_V:-}" ] || bind=custom
  mkdir -p "$rd/home" "$rd/state" "$CACHE/gateway-tmp"
  in_gateway_env "$rd" "$node" "$mjs" gateway run --port "$port" --bind "$bind" --auth token \
    </dev/null >>"$rd/gateway.log" 2>&1 &
  pid=$!
  echo "$pid" >"$rd/gateway.pid"
}

# port_free PORT: nothing listens on 127.0.0.1:PORT nor [::1]:PORT (nor BIND_HOST:PORT; all of
# them inside NETNS_V when set)
port_free() {
  "${NSX[@]}" python3 - "$1" "${BIND_HOST_V:-}" <<'PY'
import socket, sys
port = int(sys.argv[1])
hosts = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
if sys.argv[2]:
    hosts.append((socket.AF_INET, sys.argv[2]))
for fam, host in hosts:
    try:
        s = socket.socket(fam, socket.SOCK_STREAM)
    except OSError:
        continue
    try:
        # SO_REUSEADDR as Node's listen() uses: only a LISTENing socket makes the port busy,
        # TIME_WAIT leftovers of a killed gateway's connections do not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as e:
        if e.errno == 98:
            sys.exit(1)
    finally:
        s.close()
PY
}

# wait_ready RUN_DIR PORT PID: poll GET /readyz until "ready":true; fail if PID dies or on timeout.
# "Ready" counts only when the socket listening on HOST:PORT belongs to PID or one of its
# descendants (so another process on that port cannot fake readiness). HOST is BIND_HOST or
# 127.0.0.1; with NETNS_V the probe runs inside the namespace (/proc/net/tcp is then its table).
wait_ready() {
  "${NSX[@]}" python3 - "$2" "$3" "$READY_TIMEOUT" "$(gw_host)" <<'PY'
import os, sys, time, urllib.request
port, pid, timeout, host = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

def state(p):
    try:
        with open(f"/proc/{p}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None

def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out

def listen_inodes():
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except OSError:
            pass
    return inodes

def owned_by_tree():
    want = {f"socket:[{i}]" for i in listen_inodes()}
    for p in tree(pid):
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    if os.readlink(f"/proc/{p}/fd/{fd}") in want:
                        return True
                except OSError:
                    pass
        except OSError:
            pass
    return False

deadline = time.monotonic() + timeout
last = ""
while time.monotonic() < deadline:
    if state(pid) in (None, "Z"):
        print(f"gateway process {pid} exited before it was ready", file=sys.stderr)
        sys.exit(3)
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=2) as r:
            last = r.read().decode(errors="replace")
    except Exception as e:  # not listening yet, or 503 while starting
        body = getattr(e, "read", None)
        last = body().decode(errors="replace") if body else repr(e)
    if '"ready":true' in last.replace(" ", ""):
        if owned_by_tree():
            sys.exit(0)
        last = f"/readyz answered, but {host}:{port} is not served by pid {pid} or its children"
    time.sleep(0.1)
print(f"gateway not ready after {timeout:.0f} s; last /readyz answer: {last[:300]}", file=sys.stderr)
sys.exit(4)
PY
}

fail_with_logs() { # RUN_DIR MESSAGE
  say "$2"
  say "---- tail of $1/gateway.log ----"
  tail -n 60 "$1/gateway.log" >&2 2>/dev/null || true
  say "---- tail of $1/fake_llm.log ----"
  tail -n 20 "$1/fake_llm.log" >&2 2>/dev/null || true
}

write_env() { # RUN_DIR: from shell variables set by the caller
  local rd="$1"
  cat >"$rd/env.tmp" <<EOF
GATEWAY_URL=ws://$(gw_host):$GW_PORT_V
GATEWAY_HOST=$(gw_host)
GATEWAY_TOKEN=$TOKEN_V
GATEWAY_PORT=$GW_PORT_V
LLM_PORT=$LLM_PORT_V
LLM_LOG=$rd/llm-requests.jsonl
GATEWAY_PID=$GW_PID_V
LLM_PID=$LLM_PID_V
GATEWAY_FLAVOR=$FLAVOR_V
GATEWAY_LOG=$rd/gateway.log
LLM_BASE_URL=http://127.0.0.1:$LLM_PORT_V/v1
RUN_DIR=$rd
NODE_BIN=$NODE_BIN_V
OPENCLAW_MJS=$OPENCLAW_MJS_V
PROVIDER_BASE_URL=${PROVIDER_BASE_URL_V:-}
PROXY_PORT=${PROXY_PORT_V:-}
NETNS=${NETNS_V:-}
BIND_HOST=${BIND_HOST_V:-}
EOF
  mv -f "$rd/env.tmp" "$rd/env"
}

# ------------------------------------------------------------------ commands

cmd_start() {
  local rd flavor template t0 llm_pid gw_pid out
  [ $# -ge 1 ] || usage
  flavor="${2:-v4}"
  case "$flavor" in
    v4) template="$REPO/images/openclaw/openclaw.json" ;;
    v3) template="$REPO/images/openclaw/openclaw-v3.json" ;;
    *) die "flavor must be v4 or v3, not '$flavor'" ;;
  esac
  [ -f "$template" ] || die "missing config template $template"
  rd="$(run_dir_abs "$1")"
  if ours "$(read_pid "$rd/gateway.pid")" openclaw || ours "$(read_pid "$rd/fake_llm.pid")" fake_llm; then
    die "$rd already has a running gateway/fake LLM (pids $(read_pid "$rd/gateway.pid") $(read_pid "$rd/fake_llm.pid")); run: $0 stop $rd"
  fi
  # fresh run: remove what a previous run in this dir left (only our own files)
  rm -rf "${rd:?}/home" "${rd:?}/state"
  rm -f "$rd/env" "$rd/env.tmp" "$rd/openclaw.json" "$rd/gateway.log" "$rd/gateway-file.log" \
    "$rd/fake_llm.log" "$rd/llm-requests.jsonl" "$rd/llm.port" "$rd/gateway.pid" "$rd/fake_llm.pid"

  if [ -n "${CLAWMUX_NODE_BIN:-}" ] && [ -n "${CLAWMUX_OPENCLAW_MJS:-}" ]; then
    NODE_BIN_V="$CLAWMUX_NODE_BIN"
    OPENCLAW_MJS_V="$CLAWMUX_OPENCLAW_MJS"
  else
    out="$("$HERE/install-openclaw.sh" "$flavor")" || die "install-openclaw.sh $flavor failed"
    NODE_BIN_V="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_NODE_BIN=//p')"
    OPENCLAW_MJS_V="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_OPENCLAW_MJS=//p')"
  fi
  [ -x "$NODE_BIN_V" ] || die "node not found: $NODE_BIN_V"
  [ -f "$OPENCLAW_MJS_V" ] || die "openclaw.mjs not found: $OPENCLAW_MJS_V"
  FLAVOR_V="$flavor"
  NETNS_V="${NETNS:-}"
  BIND_HOST_V="${BIND_HOST:-}"
  set_netns

  TOKEN_V="$(python3 -c 'import secrets; print(secrets.token_hex(24))')"
  GW_PORT_V="${GW_PORT:-$(free_port)}"
  port_free "$GW_PORT_V" || die "port $GW_PORT_V is already in use on 127.0.0.1, [::1] or ${BIND_HOST_V:-127.0.0.1}${NETNS_V:+ in namespace $NETNS_V}"
  t0="$(now)"

  # 1) fake LLM (a fixed LLM_PORT, or port 0 = the kernel picks one; it writes llm.port); in
  #    NETNS_V it listens on the namespace's own 127.0.0.1, next to the gateway
  FAKE_LLM_PORT="${LLM_PORT:-0}" FAKE_LLM_PORT_FILE="$rd/llm.port" FAKE_LLM_LOG="$rd/llm-requests.jsonl" \
    "${NSX[@]}" python3 "$HERE/fake_llm.py" </dev/null >"$rd/fake_llm.log" 2>&1 &
  llm_pid=$!
  echo "$llm_pid" >"$rd/fake_llm.pid"
  LLM_PID_V="$llm_pid"
  for _ in $(seq 1 100); do
    [ -s "$rd/llm.port" ] && break
    alive "$llm_pid" || break
    sleep 0.05
  done
  if [ ! -s "$rd/llm.port" ]; then
    fail_with_logs "$rd" "fake LLM did not start"
    stop_pid fake_llm "$llm_pid"
    exit 1
  fi
  LLM_PORT_V="$(tr -dc '0-9' <"$rd/llm.port")"
  PROVIDER_BASE_URL_V="${PROVIDER_BASE_URL:-http://127.0.0.1:$LLM_PORT_V/v1}"
  PROXY_PORT_V="${PROXY_PORT:-}"

  # 2) config from the template
  python3 - "$template" "$rd/openclaw.json" "$GW_PORT_V" "$LLM_PORT_V" "$TOKEN_V" "$rd" "${BIND_HOST_V:-}" <<'PY'
import json, os, sys
src, dst, gw, llm, tok, rd, bind_host = sys.argv[1:]
with open(src) as f:
    c = json.load(f)
c["gateway"]["port"] = int(gw)
c["gateway"]["auth"] = {"mode": "token", "token": tok}
if bind_host:
    c["gateway"]["bind"] = "custom"
    c["gateway"]["customBindHost"] = bind_host
c["models"]["providers"]["cogni"]["baseUrl"] = os.environ.get("PROVIDER_BASE_URL") or f"http://127.0.0.1:{llm}/v1"
c.setdefault("logging", {})["file"] = os.path.join(rd, "gateway-file.log")
fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(c, f, indent=2)
    f.write("\n")
PY

  # 3) gateway
  launch_gateway "$rd" "$NODE_BIN_V" "$OPENCLAW_MJS_V" "$GW_PORT_V"
  gw_pid="$(read_pid "$rd/gateway.pid")"
  GW_PID_V="$gw_pid"
  if ! wait_ready "$rd" "$GW_PORT_V" "$gw_pid"; then
    fail_with_logs "$rd" "gateway ($flavor) failed to become ready on $(gw_host):$GW_PORT_V${NETNS_V:+ in namespace $NETNS_V}"
    stop_pid gateway "$gw_pid"
    stop_pid fake_llm "$llm_pid"
    exit 1
  fi
  write_env "$rd"
  say "ready after $(elapsed "$t0") s: $flavor gateway pid $gw_pid on ws://$(gw_host):$GW_PORT_V, fake LLM pid $llm_pid on 127.0.0.1:$LLM_PORT_V${NETNS_V:+ (both in namespace $NETNS_V)}; env: $rd/env"
}

cmd_stop() {
  local rd gw llm
  [ $# -ge 1 ] || usage
  [ -d "$1" ] || { say "no such dir $1; nothing to stop"; return 0; }
  rd="$(cd "$1" && pwd -P)"
  gw="$(read_pid "$rd/gateway.pid")"
  llm="$(read_pid "$rd/fake_llm.pid")"
  if ours "$gw" openclaw; then stop_pid gateway "$gw"; say "stopped gateway ($gw)"; fi
  if ours "$llm" fake_llm; then stop_pid fake_llm "$llm"; say "stopped fake LLM ($llm)"; fi
  rm -f "$rd/gateway.pid" "$rd/fake_llm.pid"
}

cmd_restart_gateway() {
  local rd old kids k t0
  [ $# -ge 1 ] || usage
  rd="$(cd "$1" 2>/dev/null && pwd -P)" || die "no such dir $1"
  [ -f "$rd/env" ] || die "$rd/env missing: was '$0 start $rd' run?"
  GW_PORT_V="$(env_get "$rd" GATEWAY_PORT)"
  TOKEN_V="$(env_get "$rd" GATEWAY_TOKEN)"
  LLM_PORT_V="$(env_get "$rd" LLM_PORT)"
  LLM_PID_V="$(env_get "$rd" LLM_PID)"
  FLAVOR_V="$(env_get "$rd" GATEWAY_FLAVOR)"
  NODE_BIN_V="$(env_get "$rd" NODE_BIN)"
  OPENCLAW_MJS_V="$(env_get "$rd" OPENCLAW_MJS)"
  PROVIDER_BASE_URL_V="$(env_get "$rd" PROVIDER_BASE_URL || true)"
  PROXY_PORT_V="$(env_get "$rd" PROXY_PORT || true)"
  NETNS_V="$(env_get "$rd" NETNS || true)"
  BIND_HOST_V="$(env_get "$rd" BIND_HOST || true)"
  set_netns
  old="$(read_pid "$rd/gateway.pid")"
  if ours "$old" openclaw; then
    kids="$(descendants "$old")"
    kill -KILL "$old" 2>/dev/null || true
    for _ in $(seq 1 50); do alive "$old" || break; sleep 0.1; done
    for k in $kids; do
      if alive "$k"; then kill -KILL "$k" 2>/dev/null || true; fi
    done
    say "killed gateway ($old) with SIGKILL"
  fi
  for _ in $(seq 1 50); do port_free "$GW_PORT_V" && break; sleep 0.1; done
  port_free "$GW_PORT_V" || die "port $GW_PORT_V is still in use after killing the gateway"
  printf '\n===== restart-gateway %s =====\n' "$(date -u +%FT%TZ)" >>"$rd/gateway.log"
  t0="$(now)"
  launch_gateway "$rd" "$NODE_BIN_V" "$OPENCLAW_MJS_V" "$GW_PORT_V"
  GW_PID_V="$(read_pid "$rd/gateway.pid")"
  if ! wait_ready "$rd" "$GW_PORT_V" "$GW_PID_V"; then
    fail_with_logs "$rd" "restarted gateway failed to become ready on $(gw_host):$GW_PORT_V${NETNS_V:+ in namespace $NETNS_V}"
    stop_pid gateway "$GW_PID_V"
    exit 1
  fi
  write_env "$rd"
  say "gateway restarted, ready after $(elapsed "$t0") s: pid $GW_PID_V on ws://$(gw_host):$GW_PORT_V${NETNS_V:+ in namespace $NETNS_V}"
}

cmd_status() {
  local rd gw llm
  [ $# -ge 1 ] || usage
  rd="$(cd "$1" 2>/dev/null && pwd -P)" || die "no such dir $1"
  [ -f "$rd/env" ] && cat "$rd/env"
  gw="$(read_pid "$rd/gateway.pid")"
  llm="$(read_pid "$rd/fake_llm.pid")"
  alive "$gw" && alive "$llm"
}

# oc RUN_DIR ARGS...: the gateway's own CLI against that gateway's config and state (same env as
# launch_gateway; inside NETNS_V when set). The token is read by the CLI from the config file.
oc() {
  local rd="$1"
  shift
  ( in_gateway_env "$rd" "$NODE_BIN_V" "$OPENCLAW_MJS_V" "$@" ) </dev/null
}

cmd_approve_device() {
  local rd want list pick req dev out t0 deadline
  [ $# -ge 1 ] || usage
  rd="$(cd "$1" 2>/dev/null && pwd -P)" || die "no such dir $1"
  want="${2:-}"
  [ -f "$rd/env" ] || die "$rd/env missing: was '$0 start $rd' run?"
  ours "$(read_pid "$rd/gateway.pid")" openclaw || die "no gateway running for $rd"
  NODE_BIN_V="$(env_get "$rd" NODE_BIN)"
  OPENCLAW_MJS_V="$(env_get "$rd" OPENCLAW_MJS)"
  NETNS_V="$(env_get "$rd" NETNS || true)"
  BIND_HOST_V="$(env_get "$rd" BIND_HOST || true)"
  set_netns
  t0="$(now)"
  deadline=$(( $(date +%s) + ${APPROVE_WAIT:-0} ))
  while :; do
    list="$(oc "$rd" devices list --json 2>"$rd/approve.err")" ||
      { cat "$rd/approve.err" >&2; die "openclaw devices list --json failed"; }
    printf 'gateway.sh: openclaw devices list --json:\n%s\n' "$list" >&2
    # -> "requestId deviceId" of the one pending request to approve; exit 2: none matches yet,
    # exit 3: ambiguous
    pick="$(printf '%s' "$list" | python3 -c '
import json, sys
want = sys.argv[1]
text = sys.stdin.read()
doc = json.loads(text[text.index("{"):])
pending = doc.get("pending") or []
if want:
    hits = [p for p in pending if want in (p.get("requestId"), p.get("deviceId"))]
else:
    hits = pending
if not hits:
    sys.exit(2)
if len(hits) > 1:
    print("; ".join("%s (device %s)" % (p.get("requestId"), p.get("deviceId")) for p in hits))
    sys.exit(3)
print(hits[0]["requestId"], hits[0].get("deviceId", ""))
' "$want")" && break
    case $? in
      3) die "more than one pending request; name one (request id or device id): $pick" ;;
      2) ;;
      *) die "cannot parse the output of openclaw devices list --json" ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
      die "no pending device pairing request${want:+ matching $want}"
    fi
    sleep 1
  done
  req="${pick%% *}"
  dev="${pick#* }"
  say "approving request $req (device $dev): openclaw devices approve $req --json"
  out="$(oc "$rd" devices approve "$req" --json 2>"$rd/approve.err")" ||
    { cat "$rd/approve.err" >&2; die "openclaw devices approve $req failed"; }
  printf 'gateway.sh: openclaw devices approve %s --json:\n%s\n' "$req" "$out" >&2
  # the CLI answers {"requestId", "device": {"deviceId", ...}}; check it approved that device
  printf '%s' "$out" | python3 -c '
import json, sys
text = sys.stdin.read()
doc = json.loads(text[text.index("{"):])
dev = (doc.get("device") or {}).get("deviceId")
if sys.argv[1] and dev != sys.argv[1]:
    sys.exit(f"gateway.sh: approve answered device {dev!r}, expected {sys.argv[1]!r}")
' "$dev" || die "unexpected answer from openclaw devices approve"
  say "approved after $(elapsed "$t0") s"
  printf 'approved requestId=%s deviceId=%s\n' "$req" "$dev"
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
case "$cmd" in
  start) cmd_start "$@" ;;
  stop) cmd_stop "$@" ;;
  restart-gateway) cmd_restart_gateway "$@" ;;
  status) cmd_status "$@" ;;
  approve-device) cmd_approve_device "$@" ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
