#!/usr/bin/env bash
# Issue 14's replicas case: 1, 2 and 3 clawmux replicas on one PostgreSQL store and one replay
# gateway (each replica its own gateway connection), C concurrent runs in total split evenly over
# the replicas (one `clawmux load` per replica, all at once). Prints per N: runs/s (all replicas),
# finals, isolation violations, accepted / first-delta p99 (worst replica), clawmux CPU per run (sum
# over the replicas), PostgreSQL CPU per run (every process of the test cluster); then, for N >= 2,
# the cross-replica live latency: XR_RUNS runs posted (SSE) to replica 1 while a second SSE stream
# re-attaches to each on replica 2; for every event, its arrival on replica 2 minus its arrival on
# replica 1 (the owner), p50/p99/max.
#
#   bench/replicas.sh            # REPLICA_C=1000 REPLICA_RUNS=2000 REPLICA_LEVELS="1 2 3" XR_RUNS=50
#
# Starts a PostgreSQL of its own (tests/support/postgres.sh, a temp dir), a replay gateway (the short
# recorded run, 20 deltas) and the replicas on 127.0.0.1 free ports; stops everything by PID.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
C="${REPLICA_C:-1000}"; RUNS="${REPLICA_RUNS:-2000}"; LEVELS="${REPLICA_LEVELS:-1 2 3}"; XR_RUNS="${XR_RUNS:-50}"
cargo build --release --locked -q
BIN="$PWD/target/release/clawmux"
WORK="$(mktemp -d /tmp/clawmux-replicas.XXXXXX)"
TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
GW_PID=""; CM_PIDS=""
stop_all() { for p in $CM_PIDS $GW_PID; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; CM_PIDS=""; }
cleanup() { stop_all; tests/support/postgres.sh stop "$WORK/pg" >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT INT TERM
mkdir -p "$WORK/pg"; chmod 711 "$WORK"  # the server runs as an unprivileged user: it must reach DIR
tests/support/postgres.sh start "$WORK/pg" >/dev/null
# shellcheck disable=SC1091
. "$WORK/pg/env"
PG_URL="$CLAWMUX_TEST_PG_URL"
# Every process of the test cluster: the postmaster and its children (backends, WAL writer, ...).
pg_cpu() { local t=0 p; for p in $PG_PID $(pgrep -P "$PG_PID" || true); do t="$(echo "$t + $(cpu_of "$p")" | bc -l)"; done; echo "$t"; }
psql_url() { PGPASSWORD="$(cat "$WORK/pg/password")" "$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)/psql" -h 127.0.0.1 -p "$PG_PORT" -U clawmux -d clawmux -qAt -c "$1"; }

for N in $LEVELS; do
  # A fresh schema per level: drop what the previous level stored.
  psql_url "DROP SCHEMA public CASCADE; CREATE SCHEMA public;" >/dev/null
  GW_PORT="$(free_port)"
  CLAWMUX_REPLAY_TOKEN="$TOKEN" CLAWMUX_LOG=warn "$BIN" replay-gateway --cassette tests/cassettes/openclaw-2026.9.6-short.jsonl \
    --listen "127.0.0.1:$GW_PORT" --speed 1 --deltas 20 >/dev/null 2>&1 &
  GW_PID=$!
  sleep 0.5
  PORTS=""
  for i in $(seq 1 "$N"); do
    port="$(free_port)"; PORTS="$PORTS $port"
    CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$GW_PORT" CLAWMUX_GATEWAY_TOKEN="$TOKEN" CLAWMUX_LISTEN="127.0.0.1:$port" \
      CLAWMUX_STORE_URL="$PG_URL" CLAWMUX_REPLICA_ID="bench-$i" CLAWMUX_MAX_RUNS=20000 CLAWMUX_DEVICE_IDENTITY=off CLAWMUX_LOG=warn \
      "$BIN" serve >"$WORK/cm-$i.log" 2>&1 &
    CM_PIDS="$CM_PIDS $!"
    for _ in $(seq 1 100); do curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
  done
  PG0="$(pg_cpu)"
  T0="$(date +%s.%N)"
  i=0; LPIDS=""
  for port in $PORTS; do
    i=$((i + 1))
    timeout 300 "$BIN" load --target "http://127.0.0.1:$port" --runs $((RUNS / N)) --concurrency $((C / N)) --timeout-sec 60 \
      --deadline-sec 240 --no-progress --json >"$WORK/load-$N-$i.json" 2>/dev/null &
    LPIDS="$LPIDS $!"
  done
  for p in $LPIDS; do wait "$p" || true; done
  T1="$(date +%s.%N)"
  PG1="$(pg_cpu)"
  CM_CPU=0; for p in $CM_PIDS; do CM_CPU="$(echo "$CM_CPU + $(cpu_of "$p")" | bc -l)"; done
  XR=""
  if [ "$N" -ge 2 ]; then
    set -- $PORTS
    XR="$(python3 bench/replicas_xr.py "http://127.0.0.1:$1" "http://127.0.0.1:$2" "$XR_RUNS")"
  fi
  N="$N" C="$C" WALL="$(echo "$T1 - $T0" | bc -l)" CM_CPU="$CM_CPU" PG_CPU="$(echo "$PG1 - $PG0" | bc -l)" XR="$XR" WORK="$WORK" python3 - <<'PY'
import glob, json, os
n, wall = int(os.environ["N"]), float(os.environ["WALL"])
loads = [json.load(open(f)) for f in sorted(glob.glob(f'{os.environ["WORK"]}/load-{n}-*.json'))]
runs = sum(l["runs"] for l in loads); finals = sum(l["finals"] for l in loads)
viol = sum(l["isolationViolations"] for l in loads)
acc = max((l["latencyMs"]["accepted"] or {}).get("p99", 0) for l in loads)
first = max((l["latencyMs"]["firstDelta"] or {}).get("p99", 0) for l in loads)
cm, pg = float(os.environ["CM_CPU"]), float(os.environ["PG_CPU"])
print(f"replicas={n} C={os.environ['C']} runs={runs} finals={finals} violations={viol} runs/s={runs / wall:.0f} "
      f"accepted p99={acc:.0f} ms first-delta p99={first:.0f} ms clawmux CPU={cm / runs * 1000:.2f} ms/run "
      f"PostgreSQL CPU={pg / runs * 1000:.2f} ms/run {os.environ['XR']}")
PY
  stop_all
done
