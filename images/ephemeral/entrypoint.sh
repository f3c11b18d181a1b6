#!/bin/sh
# Starts the LLM bridge (127.0.0.1:8080 → /llm-sock/llm.sock), waits until it listens, then runs
# the command (clawmux passes `openclaw agent --local ...` as an argument vector: no shell string).
set -eu
ready="$(mktemp /tmp/bridge.XXXXXX)"
node /usr/local/lib/clawmux/bridge.mjs >"$ready" 2>/dev/null &
i=0
while [ ! -s "$ready" ]; do
  i=$((i + 1))
  if [ "$i" -gt 200 ]; then echo "clawmux-ephemeral: the LLM bridge did not start" >&2; exit 70; fi
  sleep 0.05
done
rm -f "$ready"
exec "$@"
