#!/usr/bin/env bash
# Memory per live run (issue 12): what one quiet run in flight costs clawmux, read from its RSS.
#
#   bench/memory.sh                      # MEM_RUNS=2000 runs of the release build
#   BENCH_BIN=/path/to/clawmux MEM_RUNS=5000 bench/memory.sh
#
# A replay gateway plays the recorded short run slowed down (MEM_SPEED, 0.02: the ACK after
# ~1 s, the first delta after ~15 s), so every run is admitted, accepted and attached to by its
# SSE client, but quiet: a few lifecycle events, no text yet. `clawmux load --runs N
# --concurrency N` starts them all at once; once the gateway has accepted all N (the
# `clawmux_runs_started_total` counter) and 2 s have passed, clawmux's RSS is read.
#   per run = (RSS with N runs in flight - RSS before) / N
# The same is printed for a second, later reading (runs still quiet) to show it is stable.
# Everything started is stopped by PID on exit; every wait is bounded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
REPO="$(pwd)"
BIN="${BENCH_BIN:-$REPO/target/release/clawmux}"
N="${MEM_RUNS:-2000}"
SPEED="${MEM_SPEED:-0.02}"
CASSETTE="${BENCH_CASSETTE:-tests/cassettes/openclaw-2026.9.6-short.jsonl}"
WORK="$(mktemp -d /tmp/clawmux-mem.XXXXXX)"
[ -x "$BIN" ] || { echo "bench/memory.sh: no binary at $BIN (cargo build --release, or BENCH_BIN)" >&2; exit 2; }

GW_PID=""; CM_PID=""; LOAD_PID=""
cleanup() { stop_pid "$LOAD_PID"; stop_pid "$CM_PID"; stop_pid "$GW_PID"; }
trap cleanup EXIT INT TERM
wait_http() { for _ in $(seq 1 $(( $2 * 10 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
metric() { curl -fsS "http://127.0.0.1:$CM_PORT/metrics" 2>/dev/null | awk -v m="$1" '$1 == m {print int($2)}' | head -1; }

TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
GW_PORT="$(free_port)"; STATS_PORT="$(free_port)"; CM_PORT="$(free_port)"
CLAWMUX_REPLAY_TOKEN="$TOKEN" CLAWMUX_LOG=warn "$BIN" replay-gateway --cassette "$CASSETTE" --listen "127.0.0.1:$GW_PORT" \
  --speed "$SPEED" --deltas 20 --stats-listen "127.0.0.1:$STATS_PORT" >"$WORK/gateway.log" 2>&1 &
GW_PID=$!
wait_http "http://127.0.0.1:$STATS_PORT/stats" 20 || { echo "gateway did not start" >&2; exit 1; }
CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$GW_PORT" CLAWMUX_GATEWAY_TOKEN="$TOKEN" CLAWMUX_LISTEN="127.0.0.1:$CM_PORT" \
  CLAWMUX_STORE_URL="sqlite://$WORK/store.db" CLAWMUX_MAX_RUNS="$((N + 100))" HOME="$WORK" CLAWMUX_LOG=warn "$BIN" serve >"$WORK/clawmux.log" 2>&1 &
CM_PID=$!
wait_http "http://127.0.0.1:$CM_PORT/readyz" 30 || { echo "clawmux did not become ready" >&2; exit 1; }
sleep 1
rss0="$(rss_kb "$CM_PID")"
CLAWMUX_GATEWAY_TOKEN="$TOKEN" "$BIN" load --target "http://127.0.0.1:$CM_PORT" --runs "$N" --concurrency "$N" \
  --timeout-sec 120 --deadline-sec 150 --json --no-progress --model cogni/fake-model >"$WORK/load.json" 2>"$WORK/load.err" &
LOAD_PID=$!
started=0
for _ in $(seq 1 600); do   # up to 60 s for N runs to be accepted
  started="$(metric clawmux_runs_started_total)"; started="${started:-0}"
  [ "$started" -ge "$N" ] && break
  sleep 0.1
done
sleep 2
rss1="$(rss_kb "$CM_PID")"; active1="$(metric clawmux_runs_active)"
sleep 3
rss2="$(rss_kb "$CM_PID")"; active2="$(metric clawmux_runs_active)"
python3 - "$N" "$started" "$rss0" "$rss1" "$rss2" "$active1" "$active2" "$BIN" <<'PY'
import sys
n, started, rss0, rss1, rss2 = map(int, sys.argv[1:6])
a1, a2, binary = sys.argv[6], sys.argv[7], sys.argv[8]
print(f"binary: {binary}")
print(f"runs: {n}, started on the gateway: {started}, in flight at the readings: {a1}, {a2}")
print(f"RSS before: {rss0/1024:.1f} MiB; with the runs in flight: {rss1/1024:.1f} MiB, 3 s later {rss2/1024:.1f} MiB")
print(f"per run: {(rss1-rss0)/n:.1f} KiB (3 s later: {(rss2-rss0)/n:.1f} KiB)")
PY
