#!/usr/bin/env bash
# The whole-system case of issue 12, as a new user would try it: a replay gateway playing the long
# recorded run (3.5 s) re-cut into 20 deltas, `clawmux serve`, `clawmux load --runs N --concurrency C`.
# Prints one JSON line: clawmux CPU per run (utime+stime from /proc), peak RSS (VmHWM), the load
# driver's latencies (accepted, first delta, terminal), finals, errors, isolation violations, and
# clawmux's added latency during the load (`clawmux_frame_to_client_seconds`: a frame's arrival on
# the gateway socket to its delta handed to the SSE clients; histogram bucket upper bounds), and
# where the runs' wait for `accepted` went, by stage (`clawmux_run_start_seconds`, the same way).
#
#   BENCH_BIN=target/release/clawmux SYS_C=1000 SYS_RUNS=2000 bench/system.sh
#
# Each clawmux binary named in BENCH_BINS (space-separated) is measured SYS_REPS times, alternating,
# so that two builds compare on the same machine load. The replay gateway and the load driver are
# the measured binary's own, or SYS_GW_BIN's (one build of them for every clawmux measured: its
# own CPU then stays out of the comparison). Everything started is stopped by PID.
# Also printed: clawmux's context switches per run (all its threads, /proc). SYS_STORE_DIR puts the
# SQLite file elsewhere (e.g. /dev/shm: a store without real fsyncs, to see the disk's share);
# SYS_STORE_URL replaces the store (e.g. `memory:`). SYS_DELTAS: deltas per run (20). SYS_CM_CPUS
# and SYS_TOOLS_CPUS pin clawmux, and the replay gateway with the load driver, to CPU lists
# (`taskset -c`): e.g. 0 and 1 keep clawmux's thread hand-offs on one CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
REPO="$(pwd)"
BINS="${BENCH_BINS:-${BENCH_BIN:-$REPO/target/release/clawmux}}"
C="${SYS_C:-1000}"
RUNS="${SYS_RUNS:-2000}"
REPS="${SYS_REPS:-1}"
CASSETTE="${BENCH_CASSETTE:-tests/cassettes/openclaw-2026.9.6-long.jsonl}"
DEADLINE="${SYS_DEADLINE:-300}"
WORK="$(mktemp -d /tmp/clawmux-sys.XXXXXX)"
CM_PIN=(); TOOLS_PIN=()
[ -n "${SYS_CM_CPUS:-}" ] && CM_PIN=(taskset -c "$SYS_CM_CPUS")
[ -n "${SYS_TOOLS_CPUS:-}" ] && TOOLS_PIN=(taskset -c "$SYS_TOOLS_CPUS")

GW_PID=""; CM_PID=""
cleanup() { stop_pid "$CM_PID"; stop_pid "$GW_PID"; }
trap cleanup EXIT INT TERM
wait_http() { for _ in $(seq 1 $(( $2 * 10 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# Context switches (voluntary + not) of all of a process's threads.
ctx_switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ {s += $2} END {print s + 0}'; }
hwm_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"

one() { # BIN REP
  local bin="$1" rep="$2"
  local gp sp cp out="$WORK/load-$rep-$RANDOM.json"
  gp="$(free_port)"; sp="$(free_port)"; cp="$(free_port)"
  local tools="${SYS_GW_BIN:-$bin}"
  local store; store="${SYS_STORE_DIR:-$WORK}/clawmux-sys-store-$$-$RANDOM$RANDOM.db"
  CLAWMUX_REPLAY_TOKEN="$TOKEN" CLAWMUX_LOG=warn "${TOOLS_PIN[@]}" "$tools" replay-gateway --cassette "$CASSETTE" --listen "127.0.0.1:$gp" \
    --speed 1 --deltas ${SYS_DELTAS:-20} --stats-listen "127.0.0.1:$sp" >>"$WORK/gateway.log" 2>&1 &
  GW_PID=$!
  wait_http "http://127.0.0.1:$sp/stats" 20 || { echo "gateway did not start" >&2; return 1; }
  CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$gp" CLAWMUX_GATEWAY_TOKEN="$TOKEN" CLAWMUX_LISTEN="127.0.0.1:$cp" \
    CLAWMUX_STORE_URL="${SYS_STORE_URL:-sqlite://$store}" CLAWMUX_MAX_RUNS="$((C + 100))" HOME="$WORK" CLAWMUX_LOG=warn \
    "${CM_PIN[@]}" "$bin" serve >>"$WORK/clawmux.log" 2>&1 &
  CM_PID=$!
  wait_http "http://127.0.0.1:$cp/readyz" 30 || { echo "clawmux did not become ready" >&2; return 1; }
  # Warm-up (not measured): connections, allocator, the gateway's sessions.
  CLAWMUX_GATEWAY_TOKEN="$TOKEN" timeout 120 "${TOOLS_PIN[@]}" "$tools" load --target "http://127.0.0.1:$cp" --runs 20 --concurrency 20 \
    --timeout-sec 60 --deadline-sec 60 --json --no-progress >/dev/null 2>&1 || true
  echo 5 >"/proc/$CM_PID/clear_refs" 2>/dev/null || true
  local cpu0 cpu1 gcpu0 gcpu1 t0 t1 lcpu
  # The added-latency histogram before the load (the warm-up's share is subtracted).
  curl -fsS "http://127.0.0.1:$cp/metrics" >"$out.metrics0" 2>/dev/null || true
  cpu0="$(cpu_ticks "$CM_PID")"; gcpu0="$(cpu_ticks "$GW_PID")"; cs0="$(ctx_switches "$CM_PID")"; t0="$(date +%s.%N)"
  CLAWMUX_GATEWAY_TOKEN="$TOKEN" timeout --signal=TERM --kill-after=10 $((DEADLINE + 30)) "$BENCH_TIME" -f '%U %S' -o "$out.time" \
    "${TOOLS_PIN[@]}" "$tools" load --target "http://127.0.0.1:$cp" --runs "$RUNS" --concurrency "$C" --timeout-sec 120 \
    --deadline-sec "$DEADLINE" --json --no-progress --model cogni/fake-model >"$out" 2>"$out.err" || true
  t1="$(date +%s.%N)"; cpu1="$(cpu_ticks "$CM_PID")"; gcpu1="$(cpu_ticks "$GW_PID")"; cs1="$(ctx_switches "$CM_PID")"
  curl -fsS "http://127.0.0.1:$cp/metrics" >"$out.metrics1" 2>/dev/null || true
  local hwm; hwm="$(hwm_kb "$CM_PID")"; lcpu="$(awk '{print $1 + $2}' "$out.time" 2>/dev/null || echo 0)"
  stop_pid "$CM_PID"; CM_PID=""; stop_pid "$GW_PID"; GW_PID=""
  rm -f "$store" "$store"-*  # the database, its WAL and shared memory (SYS_STORE_DIR may be RAM)
  python3 - "$bin" "$rep" "$C" "$RUNS" "$out" "$cpu0" "$cpu1" "$(getconf CLK_TCK)" "$t0" "$t1" "$hwm" "$lcpu" "$(cut -d' ' -f1 /proc/loadavg)" "$gcpu0" "$gcpu1" "${SYS_GW_BIN:-$bin}" "$cs0" "$cs1" <<'PY'
import json, sys
binary, rep, c, runs, out, cpu0, cpu1, tck, t0, t1, hwm, lcpu, load, gcpu0, gcpu1, tools, cs0, cs1 = sys.argv[1:]
try:
    r = json.load(open(out))
except Exception as e:
    r = {"error": str(e)}
lat = r.get("latencyMs") or {}
def p(s, q):
    return ((lat.get(s) or {}).get(q))
def buckets(path, name, label=""):
    # Cumulative bucket counts by upper bound (seconds) of one histogram in a /metrics scrape
    # (its series with `label`, e.g. 'stage="turn"', when given).
    b = {}
    try:
        for line in open(path):
            if line.startswith(name + "_bucket") and label in line:
                le = line.split('le="')[1].split('"')[0]
                b[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    except OSError:
        pass
    return b
def during_load(name, label=""):
    # A histogram's samples during the load only: bucket upper bounds in ms (the true value is at
    # most that).
    b0, b1 = buckets(out + ".metrics0", name, label), buckets(out + ".metrics1", name, label)
    d = sorted((le, n - b0.get(le, 0.0)) for le, n in b1.items())
    if not d or d[-1][1] <= 0:
        return None
    total = d[-1][1]
    res = {"n": int(total)}
    for q, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (0.999, "p99.9")):
        le = next(le for le, n in d if n >= q * total)
        res[key] = None if le == float("inf") else round(le * 1000, 3)
    return res
def added_latency():
    return during_load("clawmux_frame_to_client_seconds")
def start_stages():
    return {s: during_load("clawmux_run_start_seconds", f'stage="{s}"') for s in ("admit", "turn", "configure", "gateway")}
cpu = (int(cpu1) - int(cpu0)) / int(tck)
done = max(1, (r.get("finals") or 0) + (r.get("errors") or 0))
print(json.dumps({
    "bin": binary, "rep": int(rep), "concurrency": int(c), "runs": int(runs), "finals": r.get("finals"), "errors": r.get("errors"),
    "errorsByCode": r.get("errorsByCode"), "violations": r.get("isolationViolations"), "interrupted": r.get("interrupted"),
    "cmCpuSec": round(cpu, 2), "cmCpuMsPerRun": round(1000 * cpu / done, 3), "wallSec": round(float(t1) - float(t0), 1),
    "cmPeakRssMb": round(int(hwm) / 1024, 1), "loadDriverCpuSec": float(lcpu),
    "gatewayCpuSec": round((int(gcpu1) - int(gcpu0)) / int(tck), 2), "tools": tools, "loadavg1AtEnd": float(load),
    "cmCtxSwitchesPerRun": round((int(cs1) - int(cs0)) / done, 1),
    "acceptedMs": {q: p("accepted", q) for q in ("p50", "p95", "p99")},
    "firstDeltaMs": {q: p("firstDelta", q) for q in ("p50", "p99")},
    "terminalMs": {q: p("terminal", q) for q in ("p50", "p99")},
    "addedLatencyMsAtMost": added_latency(),
    "startStageMsAtMost": start_stages(),
}))
PY
}

BENCH_TIME="$(command -v time || true)"
[ -x /usr/bin/time ] && BENCH_TIME=/usr/bin/time
[ -n "$BENCH_TIME" ] || { echo "bench/system.sh: needs /usr/bin/time (the load driver's own CPU)" >&2; exit 2; }
for rep in $(seq 1 "$REPS"); do
  for bin in $BINS; do one "$bin" "$rep"; done
done
