#!/usr/bin/env bash
# Install OpenClaw's own protocol packages (npm, pinned) into the cache dir, for the schema checks
# and the official-client conformance suite:
#   @openclaw/gateway-protocol  protocol.schema.json (JSON Schema of every frame, method and event)
#                               and its validators (TypeBox, a pinned dependency of the package)
#   @openclaw/gateway-client    the reference client (GatewayClient)
#
# Usage:
#   eval "$(tests/support/install-gateway-protocol.sh)"
#
# stdout carries ONLY shell-sourceable lines:
#   CLAWMUX_NODE_BIN=<path of node 24>                 (the one install-openclaw.sh installs)
#   CLAWMUX_GATEWAY_PROTOCOL_DIR=<prefix>              node_modules/@openclaw/... live below it
# Progress and npm output go to stderr.
#
# Env:
#   CLAWMUX_CACHE               cache dir (default $HOME/.cache/clawmux)
#   GATEWAY_PROTOCOL_VERSION    version of both packages (default 2026.9.1: the newest release
#                               when this was written; the packages follow OpenClaw's release
#                               train, 2026.9.1 describes the protocol 2026.9.6 speaks: v4)
#
# Layout: $CACHE/gateway-protocol-<version>/ with a marker file .clawmux-installed written only after
# a successful install and sanity check (the schema parses and the client module loads); without a
# matching marker the prefix is wiped and installed again. With the marker present this is a fast
# no-op (no npm, no lock). Concurrent callers are serialised with flock on $CACHE/.install.lock.
# npm runs with the machine's own configuration (registry, proxy): nothing here names a registry.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
VERSION="${GATEWAY_PROTOCOL_VERSION:-2026.9.1}"
PREFIX="$CACHE/gateway-protocol-$VERSION"
MARKER=.clawmux-installed
STAMP="@openclaw/gateway-protocol@$VERSION @openclaw/gateway-client@$VERSION"
SCHEMA="$PREFIX/node_modules/@openclaw/gateway-protocol/protocol.schema.json"

log() { printf 'install-gateway-protocol: %s\n' "$*" >&2; }

# Node 24 from the openclaw installer (its fast path when already installed).
NODE_BIN="$("$HERE/install-openclaw.sh" | sed -n 's/^CLAWMUX_NODE_BIN=//p')"
# install-openclaw.sh quotes with printf %q; the cache path has no characters that need it, but
# undo a quoting of spaces to be safe.
NODE_BIN="$(eval "printf '%s' $NODE_BIN")"
[ -x "$NODE_BIN" ] || { log "node not found: $NODE_BIN"; exit 1; }

emit() {
  printf 'CLAWMUX_NODE_BIN=%q\n' "$NODE_BIN"
  printf 'CLAWMUX_GATEWAY_PROTOCOL_DIR=%q\n' "$PREFIX"
}

marker_ok() { [ -f "$PREFIX/$MARKER" ] && [ "$(cat "$PREFIX/$MARKER")" = "$STAMP" ] && [ -f "$SCHEMA" ]; }

if marker_ok; then
  emit
  exit 0
fi

command -v npm >/dev/null 2>&1 || { log "need a system npm to install the packages"; exit 1; }
mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE/.install.lock"
  flock 9
fi
if ! marker_ok; then
  log "installing $STAMP into $PREFIX"
  T0=$SECONDS
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  printf '{ "name": "clawmux-gateway-protocol", "private": true, "type": "module" }\n' >"$PREFIX/package.json"
  # --save-exact: the package README's own advice; the two packages pin each other exactly.
  PATH="$(dirname "$NODE_BIN"):$PATH" timeout --foreground 600 \
    npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=warn --save-exact \
    "@openclaw/gateway-protocol@$VERSION" "@openclaw/gateway-client@$VERSION" >&2
  # sanity: the schema parses, both modules load, and the protocol is the one this suite speaks (4)
  got="$(cd "$PREFIX" && timeout --foreground 60 "$NODE_BIN" --input-type=module -e '
    import fs from "node:fs";
    import { GatewayClient } from "@openclaw/gateway-client";
    import { PROTOCOL_VERSION } from "@openclaw/gateway-protocol/version";
    const doc = JSON.parse(fs.readFileSync("node_modules/@openclaw/gateway-protocol/protocol.schema.json", "utf8"));
    if (typeof GatewayClient !== "function" || !doc.definitions) throw new Error("unexpected package contents");
    console.log(`protocol ${PROTOCOL_VERSION}, ${Object.keys(doc.definitions).length} definitions`);
  ' 2>&1)" || { log "sanity check failed: $got"; exit 1; }
  case "$got" in
    "protocol 4,"*) ;;
    *) log "sanity check failed: $got"; exit 1 ;;
  esac
  printf '%s' "$STAMP" >"$PREFIX/$MARKER"
  log "$got; ready ($((SECONDS - T0)) s)"
fi
emit
