#!/usr/bin/env bash
# Where clawmux's CPU goes, by thread, during bench/system.sh's measured load: each thread's CPU
# (utime+stime from /proc/<pid>/task/<tid>/stat) and its voluntary and involuntary context
# switches, per run. Runs bench/system.sh once with the same settings (SYS_C, SYS_RUNS, SYS_DELTAS,
# SYS_STORE_URL, SYS_GW_BIN ...) and reads clawmux's threads just before and just after the load.
#
#   BENCH_BIN=target/release/clawmux bench/threads.sh
#
# Prints one line per thread (its name and tid, in the order the threads were started: the main
# thread runs the registry; for `serve` the writer's main lane, the gateway connection, the
# continuation arbiters, then the HTTP workers, which are the shards) and bench/system.sh's JSON
# line last. Every process is started and stopped by bench/system.sh itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN="${BENCH_BIN:-$(pwd)/target/release/clawmux}"
RUNS="${SYS_RUNS:-2000}"
C="${SYS_C:-1000}"
OUT="$(mktemp -d /tmp/clawmux-threads.XXXXXX)"
BENCH_BIN="$BIN" bench/system.sh >"$OUT/system.json" 2>"$OUT/system.err" &
SYS=$!
# The load of the measurement (not the warm-up's 20 runs) is the one with these arguments.
LOAD="load --target .* --runs $RUNS --concurrency $C "
serve_pid() { pgrep -n -f "^$BIN serve" || true; }
snap() { # PID -> "tid name cpu_ticks voluntary involuntary" per thread
  local t
  for t in /proc/"$1"/task/*; do
    printf '%s %s %s %s\n' "${t##*/}" "$(tr ' |' '__' <"$t/comm")" "$(awk '{print $14 + $15}' "$t/stat")" \
      "$(awk '/^voluntary_ctxt/ {v = $2} /^nonvoluntary_ctxt/ {n = $2} END {print v, n}' "$t/status")"
  done 2>/dev/null
}
pid=""
for _ in $(seq 1 600); do
  pid="$(serve_pid)"
  [ -n "$pid" ] && pgrep -f "$LOAD" >/dev/null && break
  kill -0 "$SYS" 2>/dev/null || break
  sleep 0.05
done
[ -n "$pid" ] || { echo "bench/threads.sh: clawmux serve did not start (see $OUT)" >&2; wait "$SYS" || true; exit 1; }
snap "$pid" >"$OUT/before"
# The last reading taken while the load still ran (bench/system.sh stops clawmux right after it).
while pgrep -f "$LOAD" >/dev/null; do
  snap "$pid" >"$OUT/now" && mv "$OUT/now" "$OUT/after"
  sleep 0.1
done
wait "$SYS" || true
sort -k1,1 "$OUT/before" >"$OUT/b"; sort -k1,1 "$OUT/after" >"$OUT/a"
join "$OUT/b" "$OUT/a" | sort -n | awk -v n="$RUNS" -v hz="$(getconf CLK_TCK)" '
  { printf "%-8s %-24s cpu %.3f ms/run   voluntary %.2f/run   involuntary %.2f/run\n", $1, $2, ($7 - $3) * 1000 / hz / n, ($8 - $4) / n, ($9 - $5) / n }'
cat "$OUT/system.json"
rm -rf "$OUT"
