#!/bin/sh
# The gateway's token, from the environment of a one-shot container into the state volume
# (compose.yaml: the service gateway-token). The gateway container itself never has the token in
# its environment or arguments: its config reads this file (a SecretRef of source "file").
#
# The file: /var/lib/openclaw/secrets/gateway-token, mode 0600, owned by the gateway's user, one
# hard link, written whole (temp file + rename): what OpenClaw's file secret provider accepts.
# printf is a shell builtin: the token is in no process's arguments.
set -eu
if [ -z "${OPENCLAW_GATEWAY_TOKEN:-}" ]; then
  echo "token-init: OPENCLAW_GATEWAY_TOKEN is empty (set CLAWMUX_GATEWAY_TOKEN in the env file)" >&2
  exit 2
fi
umask 077
dir=/var/lib/openclaw/secrets
mkdir -p "$dir"
tmp="$(mktemp "$dir/.gateway-token.XXXXXX")"
printf '%s' "$OPENCLAW_GATEWAY_TOKEN" >"$tmp"
mv -f "$tmp" "$dir/gateway-token"
echo "token-init: wrote $dir/gateway-token" >&2
