#!/usr/bin/env bash
# clawmux's added latency under load: from a chat frame's arrival on the gateway socket to its
# delta, stored, taken by a live SSE client's stream (metric clawmux_frame_to_client_seconds), at concurrency C
# (default 1000) with 20 deltas per run against the replay gateway. Prints p50/p90/p99/p99.9 as
# histogram bucket upper bounds (the true value is at most that).
#
#   bench/latency.sh [CONCURRENCY] [RUNS]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
C="${1:-1000}"; RUNS="${2:-3000}"
# BENCH_STORE_URL (memory:; e.g. sqlite:///tmp/x.db) is the store clawmux writes to.
# BENCH_NICE=1 runs the load driver and the replay gateway at nice 19, so that clawmux gets the CPU
# it would have on a machine of its own (all three share 2 cores here).
NICE=""; [ "${BENCH_NICE:-0}" = 1 ] && NICE="nice -n 19"
# BENCH_BIN: a clawmux binary to measure (e.g. another build, to compare in the same session);
# default: this tree's release build.
if [ -n "${BENCH_BIN:-}" ]; then
  BIN="$BENCH_BIN"
else
  cargo build --release --locked -q
  BIN="${CARGO_TARGET_DIR:-$PWD/target}/release/clawmux"
fi
TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
GW_PORT="$(free_port)"; CM_PORT="$(free_port)"
GW_PID=""; CM_PID=""
cleanup() { for p in $CM_PID $GW_PID; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
CLAWMUX_REPLAY_TOKEN="$TOKEN" CLAWMUX_LOG=warn $NICE "$BIN" replay-gateway --cassette tests/cassettes/openclaw-2026.9.6-short.jsonl \
  --listen "127.0.0.1:$GW_PORT" --speed 1 --deltas 20 >/dev/null 2>&1 &
GW_PID=$!
sleep 0.5
CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$GW_PORT" CLAWMUX_GATEWAY_TOKEN="$TOKEN" CLAWMUX_LISTEN="127.0.0.1:$CM_PORT" \
  CLAWMUX_STORE_URL="${BENCH_STORE_URL:-memory:}" CLAWMUX_DEVICE_IDENTITY=off CLAWMUX_LOG=warn "$BIN" serve >/dev/null 2>&1 &
CM_PID=$!
for _ in $(seq 1 100); do curl -fsS "http://127.0.0.1:$CM_PORT/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
# The load driver's CPU: the subshell's `times` (its children's user and system time).
LOAD_TIMES="$( { timeout 300 $NICE "$BIN" load --target "http://127.0.0.1:$CM_PORT" --runs "$RUNS" --concurrency "$C" --timeout-sec 60 \
  --deadline-sec 240 --no-progress --json > /tmp/clawmux-latency-load.json || echo "the load driver says not every run ended final (details below)" >&2; times; } | tail -1)"
# CPU (user + system, seconds) of clawmux and of the replay gateway, clawmux's peak RSS, from /proc.
CPU_SEC="$(cpu_of "$CM_PID")"; GW_CPU_SEC="$(cpu_of "$GW_PID")"
LOAD_CPU_SEC="$(echo "$LOAD_TIMES" | awk '{ n = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); n += t[1] * 60 + t[2] } print n }')"
PEAK_RSS_KB="$(awk '/^VmHWM/ {print $2}' "/proc/$CM_PID/status")"
curl -fsS "http://127.0.0.1:$CM_PORT/metrics" | CPU_SEC="$CPU_SEC" GW_CPU_SEC="$GW_CPU_SEC" LOAD_CPU_SEC="$LOAD_CPU_SEC" \
  PEAK_RSS_KB="$PEAK_RSS_KB" SHARDS="${CLAWMUX_SHARDS:-cores}" python3 -c '
import sys, json
buckets = []
for line in sys.stdin:
    if line.startswith("clawmux_frame_to_client_seconds_bucket"):
        le = line.split("le=\"")[1].split("\"")[0]
        buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
total = buckets[-1][1]
load = json.load(open("/tmp/clawmux-latency-load.json"))
finals, viol = load.get("finals"), load.get("isolationViolations")
print("runs final:", finals, " isolation violations:", viol, " deltas measured:", int(total))
for q in (0.5, 0.9, 0.99, 0.999):
    le = next(b for b, c in buckets if c >= q * total)
    print(f"p{q*100:g}: <= {le*1000:g} ms")
import os
acc, first = load["latencyMs"]["accepted"]["p99"], load["latencyMs"]["firstDelta"]["p99"]
cpu, runs, rps = float(os.environ["CPU_SEC"]), load["runs"], load["runsPerSec"]
shards, rss = os.environ["SHARDS"], int(os.environ["PEAK_RSS_KB"]) / 1024
print(f"shards={shards} runs/s={rps:.0f} accepted p99={acc:.0f} ms first-delta p99={first:.0f} ms", end=" ")
print(f"clawmux CPU={cpu:.2f} s ({cpu / runs * 1000:.2f} ms/run) peak RSS={rss:.0f} MiB ({rss * 1024 / runs:.0f} KiB/run)")
gw, drv = float(os.environ["GW_CPU_SEC"]), float(os.environ["LOAD_CPU_SEC"])
la = open("/proc/loadavg").read().split()[0]
print(f"CPU of the others: replay gateway {gw:.2f} s, load driver {drv:.2f} s; load average {la}")
'
