#!/usr/bin/env bash
# Start/stop a REAL LiteLLM proxy in front of the project's fake LLM, on 127.0.0.1, for tests.
#
#   tests/support/litellm.sh start DIR   # fake LLM + LiteLLM on free ports; waits until ready
#   tests/support/litellm.sh stop DIR    # stops both, by the PIDs recorded in DIR
#
# `start` writes DIR/env (mode 600), one KEY=VALUE a line:
#   LITELLM_URL=http://127.0.0.1:P   LiteLLM's root (clawmux's CLAWMUX_LLM_UPSTREAM_URL)
#   LITELLM_KEY=sk-...               LiteLLM's master key (clawmux's CLAWMUX_LLM_UPSTREAM_KEY)
#   SPEND_LOG=DIR/spend.jsonl        LiteLLM's spend records, one JSON object a line
#   LITELLM_PID, LLM_PID, LLM_PORT, LLM_LOG (the fake LLM's request log), LITELLM_LOG,
#   LITELLM_VERSION, RUN_DIR
#
# LiteLLM (tests/support/install-litellm.sh; CLAWMUX_LITELLM_BIN skips that call) runs with
# tests/support/litellm/config.yaml.in: one model `fake-model` = openai/fake-model at the fake
# LLM, the master key from the environment, and the callback clawmux_spend_log.handler.
#
# Offline, on purpose:
#   - LITELLM_LOCAL_MODEL_COST_MAP=True: LiteLLM reads the model cost map shipped in the package
#     instead of fetching it at start (without it, offline, each start spends ~8 s in 3 failed
#     fetches before falling back to the same local copy).
#   - no DATABASE_URL: LiteLLM's own spend-log table (LiteLLM_SpendLogs, behind /spend/logs)
#     lives in PostgreSQL through Prisma, and `prisma generate` downloads Prisma's query engine
#     from a host that is not a package registry; offline it fails with
#       Error: request to https://binaries.prisma.sh/all_commits/<commit>/debian-openssl-3.0.x/query-engine.gz.sha256
#       failed, reason: getaddrinfo ENOTFOUND binaries.prisma.sh
#     So the spend records come from clawmux_spend_log.py: for every call LiteLLM finishes it
#     writes the LiteLLM_SpendLogs row LiteLLM's DB writer would insert (LiteLLM's own
#     get_logging_payload, spend = LiteLLM's response_cost) and LiteLLM's standard logging payload
#     (end_user, spend_logs_metadata, tokens, cost, call id) to SPEND_LOG.
#   - telemetry: LiteLLM 1.106's `--telemetry` is a no-op kept for old command lines; nothing
#     phones home (checked with strace: the only connect() calls go to the fake LLM).
#
# Env: CLAWMUX_CACHE (install cache), CLAWMUX_LITELLM_BIN (a litellm launcher to use),
#      LITELLM_READY_TIMEOUT (s, default 180), LITELLM_PORT / LLM_PORT (fixed ports; default free).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
READY_TIMEOUT="${LITELLM_READY_TIMEOUT:-180}"

say() { printf 'litellm.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
usage() { sed -n '2,5p' "${BASH_SOURCE[0]}" >&2; exit 2; }
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
read_pid() { [ -f "$1" ] && tr -dc '0-9' <"$1" || true; }
alive() { [ -n "$1" ] && [ -e "/proc/$1" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
# ours PID WORD: PID is alive and its command line mentions WORD (a recycled PID is left alone)
ours() { alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "$2"; }
descendants() { # PID: every descendant pid, children first
  local kid
  for kid in $(cat "/proc/$1/task/"*/children 2>/dev/null); do
    descendants "$kid"
    echo "$kid"
  done
}
stop_pid() { # NAME PID: TERM, then KILL after 10 s; its descendants too
  local name="$1" pid="$2" kids k
  alive "$pid" || return 0
  kids="$(descendants "$pid")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    say "$name ($pid) ignored SIGTERM for 10 s; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  for k in $kids; do
    if alive "$k"; then kill -KILL "$k" 2>/dev/null || true; fi
  done
}
env_get() { sed -n "s/^$2=//p" "$1/env" 2>/dev/null | head -1; }

# wait_ready PORT PID: /health/readiness answers 200 on PORT and PORT is served by PID (bounded)
wait_ready() {
  python3 - "$1" "$2" "$READY_TIMEOUT" <<'PY'
import os, sys, time, urllib.request
port, pid, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def state(p):
    try:
        with open(f"/proc/{p}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None

def served_by_pid():
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{cols[9]}]")
        except OSError:
            pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
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
        print(f"LiteLLM process {pid} exited before it was ready", file=sys.stderr)
        sys.exit(3)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/readiness", timeout=5) as r:
            last = f"{r.status} {r.read().decode(errors='replace')}"
            if r.status == 200:
                if served_by_pid():
                    sys.exit(0)
                last = f"/health/readiness answered, but 127.0.0.1:{port} is not served by pid {pid}"
    except Exception as e:  # not listening yet
        body = getattr(e, "read", None)
        last = body().decode(errors="replace") if body else repr(e)
    time.sleep(0.2)
print(f"LiteLLM not ready after {timeout:.0f} s; last /health/readiness answer: {last[:300]}", file=sys.stderr)
sys.exit(4)
PY
}

fail_with_logs() { # DIR MESSAGE
  say "$2"
  say "---- tail of $1/litellm.log ----"
  tail -n 60 "$1/litellm.log" >&2 2>/dev/null || true
  say "---- tail of $1/fake_llm.log ----"
  tail -n 20 "$1/fake_llm.log" >&2 2>/dev/null || true
}

cmd_start() {
  local rd t0 llm_pid llm_port ll_pid ll_port key bin out version
  [ $# -ge 1 ] || usage
  mkdir -p "$1"
  rd="$(cd "$1" && pwd -P)"
  if ours "$(read_pid "$rd/litellm.pid")" litellm || ours "$(read_pid "$rd/fake_llm.pid")" fake_llm; then
    die "$rd already has a running LiteLLM/fake LLM (pids $(read_pid "$rd/litellm.pid") $(read_pid "$rd/fake_llm.pid")); run: $0 stop $rd"
  fi
  rm -f "$rd/env" "$rd/env.tmp" "$rd/config.yaml" "$rd/litellm.log" "$rd/fake_llm.log" "$rd/llm-requests.jsonl" \
    "$rd/llm.port" "$rd/spend.jsonl" "$rd/litellm.pid" "$rd/fake_llm.pid"

  if [ -n "${CLAWMUX_LITELLM_BIN:-}" ]; then
    bin="$CLAWMUX_LITELLM_BIN"
  else
    out="$("$HERE/install-litellm.sh")" || die "install-litellm.sh failed"
    bin="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_LITELLM_BIN=//p')"
  fi
  [ -x "$bin" ] || die "litellm launcher not found: $bin"
  version="$("$(dirname "$bin")/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' 2>/dev/null || echo unknown)"
  t0="$(now)"

  # 1) the fake LLM (port 0 = the kernel picks one; it writes llm.port)
  FAKE_LLM_PORT="${LLM_PORT:-0}" FAKE_LLM_PORT_FILE="$rd/llm.port" FAKE_LLM_LOG="$rd/llm-requests.jsonl" \
    python3 "$HERE/fake_llm.py" </dev/null >"$rd/fake_llm.log" 2>&1 &
  llm_pid=$!
  echo "$llm_pid" >"$rd/fake_llm.pid"
  for _ in $(seq 1 200); do
    [ -s "$rd/llm.port" ] && break
    alive "$llm_pid" || break
    sleep 0.05
  done
  if [ ! -s "$rd/llm.port" ]; then
    fail_with_logs "$rd" "the fake LLM did not start"
    stop_pid fake_llm "$llm_pid"
    exit 1
  fi
  llm_port="$(tr -dc '0-9' <"$rd/llm.port")"

  # 2) LiteLLM's config and key
  sed "s/@FAKE_LLM_PORT@/$llm_port/g" "$HERE/litellm/config.yaml.in" >"$rd/config.yaml"
  key="sk-clawmux-test-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
  ll_port="${LITELLM_PORT:-$(free_port)}"

  # 3) LiteLLM: no database, cost map from the package, our callback on PYTHONPATH.
  (
    cd "$rd"
    exec env -u DATABASE_URL -u DIRECT_URL -u REDIS_HOST -u REDIS_URL \
      LITELLM_LOCAL_MODEL_COST_MAP=True \
      LITELLM_MASTER_KEY="$key" \
      CLAWMUX_LITELLM_SPEND_LOG="$rd/spend.jsonl" \
      PYTHONPATH="$HERE/litellm${PYTHONPATH:+:$PYTHONPATH}" \
      PYTHONUNBUFFERED=1 \
      "$bin" --config "$rd/config.yaml" --host 127.0.0.1 --port "$ll_port" --num_workers 1
  ) </dev/null >"$rd/litellm.log" 2>&1 &
  ll_pid=$!
  echo "$ll_pid" >"$rd/litellm.pid"
  if ! wait_ready "$ll_port" "$ll_pid"; then
    fail_with_logs "$rd" "LiteLLM failed to become ready on 127.0.0.1:$ll_port"
    stop_pid litellm "$ll_pid"
    stop_pid fake_llm "$llm_pid"
    exit 1
  fi

  (
    umask 077
    cat >"$rd/env.tmp" <<EOF
LITELLM_URL=http://127.0.0.1:$ll_port
LITELLM_KEY=$key
SPEND_LOG=$rd/spend.jsonl
LITELLM_PID=$ll_pid
LLM_PID=$llm_pid
LLM_PORT=$llm_port
LLM_LOG=$rd/llm-requests.jsonl
LITELLM_LOG=$rd/litellm.log
LITELLM_VERSION=$version
RUN_DIR=$rd
EOF
  )
  mv -f "$rd/env.tmp" "$rd/env"
  say "ready after $(elapsed "$t0") s: LiteLLM $version pid $ll_pid on http://127.0.0.1:$ll_port, fake LLM pid $llm_pid on 127.0.0.1:$llm_port; env: $rd/env"
}

cmd_stop() {
  local rd ll llm
  [ $# -ge 1 ] || usage
  [ -d "$1" ] || { say "no such dir $1; nothing to stop"; return 0; }
  rd="$(cd "$1" && pwd -P)"
  ll="$(read_pid "$rd/litellm.pid")"
  llm="$(read_pid "$rd/fake_llm.pid")"
  if ours "$ll" litellm; then stop_pid litellm "$ll"; say "stopped LiteLLM ($ll)"; fi
  if ours "$llm" fake_llm; then stop_pid fake_llm "$llm"; say "stopped fake LLM ($llm)"; fi
  rm -f "$rd/litellm.pid" "$rd/fake_llm.pid"
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
case "$cmd" in
  start) cmd_start "$@" ;;
  stop) cmd_stop "$@" ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
