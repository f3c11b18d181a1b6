#!/usr/bin/env bash
# The one test command (README, CI): installs what the tests need, runs every test, including
# the ones against the REAL OpenClaw gateway, and stops everything it started, by PID.
#
#   tests/run.sh
#
# Installs (idempotent, cached under ${CLAWMUX_CACHE:-~/.cache/clawmux}): Node 24,
# openclaw@2026.9.6 and openclaw@2026.4.12 from the npm registry (tests/support/install-openclaw.sh),
# OpenClaw's protocol packages @openclaw/gateway-protocol and @openclaw/gateway-client, pinned
# (tests/support/install-gateway-protocol.sh: the schema checks and the official-client suite),
# and LiteLLM from PyPI (tests/support/install-litellm.sh); Debian's docker.io, debootstrap and
# docker-compose (tests/support/docker.sh, docker-image.sh, compose-stack.sh), iproute2 for the namespace test; schemathesis from
# PyPI (tests/support/install-schemathesis.sh); Debian's chromium, chromium-driver and prometheus
# (promtool) (tests/support/install-apt-tools.sh); Debian's postgresql (tests/support/postgres.sh).
# Needs root for Docker, the network namespace,
# the store-fault tests (read-only and tmpfs mounts), PostgreSQL (run as its own user) and the apt
# installs.
# Env: CLAWMUX_CACHE, CARGO_TEST_ARGS (extra args for cargo test).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { printf '\n== %s (%s, %s s in)\n' "$*" "$(date -u +%T)" "$SECONDS"; }

say "prerequisites"
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)"; exit 1; }
command -v python3 >/dev/null || { echo "python3 is required (the fake LLM)"; exit 1; }
command -v npm >/dev/null || { echo "npm is required to bootstrap Node 24 from the npm registry"; exit 1; }
python3 -m venv --help >/dev/null 2>&1 || { echo "python3 -m venv is required (LiteLLM from PyPI)"; exit 1; }
eval "$(tests/support/install-openclaw.sh)"
export CLAWMUX_NODE_BIN CLAWMUX_OPENCLAW_MJS
eval "$(tests/support/install-gateway-protocol.sh)"
export CLAWMUX_GATEWAY_PROTOCOL_DIR

# The later phases' downloads (apt, npm, PyPI, debootstrap) go on while the build uses the CPU
# (tests/support/prefetch.sh; its log is printed when it is waited for). A build that fails still
# waits for it: an apt-get killed midway leaves dpkg half-configured.
PREFETCH_LOG="$(mktemp /tmp/clawmux-prefetch.XXXXXX)"
tests/support/prefetch.sh >"$PREFETCH_LOG" 2>&1 &
PREFETCH_PID=$!
trap 'wait "$PREFETCH_PID" 2>/dev/null || true; rm -f "$PREFETCH_LOG"' EXIT INT TERM

say "build"
cargo build --workspace --all-targets --locked

# Waited for before any test runs: the tests then have the machine to themselves, as before.
say "waiting for the prefetch (tests/support/prefetch.sh)"
wait "$PREFETCH_PID" || echo "prefetch: a step failed; the phase that needs it installs it again"
cat "$PREFETCH_LOG"
rm -f "$PREFETCH_LOG"
trap - EXIT INT TERM

say "unit and replay-gateway tests"
# tests/store_faults.rs mounts a read-only bind and a small tmpfs (a full disk): required here, so
# they fail rather than skip when this is not root. The checks against OpenClaw's own
# protocol.schema.json (protocol/tests/official_schema.rs, tests/replay_schema.rs, the replay's
# field lists) are required too.
# shellcheck disable=SC2086
CLAWMUX_REQUIRE_MOUNTS=1 CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1 cargo test --workspace --locked ${CARGO_TEST_ARGS:-} -- --skip live_ --skip proxied_ --skip litellm_ --skip netns_ --skip docker_ --skip browser_ --skip pg_

say "the run store on a real PostgreSQL"
# Debian's postgresql (installed when missing), initdb in a fresh directory as the unprivileged
# `postgres` user, on 127.0.0.1 on a free port, stopped by PID (tests/support/postgres.sh). The
# backend suite's pg_ cases, the history, tenant and restart tests (a database each), kill -9 + restart of clawmux
# on it, three replicas on one database (takeover after kill -9, streams from any replica, aborts to the owner,
# session-key FIFO; branch_runs: two replicas never work on one branch key at once), any replica's LLM
# proxy forwarding any run's calls (replica_proxy: billing headers, usage once, revocation, budgets),
# and the fault test, which starts (and stops, and starts) a PostgreSQL of its own through the same script.
PG_DIR="$(mktemp -d /tmp/clawmux-pg.XXXXXX)"
trap 'tests/support/postgres.sh stop "$PG_DIR" >/dev/null 2>&1 || true; rm -rf "$PG_DIR"' EXIT INT TERM
PG_ENV="$(tests/support/postgres.sh start "$PG_DIR")"  # an assignment: a failed start stops the script
eval "$PG_ENV"
CLAWMUX_TEST_PG_URL="$CLAWMUX_TEST_PG_URL" CLAWMUX_REQUIRE_PG=1 \
  cargo test --locked -p clawmux --lib --test postgres --test history --test tenants --test restart --test replicas --test branch_runs --test replica_proxy -- pg_
tests/support/postgres.sh stop "$PG_DIR"
rm -rf "$PG_DIR"
trap - EXIT INT TERM

say "operator surface: OpenAPI vs. a live clawmux (schemathesis), metrics and alert rules (promtool), the runs page (headless Chromium)"
# A live `clawmux serve` + `clawmux replay-gateway` + the fake LLM behind the LLM proxy
# (tests/support/stack.sh, stopped by PID); then the browser tests, in-process, each with its own.
tests/support/install-apt-tools.sh chromium chromedriver promtool
OPS_DIR="$(mktemp -d /tmp/clawmux-ops.XXXXXX)"
trap 'tests/support/stack.sh stop "$OPS_DIR" >/dev/null 2>&1 || true' EXIT INT TERM
tests/support/stack.sh start "$OPS_DIR"
tests/support/metrics-checks.sh "$OPS_DIR"
tests/support/schemathesis.sh "$OPS_DIR" "$OPS_DIR/schemathesis-report"
tests/support/stack.sh stop "$OPS_DIR"
CLAWMUX_REQUIRE_BROWSER=1 CLAWMUX_BROWSER_ARTIFACTS="$OPS_DIR/browser-artifacts" \
  cargo test --locked --test browser -- browser_
echo "runs page screenshots: $OPS_DIR/browser-artifacts"

say "real OpenClaw gateway tests"
RUN_DIR="$(mktemp -d /tmp/clawmux-gw.XXXXXX)"
BILLING_DIR="$(mktemp -d /tmp/clawmux-gwb.XXXXXX)"
V3_DIR="$(mktemp -d /tmp/clawmux-gw3.XXXXXX)"
CONF3_DIR="$(mktemp -d /tmp/clawmux-gwconf3.XXXXXX)"
LITELLM_DIR="$(mktemp -d /tmp/clawmux-litellm.XXXXXX)"
NETNS_DIR="$(mktemp -d /tmp/clawmux-gwns.XXXXXX)"
NETNS_NAME="cmx$$"
GWC_DIR="$(mktemp -d /tmp/clawmux-gwc.XXXXXX)"
CHAOS_DIR="$(mktemp -d /tmp/clawmux-gwchaos.XXXXXX)"
RESTART_DIR="$(mktemp -d /tmp/clawmux-gwrestart.XXXXXX)"
REPLICAS_DIR="$(mktemp -d /tmp/clawmux-gwreplicas.XXXXXX)"
REPLICAS_PG="$(mktemp -d /tmp/clawmux-pgreplicas.XXXXXX)"
COMPOSE_DIR="$(mktemp -d /tmp/clawmux-compose.XXXXXX)"
cleanup() {
  tests/support/gateway-container.sh stop "$GWC_DIR" >/dev/null 2>&1 || true
  tests/support/compose-stack.sh stop "$COMPOSE_DIR" >/dev/null 2>&1 || true
  tests/support/docker.sh stop >/dev/null 2>&1 || true
  for d in "$RUN_DIR" "$BILLING_DIR" "$V3_DIR" "$CONF3_DIR" "$NETNS_DIR" "$CHAOS_DIR" "$RESTART_DIR" "$REPLICAS_DIR"; do
    tests/support/gateway.sh stop "$d" >/dev/null 2>&1 || true
  done
  tests/support/postgres.sh stop "$REPLICAS_PG" >/dev/null 2>&1 || true
  tests/support/netns.sh down "$NETNS_NAME" >/dev/null 2>&1 || true
  tests/support/litellm.sh stop "$LITELLM_DIR" >/dev/null 2>&1 || true
  # What the test processes left in their temporary directories (tests/common: temp_dir).
  rm -rf "${TMPDIR:-/tmp}/clawmux-tests"
  rm -rf "$RUN_DIR" "$BILLING_DIR" "$V3_DIR" "$CONF3_DIR" "$LITELLM_DIR" "$NETNS_DIR" "$GWC_DIR" "$CHAOS_DIR" "$RESTART_DIR" "$REPLICAS_DIR" "$REPLICAS_PG" "$COMPOSE_DIR"
}
trap cleanup EXIT INT TERM
tests/support/gateway.sh start "$RUN_DIR" v4
CLAWMUX_REAL_GATEWAY_ENV="$RUN_DIR/env" CLAWMUX_REQUIRE_REAL_GATEWAY=1 \
  cargo test --locked --test real_gateway -- --test-threads=1 live_

say "official-client conformance: the real gateway (openclaw@2026.9.6) vs clawmux replay-gateway"
# tests/support/conformance.mjs drives both with @openclaw/gateway-client (same gateway as above);
# every row must match, and every frame is checked against protocol.schema.json.
CLAWMUX_CONFORMANCE_GATEWAY_ENV="$RUN_DIR/env" CLAWMUX_REQUIRE_CONFORMANCE=1 CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1 \
  cargo test --locked --test conformance -- --nocapture live_conformance_
tests/support/gateway.sh stop "$RUN_DIR"

say "gateway faults (drop, freeze, kill) against the real OpenClaw gateway"
# A gateway of their own: these tests SIGSTOP it and kill -9 + restart it.
tests/support/gateway.sh start "$CHAOS_DIR" v4
CLAWMUX_CHAOS_GATEWAY_ENV="$CHAOS_DIR/env" CLAWMUX_REQUIRE_CHAOS_GATEWAY=1 \
  cargo test --locked --test real_chaos -- --test-threads=1 live_chaos_
tests/support/gateway.sh stop "$CHAOS_DIR"

say "billing attribution and budgets through clawmux's LLM proxy, real OpenClaw gateway"
# The gateway's model provider points at the proxy; the fake LLM is the proxy's upstream.
PROXY_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
PROXY_PORT="$PROXY_PORT" PROVIDER_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" tests/support/gateway.sh start "$BILLING_DIR" v4
CLAWMUX_REAL_GATEWAY_ENV="$BILLING_DIR/env" CLAWMUX_REQUIRE_REAL_GATEWAY=1 \
  cargo test --locked --test real_gateway -- --test-threads=1 proxied_
tests/support/gateway.sh stop "$BILLING_DIR"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

say "clawmux killed mid-run and restarted, real OpenClaw gateway, billing through its LLM proxy"
# A gateway of its own: the test kills clawmux (and its proxy) with kill -9 while the gateway's LLM
# streams run through it, and starts it again on the same store and proxy port.
PROXY_PORT="$(free_port)"
PROXY_PORT="$PROXY_PORT" PROVIDER_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" tests/support/gateway.sh start "$RESTART_DIR" v4
CLAWMUX_RESTART_GATEWAY_ENV="$RESTART_DIR/env" CLAWMUX_REQUIRE_RESTART_GATEWAY=1 \
  cargo test --locked --test real_restart -- --test-threads=1 proxied_restart_
tests/support/gateway.sh stop "$RESTART_DIR"

say "two replicas on one PostgreSQL, the real OpenClaw gateway's provider a load-balanced proxy address, one replica killed mid-run"
# A gateway and a PostgreSQL of their own: the test puts a TCP load balancer on PROXY_PORT (round
# robin over both replicas' proxies), so the gateway's calls land on either replica; answers of
# ~10 s (20 words, 0.5 s apart) let it kill -9 a replica while every run streams.
REPLICAS_PG_ENV="$(tests/support/postgres.sh start "$REPLICAS_PG")"
PROXY_PORT="$(free_port)"
PROXY_PORT="$PROXY_PORT" PROVIDER_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" FAKE_LLM_CHUNKS=20 FAKE_LLM_DELAY=0.5 \
  tests/support/gateway.sh start "$REPLICAS_DIR" v4
(eval "$REPLICAS_PG_ENV"; CLAWMUX_TEST_PG_URL="$CLAWMUX_TEST_PG_URL" CLAWMUX_REPLICAS_GATEWAY_ENV="$REPLICAS_DIR/env" \
  CLAWMUX_REPLICAS_WORDS=20 CLAWMUX_REQUIRE_REPLICAS_GATEWAY=1 \
  cargo test --locked --test real_replicas -- --test-threads=1 --nocapture proxied_replicas_)
tests/support/gateway.sh stop "$REPLICAS_DIR"
tests/support/postgres.sh stop "$REPLICAS_PG"

say "the same conformance suite against the protocol-3 gateway (openclaw@2026.4.12)"
# Protocol 3 needs the device identity (scopes), attributes LLM calls by the per-run token in
# extraSystemPrompt, and stops aborted runs through the proxy: its provider points at the proxy.
tests/support/install-openclaw.sh v3 >/dev/null
PROXY_PORT="$(free_port)"
PROXY_PORT="$PROXY_PORT" PROVIDER_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" \
  CLAWMUX_NODE_BIN="" CLAWMUX_OPENCLAW_MJS="" tests/support/gateway.sh start "$V3_DIR" v3
CLAWMUX_REAL_GATEWAY_ENV="$V3_DIR/env" CLAWMUX_REQUIRE_REAL_GATEWAY=1 \
  cargo test --locked --test real_gateway -- --test-threads=1 live_ proxied_
tests/support/gateway.sh stop "$V3_DIR"

say "official-client conformance where protocol 3 applies: openclaw@2026.4.12 vs clawmux replay-gateway"
# A v3 gateway of its own whose provider is the fake LLM itself (the one above points at clawmux's
# proxy, which only runs inside its tests). v4-only rows are left out; no schema check: the
# schema describes protocol 4.
CLAWMUX_NODE_BIN="" CLAWMUX_OPENCLAW_MJS="" tests/support/gateway.sh start "$CONF3_DIR" v3
CLAWMUX_CONFORMANCE_GATEWAY_ENV="$CONF3_DIR/env" CLAWMUX_REQUIRE_CONFORMANCE=1 CLAWMUX_REQUIRE_GATEWAY_PROTOCOL=1 \
  cargo test --locked --test conformance -- --nocapture live_conformance_
tests/support/gateway.sh stop "$CONF3_DIR"

say "billing through a real LiteLLM proxy (clawmux proxy -> LiteLLM -> fake LLM)"
# LiteLLM (PyPI) in a venv under the cache; its own spend records are checked.
eval "$(tests/support/install-litellm.sh)"
export CLAWMUX_LITELLM_BIN
tests/support/litellm.sh start "$LITELLM_DIR"
CLAWMUX_LITELLM_ENV="$LITELLM_DIR/env" CLAWMUX_REQUIRE_LITELLM=1 \
  cargo test --locked --test litellm -- litellm_
tests/support/litellm.sh stop "$LITELLM_DIR"

say "non-loopback: the protocol-4 gateway in a network namespace of the test's own (device pairing)"
# Needs root and iproute2: a namespace + veth pair on a per-run /30 of 10.213.0.0/16 (our own test
# host); the gateway binds to its namespace address, clawmux connects from the host, and the test
# approves clawmux's device with the gateway's own CLI.
[ "$(id -u)" = 0 ] || { echo "the namespace test needs root (ip netns, veth)"; exit 1; }
command -v ip >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iproute2; }
NETNS_SUBNET=$(( $$ % 16384 ))
NETNS_HOST="10.213.$(( NETNS_SUBNET / 64 )).$(( NETNS_SUBNET % 64 * 4 + 1 ))"
NETNS_ADDR="10.213.$(( NETNS_SUBNET / 64 )).$(( NETNS_SUBNET % 64 * 4 + 2 ))"
tests/support/netns.sh up "$NETNS_NAME" "$NETNS_HOST" "$NETNS_ADDR"
NETNS="$NETNS_NAME" BIND_HOST="$NETNS_ADDR" tests/support/gateway.sh start "$NETNS_DIR" v4
CLAWMUX_NETNS_GATEWAY_ENV="$NETNS_DIR/env" CLAWMUX_REQUIRE_NETNS=1 \
  cargo test --locked --test remote_gateway -- --test-threads=1 netns_
tests/support/gateway.sh stop "$NETNS_DIR"
tests/support/netns.sh down "$NETNS_NAME"

say "git relay: a real Docker engine, the real OpenClaw gateway in a container"
# Installs Debian's docker.io when missing, starts dockerd (--bridge=none --iptables=false), builds
# the base image offline (debootstrap from the machine's apt mirror, cached), runs the gateway in a
# container with --network host; the relay pushes to a host bare repo, a fake GitHub API records PRs.
tests/support/docker.sh ensure
tests/support/docker-image.sh
tests/support/gateway-container.sh start "$GWC_DIR"
CLAWMUX_REQUIRE_DOCKER=1 CLAWMUX_REQUIRE_GATEWAY_CONTAINER=1 CLAWMUX_RELAY_GATEWAY_ENV="$GWC_DIR/env" \
  cargo test --locked --test relay -- docker_
tests/support/gateway-container.sh stop "$GWC_DIR"

say "ephemeral runs: one network-less, hardened container per run, the real OpenClaw CLI inside"
# The same dockerd and base image; the agent image is built offline once per content (cached).
EPH_IMAGE="$(tests/support/ephemeral-image.sh | sed -n 's/^IMAGE=//p')"
CLAWMUX_EPHEMERAL_IMAGE="$EPH_IMAGE" cargo test --locked --test docker_ephemeral -- --test-threads=1 docker_ephemeral_

say "the compose stack: clawmux, the gateway and LiteLLM in images built offline (images/)"
# The same dockerd. Installs Debian's docker-compose when missing; builds the three images with
# images/build.sh on the offline base, build containers on --network none; brings
# images/compose.yaml up with images/compose.host.yaml (host networking: this dockerd has no
# bridge); the fake LLM is LiteLLM's upstream. `stop` removes the stack's containers and volumes
# and the images it built (the base image stays cached). clawmux from the release binary: the
# image the test checks (its size among them) is the one a user deploys.
cargo build --release --locked --bin clawmux
tests/support/compose-stack.sh start "$COMPOSE_DIR"
CLAWMUX_COMPOSE_ENV="$COMPOSE_DIR/env" CLAWMUX_REQUIRE_COMPOSE=1 \
  cargo test --locked --test compose -- --test-threads=1 docker_compose_
tests/support/compose-stack.sh stop "$COMPOSE_DIR"
tests/support/docker.sh stop

