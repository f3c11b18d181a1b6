#!/usr/bin/env bash
# A live clawmux for the checks that need a real process over HTTP (schemathesis, promtool, the
# dashboard's queries): `clawmux replay-gateway` + the fake LLM (tests/support/fake_llm.py) as
# the LLM proxy's upstream + `clawmux serve`, all on 127.0.0.1, stopped by their PIDs.
#
#   tests/support/stack.sh start DIR   start all three, wait for /readyz, write DIR/env
#   tests/support/stack.sh stop DIR    stop what DIR/*.pid names (only if it is still ours)
#
# DIR/env (KEY=VALUE lines, also valid shell):
#   CLAWMUX_URL=http://127.0.0.1:<port>   PROXY_URL=http://127.0.0.1:<port>
#   CLAWMUX_API_TOKEN=<random hex>        (the admin token; only in this file, mode 0600, and in
#                                          the environment of the processes that need it)
#   AUDIT_DIR=DIR/audit                   LOG_DIR=DIR
#
# Env: CLAWMUX_BIN (default: $CARGO_TARGET_DIR/debug/clawmux, else target/debug/clawmux; built by
# tests/run.sh's build step), REPLAY_SPEED (default 0: runs end at once).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
ROOT="$(cd "$HERE/../.." && pwd -P)"
say() { printf 'stack: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

clawmux_bin() {
  if [ -n "${CLAWMUX_BIN:-}" ]; then printf '%s' "$CLAWMUX_BIN"; return; fi
  printf '%s' "${CARGO_TARGET_DIR:-$ROOT/target}/debug/clawmux"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits (bounded) until $1 (a URL) answers 200.
wait_http() {
  local url="$1" what="$2" i
  for i in $(seq 1 200); do
    if curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  die "$what did not answer $url within 20 s"
}

# Is PID alive and running the command we started (a reused PID is someone else's)?
ours() {
  local pid="$1" pattern="$2"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$pattern"
}

stop_pid() {
  local file="$1" pattern="$2" pid
  [ -f "$file" ] || return 0
  pid="$(cat "$file")"
  if ours "$pid" "$pattern"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    say "stopped $pattern ($pid)"
  fi
  rm -f "$file"
}

cmd_start() {
  local dir bin gw_port api_port proxy_port token gw_token llm_port
  dir="$(mkdir -p "$1" && cd "$1" && pwd -P)"
  bin="$(clawmux_bin)"
  [ -x "$bin" ] || die "no clawmux binary at $bin (cargo build first, or set CLAWMUX_BIN)"
  token="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
  gw_token="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"

  FAKE_LLM_PORT=0 FAKE_LLM_PORT_FILE="$dir/llm.port" FAKE_LLM_LOG="$dir/llm-requests.jsonl" \
    python3 "$HERE/fake_llm.py" >"$dir/fake_llm.log" 2>&1 &
  echo $! >"$dir/fake_llm.pid"
  for _ in $(seq 1 100); do [ -s "$dir/llm.port" ] && break; sleep 0.1; done
  llm_port="$(cat "$dir/llm.port" 2>/dev/null)" || die "the fake LLM did not start ($dir/fake_llm.log)"

  gw_port="$(free_port)"
  CLAWMUX_REPLAY_TOKEN="$gw_token" "$bin" replay-gateway --listen "127.0.0.1:$gw_port" --speed "${REPLAY_SPEED:-0}" \
    >"$dir/replay-gateway.log" 2>&1 &
  echo $! >"$dir/replay-gateway.pid"

  api_port="$(free_port)"
  proxy_port="$(free_port)"
  CLAWMUX_LISTEN="127.0.0.1:$api_port" CLAWMUX_API_TOKEN="$token" \
    CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$gw_port" CLAWMUX_GATEWAY_TOKEN="$gw_token" \
    CLAWMUX_STORE_URL="sqlite://$dir/runs.db" CLAWMUX_DEVICE_IDENTITY=off \
    CLAWMUX_LLM_UPSTREAM_URL="http://127.0.0.1:$llm_port" CLAWMUX_PROXY_LISTEN="127.0.0.1:$proxy_port" \
    CLAWMUX_AUDIT_DIR="$dir/audit" CLAWMUX_LOG="${CLAWMUX_LOG:-warn}" \
    "$bin" serve >"$dir/clawmux.log" 2>&1 &
  echo $! >"$dir/clawmux.pid"
  wait_http "http://127.0.0.1:$api_port/readyz" "clawmux (log: $dir/clawmux.log)"

  umask 077
  cat >"$dir/env" <<EOF
CLAWMUX_URL=http://127.0.0.1:$api_port
PROXY_URL=http://127.0.0.1:$proxy_port
CLAWMUX_API_TOKEN=$token
AUDIT_DIR=$dir/audit
LOG_DIR=$dir
EOF
  say "clawmux on http://127.0.0.1:$api_port (replay gateway :$gw_port, LLM proxy :$proxy_port -> fake LLM :$llm_port)"
}

cmd_stop() {
  local dir="$1"
  [ -d "$dir" ] || return 0
  stop_pid "$dir/clawmux.pid" "clawmux serve"
  stop_pid "$dir/replay-gateway.pid" "clawmux replay-gateway"
  stop_pid "$dir/fake_llm.pid" "fake_llm.py"
}

case "${1:-}" in
  start) [ $# -eq 2 ] || die "usage: $0 start DIR"; cmd_start "$2" ;;
  stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; cmd_stop "$2" ;;
  *) die "usage: $0 start|stop DIR" ;;
esac
