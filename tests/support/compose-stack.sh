#!/usr/bin/env bash
# The whole compose stack (images/compose.yaml: clawmux, the OpenClaw gateway, LiteLLM) on this
# machine's Docker, built offline, with the project's fake LLM on the host as LiteLLM's upstream.
# For tests/compose.rs (tests/run.sh's compose phase).
#
#   tests/support/compose-stack.sh start DIR   builds the images, starts the fake LLM and the stack,
#                                              waits until every service is healthy; writes DIR/env
#   tests/support/compose-stack.sh stop DIR    `down -v` (containers, volumes), removes the images it
#                                              built and their untagged build stages (not the base),
#                                              stops the fake LLM by PID; keeps DIR's logs
#                                              (stack.log, fake_llm.log, spend/)
#
# start, step by step:
#   1. Docker (tests/support/docker.sh ensure) and Debian's docker-compose (apt, when missing);
#   2. the offline base image (tests/support/docker-image.sh: git, ca-certificates, python3);
#   3. the three images with images/build.sh, BASE = that base, DOCKER_BUILD_NETWORK=none (no build
#      step can reach a network), tagged clawmux-test/<image>:<project>; the clawmux binary is
#      CLAWMUX_BINARY, else target/release/clawmux (CARGO_TARGET_DIR), built when missing;
#   4. the fake LLM on 127.0.0.1 (port 0) and LiteLLM's test config pointing at it;
#   5. DIR/compose.env (mode 0600): what an operator's images/.env holds (fresh random secrets,
#      the image tags) plus the loopback ports host networking needs;
#   6. `images/compose-host.sh -p PROJECT --env-file DIR/compose.env -f tests/support/compose/test.yaml
#      up -d --no-build`: the README's command for a Docker without a bridge network (this dockerd
#      runs with --bridge=none), plus the test's file (LiteLLM's model list = the fake LLM, its spend
#      log); then waits (bounded: STACK_READY_TIMEOUT, default 300 s) until clawmux, the gateway and
#      LiteLLM report healthy and clawmux's /readyz says the gateway is connected.
#
# DIR/env (KEY=VALUE, mode 0600):
#   CLAWMUX_URL  API_TOKEN  GATEWAY_TOKEN  LLM_KEY  PROJECT  ENV_FILE
#   CLAWMUX_CONTAINER  GATEWAY_CONTAINER  LITELLM_CONTAINER  NET_CONTAINER  TOKEN_CONTAINER
#   CLAWMUX_IMAGE  OPENCLAW_IMAGE  LITELLM_IMAGE  BASE_IMAGE  LLM_LOG  SPEND_LOG  LLM_PID
#   BUILD_SECONDS  UP_SECONDS  RUN_DIR
#
# Env: CLAWMUX_CACHE, CLAWMUX_BINARY, CARGO_TARGET_DIR, STACK_READY_TIMEOUT, KEEP_IMAGES=1 (stop
#      leaves the built images, for a faster next build).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
READY_TIMEOUT="${STACK_READY_TIMEOUT:-300}"

say() { printf 'compose-stack.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
usage() { sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

alive() {
  local st
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
  st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}
ours() { alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "$2"; }
read_pid() { if [ -f "$1" ]; then tr -dc '0-9' <"$1"; fi; }
env_get() { sed -n "s/^$2=//p" "$1" 2>/dev/null | tail -1; }
stop_pid() {
  alive "$1" || return 0
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 1 50); do alive "$1" || return 0; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
}
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}
secret() { python3 -c 'import secrets, sys; print(sys.argv[1] + secrets.token_hex(24))' "$1"; }

# compose ARGS...: the stack of DIR ($rd) through images/compose-host.sh, as the README says
compose() { "$REPO/images/compose-host.sh" -p "$project" --env-file "$rd/compose.env" -f "$HERE/compose/test.yaml" "$@"; }

cmd_start() {
  [ $# -ge 1 ] || usage
  local t0 base llm_pid llm_port bin api gw key
  case "$1" in *[!A-Za-z0-9._/+@:-]*) die "DIR may only contain [A-Za-z0-9._/+@:-]: '$1'" ;; esac
  mkdir -p "$1"
  rd="$(cd "$1" && pwd -P)"
  if [ -f "$rd/project" ] || ours "$(read_pid "$rd/fake_llm.pid")" fake_llm; then
    die "$rd already has a stack (or the rest of one); run: $0 stop $rd"
  fi
  rm -rf "$rd/spend"
  rm -f "$rd/env" "$rd/compose.env" "$rd/compose.env.compose.yaml" "$rd/litellm.yaml" "$rd/fake_llm.pid" \
    "$rd/llm.port" "$rd/llm-requests.jsonl" "$rd/fake_llm.log" "$rd/stack.log" "$rd/build-report" \
    "$rd/dangling.before" "$rd/dangling.built"

  # 1-2: engine, compose, base image
  "$HERE/docker.sh" ensure
  command -v docker-compose >/dev/null 2>&1 || "$HERE/docker.sh" apt-install docker-compose
  base="$("$HERE/docker-image.sh" | sed -n 's/^IMAGE=//p')"
  [ -n "$base" ] || die "no base image"

  # 3: images, offline. From here on a failed start undoes itself (`stop`: logs kept).
  project="cmxtest$$"
  echo "$project" >"$rd/project"
  trap 'say "start failed: stopping what it started"; cmd_stop "$rd"' EXIT
  bin="${CLAWMUX_BINARY:-${CARGO_TARGET_DIR:-$REPO/target}/release/clawmux}"
  if [ ! -x "$bin" ]; then
    say "no $bin: cargo build --release --locked --bin clawmux"
    t0="$(now)"
    (cd "$REPO" && cargo build --release --locked --bin clawmux) >&2
    say "release build in $(elapsed "$t0") s"
  fi
  t0="$(now)"
  # the build's intermediate stages (clawmux's rootfs stage) stay behind as untagged images: note
  # which are new, for `stop`
  docker images -q --no-trunc --filter dangling=true | sort >"$rd/dangling.before"
  BASE="$base" DOCKER_BUILD_NETWORK=none CLAWMUX_BINARY="$bin" BUILD_REPORT="$rd/build-report" \
    CLAWMUX_IMAGE="clawmux-test/clawmux:$project" OPENCLAW_IMAGE="clawmux-test/openclaw:$project" \
    LITELLM_IMAGE="clawmux-test/litellm:$project" "$REPO/images/build.sh" clawmux openclaw litellm
  local build_secs; build_secs="$(elapsed "$t0")"
  docker images -q --no-trunc --filter dangling=true | sort | comm -13 "$rd/dangling.before" - >"$rd/dangling.built"

  # 4: the fake LLM on the host; LiteLLM's test config
  mkdir -p "$rd/spend"
  chown 1001:1001 "$rd/spend" # LiteLLM's user writes its spend records there
  FAKE_LLM_PORT=0 FAKE_LLM_PORT_FILE="$rd/llm.port" FAKE_LLM_LOG="$rd/llm-requests.jsonl" \
    python3 "$HERE/fake_llm.py" </dev/null >"$rd/fake_llm.log" 2>&1 &
  llm_pid=$!
  echo "$llm_pid" >"$rd/fake_llm.pid"
  for _ in $(seq 1 100); do [ -s "$rd/llm.port" ] && break; alive "$llm_pid" || break; sleep 0.05; done
  [ -s "$rd/llm.port" ] || { cat "$rd/fake_llm.log" >&2; stop_pid "$llm_pid"; die "fake LLM did not start"; }
  llm_port="$(tr -dc '0-9' <"$rd/llm.port")"
  sed "s/@FAKE_LLM_PORT@/$llm_port/g" "$HERE/compose/litellm.yaml.in" >"$rd/litellm.yaml"
  chmod 0644 "$rd/litellm.yaml"

  # 5: the env file: what an operator's images/.env holds, plus the host-networking ports
  api="$(secret cmx-api-)"; gw="$(secret cmx-gw-)"; key="$(secret sk-cmx-llm-)"
  (
    umask 077
    cat >"$rd/compose.env" <<EOF
CLAWMUX_API_TOKEN=$api
CLAWMUX_GATEWAY_TOKEN=$gw
LITELLM_MASTER_KEY=$key
OPENAI_API_KEY=
CLAWMUX_IMAGE=clawmux-test/clawmux:$project
OPENCLAW_IMAGE=clawmux-test/openclaw:$project
LITELLM_IMAGE=clawmux-test/litellm:$project
CLAWMUX_LOG_FORMAT=text
CLAWMUX_PORT=$(free_port)
CLAWMUX_PROXY_PORT=$(free_port)
OPENCLAW_GATEWAY_PORT=$(free_port)
LITELLM_PORT=$(free_port)
COMPOSE_TEST_DIR=$rd
COMPOSE_TEST_SUPPORT=$HERE
EOF
  )

  # 6: up (compose-host.sh merges the files into compose.env.compose.yaml), then healthy
  t0="$(now)"
  compose up -d --no-build >&2 || { compose logs --no-color >"$rd/stack.log" 2>&1 || true; tail -n 60 "$rd/stack.log" >&2; die "docker-compose up failed"; }
  local svc cid ids=()
  for svc in clawmux gateway litellm net gateway-token; do
    cid="$(compose ps -q "$svc")"
    [ -n "$cid" ] || die "no container for $svc"
    ids+=("$svc=$cid")
  done
  local cmx_port; cmx_port="$(env_get "$rd/compose.env" CLAWMUX_PORT)"
  if ! python3 - "$READY_TIMEOUT" "$cmx_port" "$api" "${ids[@]}" <<'PY'
import subprocess, sys, time, urllib.request
timeout, port, token = float(sys.argv[1]), sys.argv[2], sys.argv[3]
ids = dict(a.split("=", 1) for a in sys.argv[4:])
deadline = time.monotonic() + timeout
def state(cid):
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}", cid],
                         capture_output=True, text=True).stdout.split()
    return (out + ["", ""])[:2]
last = {}
while time.monotonic() < deadline:
    status = {s: state(c) for s, c in ids.items()}
    last = status
    dead = [s for s, (st, _) in status.items() if st != "running" and s != "gateway-token"]
    if dead:
        print(f"stopped: {dead}: {status}", file=sys.stderr)
        sys.exit(3)
    if status["gateway-token"][0] == "exited":
        code = subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", ids["gateway-token"]], capture_output=True, text=True).stdout.strip()
        if code != "0":
            print(f"gateway-token exited {code}", file=sys.stderr)
            sys.exit(3)
    healthy = all(status[s][1] == "healthy" for s in ("clawmux", "gateway", "litellm"))
    if healthy:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/readyz", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=3) as r:
                if r.status == 200:
                    sys.exit(0)
        except Exception:
            pass
    time.sleep(0.5)
print(f"the stack was not healthy after {timeout:.0f} s: {last}", file=sys.stderr)
sys.exit(4)
PY
  then
    compose logs --no-color >"$rd/stack.log" 2>&1 || true
    tail -n 80 "$rd/stack.log" >&2
    die "the stack did not become healthy (logs: $rd/stack.log; stop it with: $0 stop $rd)"
  fi
  local up_secs; up_secs="$(elapsed "$t0")"
  (
    umask 077
    {
      echo "CLAWMUX_URL=http://127.0.0.1:$cmx_port"
      echo "API_TOKEN=$api"
      echo "GATEWAY_TOKEN=$gw"
      echo "LLM_KEY=$key"
      echo "PROJECT=$project"
      echo "ENV_FILE=$rd/compose.env"
      for pair in "${ids[@]}"; do
        case "${pair%%=*}" in
          clawmux) echo "CLAWMUX_CONTAINER=${pair#*=}" ;;
          gateway) echo "GATEWAY_CONTAINER=${pair#*=}" ;;
          litellm) echo "LITELLM_CONTAINER=${pair#*=}" ;;
          net) echo "NET_CONTAINER=${pair#*=}" ;;
          gateway-token) echo "TOKEN_CONTAINER=${pair#*=}" ;;
        esac
      done
      echo "CLAWMUX_IMAGE=clawmux-test/clawmux:$project"
      echo "OPENCLAW_IMAGE=clawmux-test/openclaw:$project"
      echo "LITELLM_IMAGE=clawmux-test/litellm:$project"
      echo "BASE_IMAGE=$base"
      echo "LLM_LOG=$rd/llm-requests.jsonl"
      echo "SPEND_LOG=$rd/spend/spend.jsonl"
      echo "LLM_PID=$llm_pid"
      echo "BUILD_SECONDS=$build_secs"
      echo "UP_SECONDS=$up_secs"
      echo "RUN_DIR=$rd"
    } >"$rd/env.tmp"
  )
  mv -f "$rd/env.tmp" "$rd/env"
  trap - EXIT
  say "images built in $build_secs s:"
  awk '{ printf "compose-stack.sh:   %s %.0f MB %s s\n", $1, $2 / 1e6, $3 }' "$rd/build-report" >&2
  say "stack $project healthy $up_secs s after up; clawmux on http://127.0.0.1:$cmx_port; env: $rd/env"
}

cmd_stop() {
  [ $# -ge 1 ] || usage
  [ -d "$1" ] || { say "no such dir $1; nothing to stop"; return 0; }
  rd="$(cd "$1" && pwd -P)"
  project="$(tr -dc 'a-z0-9' <"$rd/project" 2>/dev/null || true)"
  if [ -n "$project" ]; then
    if [ -f "$rd/compose.env" ] && command -v docker-compose >/dev/null 2>&1; then
      compose logs --no-color >"$rd/stack.log" 2>&1 || true
      compose down -v --remove-orphans --timeout 30 >&2 || say "docker-compose down failed"
    fi
    if [ "${KEEP_IMAGES:-0}" != 1 ]; then
      local img
      for img in clawmux openclaw litellm; do
        if docker image inspect "clawmux-test/$img:$project" >/dev/null 2>&1; then
          docker rmi "clawmux-test/$img:$project" >/dev/null && say "removed image clawmux-test/$img:$project"
        fi
      done
      local id
      if [ -f "$rd/dangling.built" ]; then
        while read -r id; do
          id="${id#sha256:}"
          if [ -n "$id" ] && docker image inspect "$id" >/dev/null 2>&1; then
            if docker rmi "$id" >/dev/null 2>&1; then say "removed the build's intermediate image ${id:0:12}"; fi
          fi
        done <"$rd/dangling.built"
      fi
    fi
  fi
  local llm; llm="$(read_pid "$rd/fake_llm.pid")"
  if ours "$llm" fake_llm; then stop_pid "$llm"; say "stopped fake LLM ($llm)"; fi
  rm -f "$rd/fake_llm.pid" "$rd/compose.env" "$rd/compose.env.compose.yaml" "$rd/env" "$rd/project"
}

[ $# -ge 1 ] || usage
cmd="$1"; shift
case "$cmd" in
  start) cmd_start "$@" ;;
  stop) cmd_stop "$@" ;;
  *) usage ;;
esac
