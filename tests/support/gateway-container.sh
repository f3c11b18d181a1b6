#!/usr/bin/env bash
# The REAL OpenClaw gateway (openclaw@2026.9.6, Node 24) inside a Docker container, with a git
# workspace for the agent, a fake LLM on the host and a host bare repository as the relay's remote.
#
#   tests/support/gateway-container.sh start DIR   fake LLM + container + workspace; waits for
#                                                  /readyz; writes DIR/env (below)
#   tests/support/gateway-container.sh stop DIR    removes the container (by id), stops the fake
#                                                  LLM (by PID); keeps DIR (logs, origin.git)
#   tests/support/gateway-container.sh status DIR  prints DIR/env; exit 1 unless both run
#
# The container: the offline base image (tests/support/docker-image.sh), `--init`, `--network host`,
# the gateway bound to loopback with token auth (the token is ONLY in the config file, never in the
# container's environment), Node 24 and openclaw bind-mounted read-only from the cache
# (tests/support/install-openclaw.sh), HOME/state/config/TMPDIR/logs in the writable mount DIR/oc
# (= /oc), run as CTR_USER (default 1000:1000, which owns /oc and /workspace). The config is
# images/openclaw/openclaw.json with images/openclaw/agent.json merged in (exec on the gateway, no
# approvals, `process` denied, sandbox off), the provider's baseUrl = PROVIDER_BASE_URL or the
# fake LLM. The workspace: DIR/origin.git is a host bare repo with one commit on `main`; its bundle
# is cloned to /workspace/repo inside the container AS THE GATEWAY'S UID (so git never says
# "dubious ownership"), with user.name/email set: host and container share the base commit.
#
# DIR/env (KEY=VALUE, no quoting; also valid shell):
#   GATEWAY_URL=ws://127.0.0.1:<port>  GATEWAY_TOKEN  GATEWAY_PORT  CONTAINER_ID  CONTAINER_NAME
#   CONTAINER_USER  IMAGE  WORKSPACE=/workspace  BASE_REF=main  ORIGIN=<DIR>/origin.git
#   LLM_PORT  LLM_PID  LLM_LOG  LLM_BASE_URL  RUN_DIR  READY_SECONDS
#
# Env: CLAWMUX_CACHE, CTR_USER (uid:gid, default 1000:1000), GW_PORT (default: a free port),
#      PROVIDER_BASE_URL, GATEWAY_READY_TIMEOUT (default 120 s), CLAWMUX_BASE_IMAGE,
#      CLAWMUX_NODE_BIN + CLAWMUX_OPENCLAW_MJS (default: install-openclaw.sh's), FAKE_LLM_* (passed on).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
READY_TIMEOUT="${GATEWAY_READY_TIMEOUT:-120}"
CTR_USER="${CTR_USER:-1000:1000}"

say() { printf 'gateway-container.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
usage() { sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

alive() {
  local st
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
  st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}
ours() { alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "$2"; }
read_pid() { if [ -f "$1" ]; then tr -dc '0-9' <"$1"; fi; }
env_get() { sed -n "s/^$2=//p" "$1/env" 2>/dev/null | tail -1; }

stop_pid() { # NAME PID: TERM, up to 5 s, KILL
  alive "$2" || return 0
  kill -TERM "$2" 2>/dev/null || true
  for _ in $(seq 1 50); do alive "$2" || return 0; sleep 0.1; done
  kill -KILL "$2" 2>/dev/null || true
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

cmd_start() {
  [ $# -ge 1 ] || usage
  local rd t0 image node_bin mjs node_prefix oc_prefix node_rel mjs_rel llm_pid port token name cid uid gid
  case "$1" in *[!A-Za-z0-9._/+@:-]*) die "DIR may only contain [A-Za-z0-9._/+@:-]: '$1'" ;; esac
  mkdir -p "$1"
  rd="$(cd "$1" && pwd -P)"
  if [ -f "$rd/container.id" ] && docker inspect "$(cat "$rd/container.id")" >/dev/null 2>&1; then
    die "$rd already has a container ($(cat "$rd/container.id")); run: $0 stop $rd"
  fi
  case "$CTR_USER" in *[!0-9:]* | "") die "CTR_USER must be uid:gid, not '$CTR_USER'" ;; esac
  uid="${CTR_USER%%:*}"; gid="${CTR_USER#*:}"

  # prerequisites: engine, image, node + openclaw
  "$HERE/docker.sh" ensure
  image="$("$HERE/docker-image.sh" | sed -n 's/^IMAGE=//p')"
  [ -n "$image" ] || die "no base image"
  if [ -n "${CLAWMUX_NODE_BIN:-}" ] && [ -n "${CLAWMUX_OPENCLAW_MJS:-}" ]; then
    node_bin="$CLAWMUX_NODE_BIN"; mjs="$CLAWMUX_OPENCLAW_MJS"
  else
    local out; out="$("$HERE/install-openclaw.sh" v4)"
    node_bin="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_NODE_BIN=//p')"
    mjs="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_OPENCLAW_MJS=//p')"
  fi
  [ -x "$node_bin" ] && [ -f "$mjs" ] || die "node ($node_bin) or openclaw.mjs ($mjs) missing"
  # mount the install prefixes (the dirs holding node_modules/) read-only
  node_prefix="${node_bin%%/node_modules/*}"; node_rel="${node_bin#"$node_prefix"/}"
  oc_prefix="${mjs%%/node_modules/*}"; mjs_rel="${mjs#"$oc_prefix"/}"

  # fresh run dir (our own files only)
  rm -rf "${rd:?}/oc" "$rd/origin.git" "$rd/seed" "$rd/main.bundle"
  rm -f "$rd/env" "$rd/container.id" "$rd/fake_llm.pid" "$rd/llm.port" "$rd/llm-requests.jsonl" "$rd/fake_llm.log" "$rd/gateway.log"
  mkdir -p "$rd"/oc/{home,state,logs,tmp} "$CACHE/gateway-container-node-cache"

  # host bare repo (the relay's remote) with one commit on main, and its bundle for the container
  local hg=(git -c user.name=Host\ Seed -c user.email=seed@example.invalid -c init.defaultBranch=main)
  GIT_CONFIG_GLOBAL=/dev/null "${hg[@]}" init -q --bare "$rd/origin.git"
  GIT_CONFIG_GLOBAL=/dev/null "${hg[@]}" init -q "$rd/seed"
  printf '# widgets\n\nA test repository for the clawmux git relay.\n' >"$rd/seed/README.md"
  GIT_CONFIG_GLOBAL=/dev/null "${hg[@]}" -C "$rd/seed" add README.md
  GIT_CONFIG_GLOBAL=/dev/null "${hg[@]}" -C "$rd/seed" commit -q -m "initial commit"
  GIT_CONFIG_GLOBAL=/dev/null "${hg[@]}" -C "$rd/seed" push -q "$rd/origin.git" main
  GIT_CONFIG_GLOBAL=/dev/null git -C "$rd/origin.git" bundle create -q "$rd/oc/tmp/main.bundle" main

  # fake LLM on the host (127.0.0.1; the container shares the host's network)
  FAKE_LLM_PORT=0 FAKE_LLM_PORT_FILE="$rd/llm.port" FAKE_LLM_LOG="$rd/llm-requests.jsonl" \
    python3 "$HERE/fake_llm.py" </dev/null >"$rd/fake_llm.log" 2>&1 &
  llm_pid=$!
  echo "$llm_pid" >"$rd/fake_llm.pid"
  for _ in $(seq 1 100); do [ -s "$rd/llm.port" ] && break; alive "$llm_pid" || break; sleep 0.05; done
  [ -s "$rd/llm.port" ] || { cat "$rd/fake_llm.log" >&2; stop_pid fake_llm "$llm_pid"; die "fake LLM did not start"; }
  LLM_PORT_V="$(tr -dc '0-9' <"$rd/llm.port")"

  # config: openclaw.json + agent.json, port/token/baseUrl/log path filled in; mode 0600
  token="$(python3 -c 'import secrets; print(secrets.token_hex(24))')"
  port="${GW_PORT:-$(free_port)}"
  python3 - "$REPO/images/openclaw/openclaw.json" "$REPO/images/openclaw/agent.json" "$rd/oc/openclaw.json" \
    "$port" "$LLM_PORT_V" "$token" <<'PY'
import json, os, sys
base, overlay, dst, port, llm, tok = sys.argv[1:]
def merge(a, b):
    for k, v in b.items():
        if k == "$comment":
            continue
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            merge(a[k], v)
        else:
            a[k] = v
    return a
c = merge(json.load(open(base)), json.load(open(overlay)))
c["gateway"]["port"] = int(port)
c["gateway"]["bind"] = "loopback"
c["gateway"]["auth"] = {"mode": "token", "token": tok}
c["models"]["providers"]["cogni"]["baseUrl"] = os.environ.get("PROVIDER_BASE_URL") or f"http://127.0.0.1:{llm}/v1"
c.setdefault("logging", {})["file"] = "/oc/logs/gateway-file.log"
fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(c, f, indent=2)
    f.write("\n")
PY
  chown -R "$uid:$gid" "$rd/oc" "$CACHE/gateway-container-node-cache"

  name="clawmux-gw-$(printf '%s' "$(basename "$rd")" | tr -c 'A-Za-z0-9_.-' '-' | cut -c1-40)-$$"
  t0="$(now)"
  # No secret in -e: the token is in /oc/openclaw.json only.
  cid="$(docker run -d --name "$name" --init --network host --stop-timeout 20 --user "$uid:$gid" \
    --label clawmux-test=gateway \
    -v "$rd/oc:/oc" -v "$node_prefix:/opt/node:ro" -v "$oc_prefix:/opt/openclaw:ro" \
    -v "$CACHE/gateway-container-node-cache:/oc-cache" \
    -e HOME=/oc/home -e TMPDIR=/oc/tmp -e LANG=C.UTF-8 \
    -e OPENCLAW_CONFIG_PATH=/oc/openclaw.json -e OPENCLAW_STATE_DIR=/oc/state \
    -e OPENCLAW_NO_AUTO_UPDATE=1 -e OPENCLAW_DISABLE_BONJOUR=1 -e DO_NOT_TRACK=1 \
    -e NODE_COMPILE_CACHE=/oc-cache \
    -e PATH="/opt/node/$(dirname "$node_rel"):/usr/local/bin:/usr/bin:/bin" \
    --entrypoint "" "$image" \
    "/opt/node/$node_rel" "/opt/openclaw/$mjs_rel" gateway run --port "$port" --bind loopback --auth token)"
  echo "$cid" >"$rd/container.id"

  # the workspace, created as the gateway's uid
  docker exec -u 0 "$cid" sh -ec "mkdir -p /workspace && chown $uid:$gid /workspace"
  docker exec "$cid" sh -ec '
    git clone -q -b main /oc/tmp/main.bundle /workspace/repo
    git -C /workspace/repo config user.name "Agent Test"
    git -C /workspace/repo config user.email agent@example.invalid
    mkdir -p /workspace/wt'

  # ready: /readyz answers {"ready":true} while the container runs
  if ! python3 - "$port" "$cid" "$READY_TIMEOUT" <<'PY'
import subprocess, sys, time, urllib.request
port, cid, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
deadline = time.monotonic() + timeout
last = ""
while time.monotonic() < deadline:
    st = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cid], capture_output=True, text=True).stdout.strip()
    if st != "true":
        print("gateway container exited", file=sys.stderr)
        sys.exit(3)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            last = r.read().decode(errors="replace")
    except Exception as e:
        body = getattr(e, "read", None)
        last = body().decode(errors="replace") if body else repr(e)
    if '"ready":true' in last.replace(" ", ""):
        sys.exit(0)
    time.sleep(0.1)
print(f"gateway not ready after {timeout:.0f} s; last /readyz answer: {last[:300]}", file=sys.stderr)
sys.exit(4)
PY
  then
    docker logs "$cid" >"$rd/gateway.log" 2>&1 || true
    tail -n 40 "$rd/gateway.log" >&2
    docker rm -f "$cid" >/dev/null 2>&1 || true
    rm -f "$rd/container.id"
    stop_pid fake_llm "$llm_pid"
    die "gateway container failed to become ready"
  fi
  local ready; ready="$(elapsed "$t0")"
  cat >"$rd/env.tmp" <<EOF
GATEWAY_URL=ws://127.0.0.1:$port
GATEWAY_TOKEN=$token
GATEWAY_PORT=$port
CONTAINER_ID=$cid
CONTAINER_NAME=$name
CONTAINER_USER=$uid:$gid
IMAGE=$image
WORKSPACE=/workspace
BASE_REF=main
ORIGIN=$rd/origin.git
LLM_PORT=$LLM_PORT_V
LLM_PID=$llm_pid
LLM_LOG=$rd/llm-requests.jsonl
LLM_BASE_URL=http://127.0.0.1:$LLM_PORT_V/v1
RUN_DIR=$rd
READY_SECONDS=$ready
EOF
  mv -f "$rd/env.tmp" "$rd/env"
  say "ready after $ready s (container start to /readyz): $name ${cid:0:12} on ws://127.0.0.1:$port as $uid:$gid; env: $rd/env"
}

cmd_stop() {
  [ $# -ge 1 ] || usage
  [ -d "$1" ] || { say "no such dir $1; nothing to stop"; return 0; }
  local rd cid llm
  rd="$(cd "$1" && pwd -P)"
  cid="$(cat "$rd/container.id" 2>/dev/null || true)"
  if [ -n "$cid" ] && docker inspect "$cid" >/dev/null 2>&1; then
    docker logs "$cid" >"$rd/gateway.log" 2>&1 || true
    docker rm -f "$cid" >/dev/null
    say "removed container ${cid:0:12}"
  fi
  rm -f "$rd/container.id"
  llm="$(read_pid "$rd/fake_llm.pid")"
  if ours "$llm" fake_llm; then stop_pid fake_llm "$llm"; say "stopped fake LLM ($llm)"; fi
  rm -f "$rd/fake_llm.pid"
}

cmd_status() {
  [ $# -ge 1 ] || usage
  local rd; rd="$(cd "$1" 2>/dev/null && pwd -P)" || die "no such dir $1"
  [ -f "$rd/env" ] && cat "$rd/env"
  [ "$(docker inspect -f '{{.State.Running}}' "$(env_get "$rd" CONTAINER_ID)" 2>/dev/null)" = true ] && alive "$(env_get "$rd" LLM_PID)"
}

[ $# -ge 1 ] || usage
cmd="$1"; shift
case "$cmd" in
  start) cmd_start "$@" ;;
  stop) cmd_stop "$@" ;;
  status) cmd_status "$@" ;;
  *) usage ;;
esac
