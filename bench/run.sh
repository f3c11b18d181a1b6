#!/usr/bin/env bash
# Whole-system load benchmark: clawmux (one multiplexed gateway connection) side by side with the
# connection-per-call design it replaces, against the SAME replay gateway, on this machine.
# Writes BENCHMARKS.md.
#
#   bench/run.sh
#
# What it does (every step bounded; everything it starts is stopped by PID on exit):
#   1. cargo build --release; the criterion hot-path bench (benches/hot_path.rs).
#   2. clawmux replay-gateway with the recorded short cassette, --deltas 20 (each run streams 20
#      deltas over ~540 ms of recorded timing), --stats-listen for the frames/bytes it sent.
#   3. For concurrency 10, 100, 1000: a fresh `clawmux serve` pointed at it; `clawmux load` through
#      clawmux and `clawmux load --direct per-call` against the gateway, BENCH_REPS times each (the
#      table shows medians); gateway frames and bytes (stats endpoint, before/after), clawmux CPU
#      (/proc/PID/stat) and peak RSS (VmHWM after clear_refs) around every load.
#   4. BENCHMARKS.md: the table, ratios, targets met or missed, machine, date, command.
#
# Knobs (env): BENCH_REPS (3), BENCH_LEVELS ("10 100 1000"), BENCH_OUT (BENCHMARKS.md),
#   BENCH_SPEED (1 = recorded timing), BENCH_CRITERION (1), BENCH_PERCALL_1000_RUNS (1000), BENCH_CASSETTE,
#   BENCH_GW_RSS_LIMIT_MB (6000: a per-call load is stopped when the gateway's buffers grow past it),
#   BENCH_STORE (sqlite: a fresh file per clawmux; or memory). The store's own cost: bench/store.sh.
#   BENCH_STORE_SECTION (1: then bench/store.sh adds the store section).
# The per-call design at concurrency 1000 makes the gateway send ~N x N frames (every socket gets
# every run's events); it runs once (not 3 times) with a deadline and the memory guard above.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
REPO="$(pwd)"

REPS="${BENCH_REPS:-3}"
LEVELS="${BENCH_LEVELS:-10 100 1000}"
OUT="${BENCH_OUT:-BENCHMARKS.md}"
SPEED="${BENCH_SPEED:-1}"
DELTAS=20
CASSETTE="${BENCH_CASSETTE:-tests/cassettes/openclaw-2026.9.6-short.jsonl}"
PERCALL_1000_RUNS="${BENCH_PERCALL_1000_RUNS:-1000}"
GW_RSS_LIMIT_MB="${BENCH_GW_RSS_LIMIT_MB:-6000}"
BIN="$REPO/target/release/clawmux"
WORK="$(mktemp -d /tmp/clawmux-bench.XXXXXX)"
RESULTS="$WORK/results.jsonl"
# The store is explicit (never the user's ~/.local/share/clawmux): a fresh SQLite file per clawmux,
# the default a user gets; BENCH_STORE=memory measures without it (bench/store.sh compares both).
STORE_URL=""
next_store() { if [ "${BENCH_STORE:-sqlite}" = memory ]; then STORE_URL="memory:"; else STORE_URL="sqlite://$WORK/store-$RANDOM$RANDOM.db"; fi; }
: >"$RESULTS"
STARTED_AT="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
T0=$(date +%s)

say() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'bench/run.sh: %s\n' "$*" >&2; exit 1; }

GW_PID=""; CM_PID=""
cleanup() { stop_pid "$CM_PID"; stop_pid "$GW_PID"; }
trap cleanup EXIT INT TERM

wait_http() { # URL SECONDS
  for _ in $(seq 1 $(( $2 * 10 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
hwm_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
CLK_TCK="$(getconf CLK_TCK)"

say "build (release)"
cargo build --release --bin clawmux 2>&1 | tail -1 >&2

CRITERION_TXT="$WORK/criterion.txt"
if [ "${BENCH_CRITERION:-1}" = "1" ]; then
  say "criterion: benches/hot_path.rs"
  timeout 600 cargo bench --bench hot_path 2>/dev/null | grep -E '^hot_path/|thrpt:|time:' >"$CRITERION_TXT" || true
fi

TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
GW_PORT="$(free_port)"; STATS_PORT="$(free_port)"
STATS_URL="http://127.0.0.1:$STATS_PORT/stats"

# A fresh replay gateway per design and level: its memory (run records, per-connection queues)
# from one measurement must not count against the next one's memory guard.
start_gateway() {
  stop_pid "$GW_PID"
  say "replay gateway: $CASSETTE, --deltas $DELTAS, --speed $SPEED"
  CLAWMUX_REPLAY_TOKEN="$TOKEN" CLAWMUX_LOG=warn "$BIN" replay-gateway --cassette "$CASSETTE" \
    --listen "127.0.0.1:$GW_PORT" --speed "$SPEED" --deltas "$DELTAS" --stats-listen "127.0.0.1:$STATS_PORT" \
    >>"$WORK/gateway.log" 2>&1 &
  GW_PID=$!
  wait_http "$STATS_URL" 20 || die "replay gateway did not start (see $WORK/gateway.log)"
}

start_clawmux() {
  stop_pid "$CM_PID"
  next_store
  CM_PORT="$(free_port)"
  CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$GW_PORT" CLAWMUX_GATEWAY_TOKEN="$TOKEN" CLAWMUX_LISTEN="127.0.0.1:$CM_PORT" \
    CLAWMUX_STORE_URL="$STORE_URL" HOME="$WORK" CLAWMUX_LOG=warn "$BIN" serve >>"$WORK/clawmux.log" 2>&1 &
  CM_PID=$!
  wait_http "http://127.0.0.1:$CM_PORT/readyz" 30 || die "clawmux did not become ready (see $WORK/clawmux.log)"
}

stat_field() { python3 -c 'import json,sys; print(json.load(sys.stdin).get(sys.argv[1], 0))' "$1"; }

# run_case MODE CONCURRENCY RUNS REP DEADLINE
run_case() {
  local mode="$1" c="$2" runs="$3" rep="$4" deadline="$5"
  local out="$WORK/load-$mode-$c-$rep.json"
  curl -fsS "$STATS_URL" >"$out.before"
  echo 5 >"/proc/$CM_PID/clear_refs" 2>/dev/null || true   # reset clawmux's peak RSS
  echo 5 >"/proc/$GW_PID/clear_refs" 2>/dev/null || true
  local cpu0 rss0 t0 t1
  cpu0="$(cpu_ticks "$CM_PID")"; rss0="$(rss_kb "$CM_PID")"; t0="$(date +%s.%N)"
  local args=(load --runs "$runs" --concurrency "$c" --timeout-sec 60 --deadline-sec "$deadline" --json --no-progress --model cogni/fake-model)
  if [ "$mode" = "clawmux" ]; then
    args+=(--target "http://127.0.0.1:$CM_PORT")
  else
    args+=(--direct per-call --gateway "ws://127.0.0.1:$GW_PORT")
  fi
  CLAWMUX_GATEWAY_TOKEN="$TOKEN" timeout --signal=TERM --kill-after=10 $((deadline + 30)) "$BIN" "${args[@]}" >"$out" 2>"$out.err" &
  local load_pid=$! guard_hit=0 gw_peak=0
  # Memory guard: the per-call design can make the gateway buffer gigabytes of broadcast frames.
  while kill -0 "$load_pid" 2>/dev/null; do
    local g; g="$(rss_kb "$GW_PID")"; [ "$g" -gt "$gw_peak" ] && gw_peak="$g"
    if [ "$g" -gt $((GW_RSS_LIMIT_MB * 1024)) ] && [ "$guard_hit" = 0 ]; then
      guard_hit=1; kill -TERM "$load_pid" 2>/dev/null || true
    fi
    sleep 0.25
  done
  wait "$load_pid" 2>/dev/null || true
  t1="$(date +%s.%N)"
  sleep 0.5   # let the gateway count the frames its sockets flushed
  curl -fsS "$STATS_URL" >"$out.after"
  local cpu1 hwm gw_hwm
  cpu1="$(cpu_ticks "$CM_PID")"; hwm="$(hwm_kb "$CM_PID")"; gw_hwm="$(hwm_kb "$GW_PID")"
  [ "$gw_hwm" -gt "$gw_peak" ] && gw_peak="$gw_hwm"
  python3 - "$mode" "$c" "$runs" "$rep" "$out" "$out.before" "$out.after" "$cpu0" "$cpu1" "$CLK_TCK" "$t0" "$t1" "$rss0" "$hwm" "$gw_peak" "$guard_hit" >>"$RESULTS" <<'PY'
import json, sys
mode, c, runs, rep, out, before, after, cpu0, cpu1, tck, t0, t1, rss0, hwm, gw_peak, guard = sys.argv[1:]
try:
    report = json.load(open(out))
except Exception as e:
    report = {"error": f"no report: {e}"}
b, a = json.load(open(before)), json.load(open(after))
wall = float(t1) - float(t0)
row = {
    "mode": mode, "concurrency": int(c), "runs": int(runs), "rep": int(rep), "report": report,
    "gwFrames": a["framesSent"] - b["framesSent"], "gwBytes": a["bytesSent"] - b["bytesSent"],
    "gwHandshakes": a["handshakesOk"] - b["handshakesOk"],
    "gwChatAgentEvents": sum(a["eventsSent"].get(k, 0) - b["eventsSent"].get(k, 0) for k in ("chat", "agent")),
    "cmCpuSec": (int(cpu1) - int(cpu0)) / int(tck), "wallSec": wall,
    "cmRssStartMb": int(rss0) / 1024, "cmPeakRssMb": int(hwm) / 1024, "gwPeakRssMb": int(gw_peak) / 1024,
    "memoryGuardStopped": guard == "1",
}
print(json.dumps(row))
PY
  python3 - "$RESULTS" >&2 <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
rep = r["report"]
acc = (rep.get("latencyMs") or {}).get("accepted") or {}
print(f'  {r["mode"]:8} c={r["concurrency"]:<5} rep={r["rep"]} finals={rep.get("finals")}/{r["runs"]} '
      f'violations={rep.get("isolationViolations")} runs/s={rep.get("runsPerSec", 0):.1f} '
      f'accepted p50={acc.get("p50", 0):.1f} ms frames={r["gwFrames"]} cmCPU={r["cmCpuSec"]:.2f}s '
      f'cmPeakRSS={r["cmPeakRssMb"]:.1f}MB gwPeakRSS={r["gwPeakRssMb"]:.0f}MB'
      + (" STOPPED BY MEMORY GUARD" if r["memoryGuardStopped"] else ""))
PY
}

for c in $LEVELS; do
  say "concurrency $c"
  start_gateway
  start_clawmux
  case "$c" in
    10) cm_runs=200; pc_runs=200 ;;
    100) cm_runs=1000; pc_runs=500 ;;
    *) cm_runs=$((c * 3)); pc_runs="$PERCALL_1000_RUNS" ;;
  esac
  # Warm-up (not measured): connections, allocator, the gateway's sessions.
  CLAWMUX_GATEWAY_TOKEN="$TOKEN" timeout 120 "$BIN" load --target "http://127.0.0.1:$CM_PORT" --runs "$c" --concurrency "$c" \
    --timeout-sec 60 --deadline-sec 60 --json --no-progress >/dev/null 2>&1 || true
  for rep in $(seq 1 "$REPS"); do run_case clawmux "$c" "$cm_runs" "$rep" 120; done
  stop_pid "$CM_PID"; CM_PID=""
  start_gateway
  start_clawmux
  if [ "$c" -ge 1000 ]; then
    run_case per-call "$c" "$pc_runs" 1 150
  else
    for rep in $(seq 1 "$REPS"); do run_case per-call "$c" "$pc_runs" "$rep" 120; done
  fi
done
stop_pid "$CM_PID"; CM_PID=""
stop_pid "$GW_PID"; GW_PID=""
ELAPSED=$(( $(date +%s) - T0 ))

say "writing $OUT"
python3 - "$RESULTS" "$OUT" "$CRITERION_TXT" "$STARTED_AT" "$ELAPSED" "$REPS" "$SPEED" "$DELTAS" "$CASSETTE" "$LEVELS" <<'PY'
import json, statistics, subprocess, sys, os
results_path, out, crit_path, started, elapsed, reps, speed, deltas, cassette, levels = sys.argv[1:]
rows = [json.loads(l) for l in open(results_path) if l.strip()]

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def lat(r, series, p):
    s = ((r["report"].get("latencyMs") or {}).get(series)) or {}
    return s.get(p)

def fmt(x, nd=1):
    if x is None: return "n/a"
    if isinstance(x, float) and nd == 0: return f"{x:,.0f}"
    if isinstance(x, int): return f"{x:,}"
    return f"{x:,.{nd}f}"

groups = {}
for r in rows:
    groups.setdefault((r["concurrency"], r["mode"]), []).append(r)

def summary(rs):
    rep = [r["report"] for r in rs]
    runs_done = [x.get("finals", 0) + x.get("errors", 0) for x in rep]
    return {
        "n": len(rs), "runs": rs[0]["runs"],
        "finals": sum(x.get("finals", 0) for x in rep), "errors": sum(x.get("errors", 0) for x in rep),
        "violations": sum(x.get("isolationViolations", 0) for x in rep),
        "interrupted": any(x.get("interrupted") for x in rep) or any(r["memoryGuardStopped"] for r in rs),
        "rps": med([x.get("runsPerSec") for x in rep]),
        "acc50": med([lat(r, "accepted", "p50") for r in rs]), "acc95": med([lat(r, "accepted", "p95") for r in rs]),
        "acc99": med([lat(r, "accepted", "p99") for r in rs]),
        "fd50": med([lat(r, "firstDelta", "p50") for r in rs]), "fd99": med([lat(r, "firstDelta", "p99") for r in rs]),
        "t50": med([lat(r, "terminal", "p50") for r in rs]), "t95": med([lat(r, "terminal", "p95") for r in rs]),
        "t99": med([lat(r, "terminal", "p99") for r in rs]),
        "frames": med([r["gwFrames"] for r in rs]), "bytes": med([r["gwBytes"] for r in rs]),
        "framesPerRun": med([r["gwFrames"] / max(1, d) for r, d in zip(rs, runs_done)]),
        "bytesPerRun": med([r["gwBytes"] / max(1, d) for r, d in zip(rs, runs_done)]),
        "handshakes": med([r["gwHandshakes"] for r in rs]),
        "cpu": med([r["cmCpuSec"] for r in rs]), "cpuPerRunMs": med([1000 * r["cmCpuSec"] / max(1, d) for r, d in zip(rs, runs_done)]),
        "cores": med([r["cmCpuSec"] / r["wallSec"] for r in rs if r["wallSec"] > 0]),
        "rss": max(r["cmPeakRssMb"] for r in rs), "gwRss": max(r["gwPeakRssMb"] for r in rs),
        "wall": med([r["wallSec"] for r in rs]),
    }

S = {k: summary(v) for k, v in groups.items()}
lv = sorted({k[0] for k in S})

def sh(cmd):
    try: return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception: return "?"

cpu_model = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-").strip()
mem = sh("awk '/MemTotal/ {printf \"%.1f GiB\", $2/1048576}' /proc/meminfo")
nproc = sh("nproc")
commit = sh("git rev-parse --short HEAD")
kernel = sh("uname -r")

L = []
w = L.append
w("# Benchmarks")
w("")
w("Whole-system load: clawmux (one multiplexed connection to the gateway) against the")
w("connection-per-call design it replaces (the reference client: a new WebSocket + handshake for")
w("`sessions.patch`, another for `agent`, no session-scoped events, fail-closed filtering of the")
w("broadcast), both against the SAME replay gateway in the same run. Produced by:")
w("")
w("```sh")
w("bench/run.sh" if levels == "10 100 1000" and reps == "3" else f"BENCH_LEVELS='{levels}' BENCH_REPS={reps} bench/run.sh")
w("```")
w("")
w(f"- Date: {started} (took {int(elapsed)//60} min {int(elapsed)%60} s); commit `{commit}` (+ the working tree of that moment).")
w(f"- Machine: {nproc} cores, {cpu_model}, {mem} RAM, Linux {kernel}. clawmux, the replay gateway and the load")
w("  driver all share these 2 cores, so every number includes the other two processes' CPU use.")
w(f"- Gateway: `clawmux replay-gateway --cassette {cassette} --deltas {deltas} --speed {speed}`: a run")
w("  recorded from openclaw 2026.9.6 with `clawmux record` (ACK at 19 ms, final at 537 ms), re-cut into")
w(f"  {deltas} streamed deltas (~50 chat/agent events per run), real gateway semantics (handshake, scopes,")
w("  broadcast vs. session-scoped delivery).")
w("- Load: `clawmux load --runs N --concurrency C --json` (through `clawmux serve`, release build, a fresh")
w("  process per concurrency level) and `clawmux load --direct per-call --gateway ...`. Each run carries a")
w("  unique marker; the driver checks every stream (own marker, no foreign marker, one terminal event,")
w("  deltas a prefix of the final text).")
w(f"- Medians of {reps} repetitions (latencies: the median of each repetition's percentile). Violations,")
w("  errors and finals are summed over repetitions; RSS is the peak over them. The per-call design at")
w("  concurrency 1000 ran ONCE with a deadline and a gateway memory guard (it makes the gateway send")
w("  about N x N frames).")
w("- Gateway frames/bytes: what the replay gateway wrote to its sockets during the load (its `/stats`")
w("  endpoint, before/after). clawmux CPU: utime+stime from `/proc/PID/stat`; RSS: `VmHWM` after")
w("  resetting it (`clear_refs`) before each load.")
w("")
w("## Results")
w("")
w("| C | design | runs x reps | finals | errors | isolation violations | runs/s | accepted p50 / p95 / p99 (ms) | first delta p50 / p99 (ms) | terminal p50 / p95 / p99 (ms) | gateway frames | frames / run | gateway bytes | handshakes | clawmux CPU s (cores) | clawmux peak RSS |")
w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for c in lv:
    for mode in ("clawmux", "per-call"):
        s = S.get((c, mode))
        if not s: continue
        cpu = f'{fmt(s["cpu"], 2)} ({fmt(s["cores"], 2)})' if mode == "clawmux" else "n/a"
        rss = f'{fmt(s["rss"], 1)} MB' if mode == "clawmux" else "n/a"
        note = " (stopped early)" if s["interrupted"] else ""
        w(f'| {c} | {mode}{note} | {s["runs"]} x {s["n"]} | {s["finals"]} | {s["errors"]} | {s["violations"]} | {fmt(s["rps"])} '
          f'| {fmt(s["acc50"])} / {fmt(s["acc95"])} / {fmt(s["acc99"])} | {fmt(s["fd50"])} / {fmt(s["fd99"])} '
          f'| {fmt(s["t50"])} / {fmt(s["t95"])} / {fmt(s["t99"])} | {fmt(s["frames"], 0)} | {fmt(s["framesPerRun"])} '
          f'| {fmt(s["bytes"], 0)} | {fmt(s["handshakes"], 0)} | {cpu} | {rss} |')
w("")
w("## Ratios (per-call / clawmux)")
w("")
w("At concurrency 1000 the per-call design makes the gateway send every run's events to every one of")
w("~1000 sockets (about N x N frames). The replay gateway buffers what a slow socket has not read (the")
w("real gateway would drop such a client past `maxBufferedBytes`), so its memory passes the guard")
w("(`BENCH_GW_RSS_LIMIT_MB`) before the load ends, and the run is stopped: on this 2-core machine the")
w("per-call design does not complete 1000 concurrent runs at all, while clawmux does (above).")
w("")
w("| C | gateway frames per run | gateway bytes per run | handshakes per run | accepted p50 | accepted p99 | terminal p99 | runs/s (clawmux / per-call) |")
w("|---|---|---|---|---|---|---|---|")
ratios = {}
def ratio(a, b):
    return (a / b) if (a is not None and b not in (None, 0)) else None
for c in lv:
    a, p = S.get((c, "clawmux")), S.get((c, "per-call"))
    if not a or not p: continue
    r = {
        "frames": ratio(p["framesPerRun"], a["framesPerRun"]), "bytes": ratio(p["bytesPerRun"], a["bytesPerRun"]),
        "hs": ratio(p["handshakes"] / max(1, p["runs"]), a["handshakes"] / max(1, a["runs"]) if a["handshakes"] else None),
        "acc50": ratio(p["acc50"], a["acc50"]), "acc99": ratio(p["acc99"], a["acc99"]), "t99": ratio(p["t99"], a["t99"]),
        "rps": ratio(a["rps"], p["rps"]),
    }
    ratios[c] = r
    if p["interrupted"]:
        # The per-call load never finished: its partial counters would give meaningless ratios.
        w(f'| {c} | n/a: the per-call design was stopped by the memory guard (see below) | | | | | | |')
        continue
    hs = "2 per run vs 0 (one connection)" if not a["handshakes"] else fmt(r["hs"])
    w(f'| {c} | {fmt(r["frames"])}x | {fmt(r["bytes"])}x | {hs} | {fmt(r["acc50"], 2)}x | {fmt(r["acc99"], 2)}x | {fmt(r["t99"], 2)}x | {fmt(r["rps"], 2)}x |')
w("")
w("## Targets")
w("")
def verdict(ok): return "MET" if ok else "MISSED"
a1000 = S.get((1000, "clawmux"))
if a1000:
    w(f'- 1,000 concurrent runs on one gateway connection, {deltas} deltas per run: isolation violations '
      f'{a1000["violations"]} (target 0): **{verdict(a1000["violations"] == 0)}**; finals {a1000["finals"]} of '
      f'{a1000["runs"] * a1000["n"]}, errors {a1000["errors"]}.')
    w(f'- clawmux peak RSS at 1,000 concurrent runs: {fmt(a1000["rss"])} MB (target < 200 MB): '
      f'**{verdict(a1000["rss"] < 200)}**' + ("" if a1000["rss"] < 200 else f' by {fmt(a1000["rss"] - 200)} MB') + ".")
r100 = ratios.get(100)
if r100:
    f = r100["frames"] or 0
    w(f'- At 100 concurrent runs the gateway sends {fmt(f)}x fewer frames per run to clawmux than to the per-call '
      f'design (target >= 50x): **{verdict(f >= 50)}**' + ("" if f >= 50 else f' (short by {fmt(50 / max(f, 1e-9), 1)}x)') + ".")
    acc = r100["acc50"] or 0
    w(f'- At 100 concurrent runs POST -> `accepted` (p50) is {fmt(acc, 2)}x shorter through clawmux '
      f'(target >= 10x): **{verdict(acc >= 10)}**' + ("" if acc >= 10 else f' (short by {fmt(10 / max(acc, 1e-9), 1)}x)') + ".")
crit = open(crit_path).read().splitlines() if os.path.exists(crit_path) else []
w("")
w("## Hot path (criterion, one core)")
w("")
w("`cargo bench --bench hot_path`: decode a recorded chat delta frame, route it among 1,000 (and 10,000)")
w("registered runs (`RouteTable`), diff it (`DeltaTracker`), serialize the SSE event as the run store does. One")
w("element = one frame; `thrpt` is frames per second (low / estimate / high).")
w("")
w("```")
w("\n".join(l.rstrip() for l in crit) if crit else "(not run)")
w("```")
w("")
notes = os.path.join(os.path.dirname(os.path.abspath(out)), "bench", "notes.md")
if os.path.exists(notes):
    w(open(notes).read().rstrip())
open(out, "w").write("\n".join(L) + "\n")
print(f"wrote {out}", file=sys.stderr)
PY
cp "$RESULTS" "$REPO/bench/last-results.jsonl"
say "done in ${ELAPSED}s; raw rows in bench/last-results.jsonl, logs in $WORK"
# The run store's cost (memory: vs sqlite://) and the restart figure: bench/store.sh adds its own
# section to the file just written (BENCH_STORE_SECTION=0 skips it).
if [ "${BENCH_STORE_SECTION:-1}" = 1 ]; then
  cleanup; CM_PID=""; GW_PID=""
  BENCH_OUT="$OUT" bench/store.sh
fi
