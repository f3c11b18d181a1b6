#!/usr/bin/env bash
# The one test command (README, CI): installs what the tests need, runs every test, including
# the ones against the REAL OpenClaw gateway, and stops everything it started, by PID.
#
#   tests/run.sh
#
# Installs (idempotent, cached under ${CLAWMUX_CACHE:-~/.cache/clawmux}): Node 24 and
# openclaw@2026.9.6 from the npm registry (tests/support/install-openclaw.sh).
# Env: CLAWMUX_CACHE, CARGO_TEST_ARGS (extra args for cargo test).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { printf '\n== %s\n' "$*"; }

say "prerequisites"
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)"; exit 1; }
command -v python3 >/dev/null || { echo "python3 is required (the fake LLM)"; exit 1; }
command -v npm >/dev/null || { echo "npm is required to bootstrap Node 24 from the npm registry"; exit 1; }
eval "$(tests/support/install-openclaw.sh)"
export CLAWMUX_NODE_BIN CLAWMUX_OPENCLAW_MJS

say "build"
cargo build --workspace --all-targets --locked

say "unit and replay-gateway tests"
# shellcheck disable=SC2086
cargo test --workspace --locked ${CARGO_TEST_ARGS:-} -- --skip live_ --skip proxied_

say "real OpenClaw gateway tests"
RUN_DIR="$(mktemp -d /tmp/clawmux-gw.XXXXXX)"
BILLING_DIR="$(mktemp -d /tmp/clawmux-gwb.XXXXXX)"
cleanup() {
  tests/support/gateway.sh stop "$RUN_DIR" >/dev/null 2>&1 || true
  tests/support/gateway.sh stop "$BILLING_DIR" >/dev/null 2>&1 || true
  rm -rf "$RUN_DIR" "$BILLING_DIR"
}
trap cleanup EXIT INT TERM
tests/support/gateway.sh start "$RUN_DIR" v4
CLAWMUX_REAL_GATEWAY_ENV="$RUN_DIR/env" CLAWMUX_REQUIRE_REAL_GATEWAY=1 \
  cargo test --locked --test real_gateway -- --test-threads=1 live_
tests/support/gateway.sh stop "$RUN_DIR"

say "billing attribution through clawmux's LLM proxy, real OpenClaw gateway"
# The gateway's model provider points at the proxy; the fake LLM is the proxy's upstream.
PROXY_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
PROVIDER_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" tests/support/gateway.sh start "$BILLING_DIR" v4
echo "PROXY_PORT=$PROXY_PORT" >>"$BILLING_DIR/env"
CLAWMUX_BILLING_GATEWAY_ENV="$BILLING_DIR/env" CLAWMUX_REQUIRE_REAL_GATEWAY=1 \
  cargo test --locked --test real_gateway -- --test-threads=1 proxied_
