#!/usr/bin/env bash
# The run store's cost and the restart figure, on this machine. Writes the "Run store" section of
# BENCHMARKS.md (between the markers `<!-- store:begin -->` and `<!-- store:end -->`).
#
#   bench/store.sh
#
# 1. Store cost: concurrency C (1000) with the recorded short run re-cut into 20 deltas, RUNS runs,
#    `clawmux serve` with `CLAWMUX_STORE_URL=memory:` and with `sqlite://` (a fresh file), REPS
#    times each, alternating (a fresh clawmux per measurement). Reported: runs/s (`clawmux load`),
#    clawmux's added latency p50/p99 (`clawmux_frame_to_client_seconds`: frame on the gateway
#    socket -> delta stored and taken by a live SSE client's stream), clawmux CPU, group-commit batch sizes.
#    The same at a tenth of the frame rate (BENCH_LAT_SPEED, BENCH_LAT_RUNS), gateway and driver at
#    nice 19: the p99 added latency with and without the store where clawmux is not starved of CPU.
# 2. Restart: RESTART_RUNS runs in flight on a slow replay gateway (--speed 0.02: a run lasts ~27 s),
#    `kill -9` of clawmux, start again on the same store: time from process start to `/readyz` 200
#    (every stored run is re-admitted before the HTTP server listens), the resume itself (from the
#    log), and the time until every run ended `final` after the restart.
#
# Knobs: BENCH_C (1000), BENCH_RUNS (3000), BENCH_REPS (2), BENCH_RESTART_RUNS (1000), BENCH_LAT_SPEED (0.1),
# BENCH_LAT_RUNS (2000),
# BENCH_OUT (BENCHMARKS.md). Every step is bounded; everything started is stopped by PID.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
REPO="$(pwd)"
C="${BENCH_C:-1000}"; RUNS="${BENCH_RUNS:-3000}"; REPS="${BENCH_REPS:-2}"; RESTART_RUNS="${BENCH_RESTART_RUNS:-1000}"
LAT_SPEED="${BENCH_LAT_SPEED:-0.1}"; LAT_RUNS="${BENCH_LAT_RUNS:-2000}"
OUT="${BENCH_OUT:-BENCHMARKS.md}"
BIN="$REPO/target/release/clawmux"
WORK="$(mktemp -d /tmp/clawmux-bench-store.XXXXXX)"
RESULTS="$WORK/results.jsonl"; : >"$RESULTS"
STARTED_AT="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
say() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'bench/store.sh: %s\n' "$*" >&2; exit 1; }
GW_PID=""; CM_PID=""
cleanup() { stop_pid "$CM_PID"; stop_pid "$GW_PID"; }
trap cleanup EXIT INT TERM
wait_http() { for _ in $(seq 1 $(( $2 * 20 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.05; done; return 1; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
CLK_TCK="$(getconf CLK_TCK)"

say "build (release)"
cargo build --release --locked --bin clawmux 2>&1 | tail -1 >&2
TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"

start_gateway() { # SPEED [NICE]
  stop_pid "$GW_PID"
  GW_PORT="$(free_port)"
  CLAWMUX_REPLAY_TOKEN="$TOKEN" CLAWMUX_LOG=warn ${2:-} "$BIN" replay-gateway --cassette tests/cassettes/openclaw-2026.9.6-short.jsonl \
    --listen "127.0.0.1:$GW_PORT" --speed "$1" --deltas 20 >>"$WORK/gateway.log" 2>&1 &
  GW_PID=$!
  sleep 0.5
}

start_clawmux() { # STORE_URL LOG
  CLAWMUX_GATEWAY_URL="ws://127.0.0.1:$GW_PORT" CLAWMUX_GATEWAY_TOKEN="$TOKEN" CLAWMUX_LISTEN="127.0.0.1:$CM_PORT" \
    CLAWMUX_STORE_URL="$1" CLAWMUX_DEVICE_IDENTITY=off CLAWMUX_LOG=info CLAWMUX_MAX_RUNS=20000 HOME="$WORK" \
    "$BIN" serve >>"$2" 2>&1 &
  CM_PID=$!
}

metric_snapshot() { # -> JSON {name: [[le, count], ...], ...} of the histograms we read
  curl -fsS "http://127.0.0.1:$CM_PORT/metrics" | python3 -c '
import sys, json
out = {}
for line in sys.stdin:
    for name in ("clawmux_frame_to_client_seconds", "clawmux_store_commit_seconds", "clawmux_store_batch_writes"):
        if line.startswith(name + "_bucket"):
            le = line.split("le=\"")[1].split("\"")[0]
            out.setdefault(name, []).append([float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])])
        elif line.startswith(name + "_sum") or line.startswith(name + "_count"):
            out[line.split(" ")[0]] = float(line.rsplit(" ", 1)[1])
print(json.dumps(out))'
}

measure() { # CASE SPEED RUNS NICE: every store REPS times, alternating, a fresh clawmux each time
  local case="$1" speed="$2" runs="$3" nice="$4" rep store url
  for rep in $(seq 1 "$REPS"); do
  for store in memory sqlite; do
    start_gateway "$speed" "$nice"
    CM_PORT="$(free_port)"
    url="memory:"; [ "$store" = sqlite ] && url="sqlite://$WORK/$case-$rep.db"
    start_clawmux "$url" "$WORK/clawmux-$case.log"
    wait_http "http://127.0.0.1:$CM_PORT/readyz" 30 || die "clawmux did not start"
    # Warm-up, not measured; then a fresh counter for the measured load.
    timeout 120 $nice "$BIN" load --target "http://127.0.0.1:$CM_PORT" --runs "$C" --concurrency "$C" --timeout-sec 60 --deadline-sec 60 --json --no-progress >/dev/null 2>&1 || true
    before="$(metric_snapshot)"; cpu0="$(cpu_ticks "$CM_PID")"
    timeout 300 $nice "$BIN" load --target "http://127.0.0.1:$CM_PORT" --runs "$runs" --concurrency "$C" --timeout-sec 60 --deadline-sec 240 \
      --json --no-progress >"$WORK/load-$case-$store-$rep.json" 2>/dev/null || true
    cpu1="$(cpu_ticks "$CM_PID")"; after="$(metric_snapshot)"
    python3 - "$case" "$store" "$rep" "$WORK/load-$case-$store-$rep.json" "$before" "$after" "$cpu0" "$cpu1" "$CLK_TCK" >>"$RESULTS" <<'PY'
import json, sys
case, store, rep, path, before, after, c0, c1, tck = sys.argv[1:]
load = json.load(open(path))
b, a = json.loads(before), json.loads(after)
def quantiles(name):
    # The measured load only: the histogram after minus before (the warm-up is excluded).
    pb = dict((le, c) for le, c in b.get(name, []))
    d = [(le, c - pb.get(le, 0.0)) for le, c in a.get(name, [])]
    total = d[-1][1] if d else 0
    q = lambda p: next((le for le, c in d if c >= p * total), None) if total else None
    return {"p50": q(0.5), "p99": q(0.99), "count": total}
def mean(name):
    n = a.get(name + "_count", 0) - b.get(name + "_count", 0)
    return (a.get(name + "_sum", 0) - b.get(name + "_sum", 0)) / n if n else None
print(json.dumps({"case": case, "store": store, "rep": int(rep), "runsPerSec": load.get("runsPerSec"), "finals": load.get("finals"),
                  "errors": load.get("errors"), "violations": load.get("isolationViolations"),
                  "latency": quantiles("clawmux_frame_to_client_seconds"), "latencyMean": mean("clawmux_frame_to_client_seconds"), "commit": quantiles("clawmux_store_commit_seconds"),
                  "batchMean": mean("clawmux_store_batch_writes"), "cpuSec": (int(c1) - int(c0)) / int(tck)}))
PY
    tail -1 "$RESULTS" >&2
    stop_pid "$CM_PID"; CM_PID=""
  done
  done
}

say "store cost: C=$C, $RUNS runs at recorded speed, $REPS reps per store"
measure cost 1 "$RUNS" ""
# At recorded speed C=1000 saturates both cores (three processes), so p99 is queueing in buckets
# hundreds of ms wide. The same 1000 concurrent runs at a tenth of the frame rate, with the gateway
# and the load driver at nice 19, leave clawmux the CPU it would have on its own machine: there
# p99 is clawmux's own added latency, and the store's share of it can be read.
say "store latency: C=$C, $LAT_RUNS runs at speed $LAT_SPEED, gateway and driver at nice 19"
measure latency "$LAT_SPEED" "$LAT_RUNS" "nice -n 19"

say "restart: $RESTART_RUNS runs in flight, kill -9, start again"
start_gateway 0.02
CM_PORT="$(free_port)"
start_clawmux "sqlite://$WORK/restart.db" "$WORK/clawmux-restart-1.log"
wait_http "http://127.0.0.1:$CM_PORT/readyz" 30 || die "clawmux did not start"
python3 - "$CM_PORT" "$RESTART_RUNS" <<'PY'
import json, sys, urllib.request, concurrent.futures
port, n = sys.argv[1], int(sys.argv[2])
def post(i):
    body = json.dumps({"message": f"restart bench {i}", "billingAccountId": f"acct-{i % 10}", "onDisconnect": "continue"}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/runs?wait=false", body, {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=30))["runId"]
with concurrent.futures.ThreadPoolExecutor(32) as ex:
    ids = list(ex.map(post, range(n)))
print(f"posted {len(ids)} runs", file=sys.stderr)
PY
# Until every run is running on the gateway (accepted), bounded.
for _ in $(seq 1 600); do
  n="$(curl -fsS "http://127.0.0.1:$CM_PORT/v1/runs?status=running&limit=500" | python3 -c 'import json,sys; print(sum(1 for r in json.load(sys.stdin)["runs"] if r["gatewayRunId"]))')"
  [ "$n" -ge "$(( RESTART_RUNS / 2 < 500 ? RESTART_RUNS / 2 : 500 ))" ] && break; sleep 0.1
done
sleep 2
kill -KILL "$CM_PID"; wait "$CM_PID" 2>/dev/null || true; CM_PID=""
t0="$(date +%s.%N)"
start_clawmux "sqlite://$WORK/restart.db" "$WORK/clawmux-restart-2.log"
wait_http "http://127.0.0.1:$CM_PORT/readyz" 120 || die "clawmux did not restart"
t_ready="$(date +%s.%N)"
# Until no run is unfinished (bounded: the runs themselves last ~27 s).
for _ in $(seq 1 1200); do
  left="$(curl -fsS "http://127.0.0.1:$CM_PORT/v1/runs?status=queued,running&limit=500" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["runs"]))')"
  [ "$left" = 0 ] && break; sleep 0.1
done
t_done="$(date +%s.%N)"
finals="$(curl -fsS "http://127.0.0.1:$CM_PORT/v1/runs?status=ok&limit=500" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(len(d["runs"]), bool(d["nextCursor"]))')"
resume_line="$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/clawmux-restart-2.log" | grep -o 'runs=[0-9]* elapsed_ms=[0-9]*' | tail -1 || true)"
python3 - "$t0" "$t_ready" "$t_done" "$RESTART_RUNS" "$resume_line" "$finals" >>"$RESULTS" <<'PY'
import json, sys
t0, tr, td, n, line, finals = sys.argv[1:]
kv = dict(p.split("=") for p in line.split()) if line else {}
print(json.dumps({"case": "restart", "runs": int(n), "readySec": float(tr) - float(t0), "allEndedSec": float(td) - float(t0),
                  "resumed": int(kv.get("runs", 0)), "resumeMs": int(kv.get("elapsed_ms", 0)), "okFirstPage": finals}))
PY
tail -1 "$RESULTS" >&2
stop_pid "$CM_PID"; CM_PID=""; stop_pid "$GW_PID"; GW_PID=""

say "writing the store section of $OUT"
LAT_SPEED="$LAT_SPEED" python3 - "$RESULTS" "$OUT" "$STARTED_AT" "$C" "$RUNS" "$REPS" <<'PY'
import json, statistics, subprocess, sys, re, os
res, out, started, c, runs, reps = sys.argv[1:]
rows = [json.loads(l) for l in open(res) if l.strip()]
sh = lambda cmd: subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
commit = sh("git rev-parse --short HEAD")
cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-").strip()
med = lambda xs: statistics.median([x for x in xs if x is not None]) if [x for x in xs if x is not None] else None
cost = {s: [r for r in rows if r["case"] == "cost" and r["store"] == s] for s in ("memory", "sqlite")}
lat = {s: [r for r in rows if r["case"] == "latency" and r["store"] == s] for s in ("memory", "sqlite")}
def summ(rs):
    return {"rps": med([r["runsPerSec"] for r in rs]), "p50": med([r["latency"]["p50"] for r in rs]),
            "p99": med([r["latency"]["p99"] for r in rs]), "cpu": med([r["cpuSec"] for r in rs]),
            "batch": med([r["batchMean"] for r in rs]), "c50": med([r["commit"]["p50"] for r in rs]), "c99": med([r["commit"]["p99"] for r in rs]),
            "mean": med([r["latencyMean"] for r in rs]), "finals": sum(r["finals"] or 0 for r in rs), "errors": sum(r["errors"] or 0 for r in rs),
            "violations": sum(r["violations"] or 0 for r in rs)}
m, q = summ(cost["memory"]), summ(cost["sqlite"])
ms = lambda x: "n/a" if x is None else f"{round(x * 1000, 3):g} ms"
L = ["<!-- store:begin -->", "## Run store (bench/store.sh)", "",
     f"`bench/store.sh` on {started}, commit `{commit}`, {sh('nproc')} cores ({cpu}); clawmux, the replay gateway",
     "and the load driver share them. Added latency = `clawmux_frame_to_client_seconds`: a chat frame's",
     "arrival on the gateway socket to its delta **stored** and handed to the SSE clients (histogram bucket",
     "upper bounds: the true value is at most that).", "",
     f"| store | runs/s (C={c}, {runs} runs, median of {reps}) | added latency p50 / p99 | commit p50 / p99 | clawmux CPU s | writes per commit (mean) | finals / errors / violations |",
     "|---|---|---|---|---|---|---|"]
for name, s in (("memory:", m), ("sqlite://", q)):
    L.append(f"| `{name}` | {s['rps'] and round(s['rps'], 1)} | {ms(s['p50'])} / {ms(s['p99'])} | {ms(s['c50'])} / {ms(s['c99'])} | {s['cpu'] and round(s['cpu'], 2)} | "
             f"{s['batch'] and round(s['batch'], 1)} | {s['finals']} / {s['errors']} / {s['violations']} |")
if m["rps"] and q["rps"]:
    ratio = q["rps"] / m["rps"]
    L.append("")
    L.append(f"- SQLite runs/s = {ratio:.0%} of `memory:` (target >= 90%): **{'MET' if ratio >= 0.9 else 'MISSED'}**.")
if m["p99"] is not None and q["p99"] is not None:
    d = (q["p99"] - m["p99"]) * 1000
    if max(m["p99"], q["p99"]) > 0.01:
        # The histogram's buckets there are wider than the 2 ms to resolve: say so, claim nothing.
        L.append(f"- p99 added latency: `memory:` <= {ms(m['p99'])}, `sqlite://` <= {ms(q['p99'])}: both are far above the 2 ms the target "
                 "compares, in buckets wider than that: at C=1000 the three processes saturate both cores, and that queueing, not the "
                 "store, sets p99 here. The target **cannot be judged** from this run; the commit latency column is the store's own share.")
    else:
        L.append(f"- p99 added latency grows by {d:g} ms with SQLite (target < 2 ms; bucket bounds): **{'MET' if d < 2 else 'MISSED'}**.")
lm, lq = summ(lat["memory"]), summ(lat["sqlite"])
if lm["p99"] is not None and lq["p99"] is not None:
    L += ["", f"The same {c} concurrent runs at a tenth of the frame rate (`--speed {os.environ.get('LAT_SPEED', '0.1')}`, gateway and load driver",
          "at nice 19, so clawmux has the CPU it would have on a machine of its own):", "",
          "| store | added latency p50 / p99 / mean | commit p50 / p99 | clawmux CPU s | finals / errors / violations |", "|---|---|---|---|---|"]
    for name, s in (("memory:", lm), ("sqlite://", lq)):
        L.append(f"| `{name}` | {ms(s['p50'])} / {ms(s['p99'])} / {ms(s['mean'])} | {ms(s['c50'])} / {ms(s['c99'])} | {s['cpu'] and round(s['cpu'], 2)} | "
                 f"{s['finals']} / {s['errors']} / {s['violations']} |")
    d = (lq["p99"] - lm["p99"]) * 1000
    verdict = "MET" if d < 2 else "MISSED"
    L += ["", f"- p99 added latency grows by {d:g} ms with SQLite here (bucket upper bounds; target < 2 ms): **{verdict}**."]
r = next((r for r in rows if r["case"] == "restart"), None)
if r:
    L += ["", f"Restart: {r['runs']} runs in flight on a slow replay gateway (`--speed 0.02`), `kill -9`, start on the same",
          f"SQLite store: `/readyz` answered {r['readySec']:.2f} s after the process started; the resume itself (loading",
          f"{r['resumed']} unfinished runs with their events and re-admitting them) took {r['resumeMs']} ms; every run had ended",
          f"{r['allEndedSec']:.1f} s after the restart (the runs themselves last ~27 s of recorded time at this speed)."]
L.append("<!-- store:end -->")
text = open(out).read() if os.path.exists(out) else ""
block = "\n".join(L)
if "<!-- store:begin -->" in text:
    text = re.sub(r"<!-- store:begin -->.*?<!-- store:end -->", lambda _: block, text, flags=re.S)
else:
    text = text.rstrip() + "\n\n" + block + "\n"
open(out, "w").write(text)
print(block, file=sys.stderr)
PY
say "done; raw rows in $RESULTS"
