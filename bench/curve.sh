#!/usr/bin/env bash
# The cost curve of issue 12: clawmux's CPU per run and RSS per run at concurrency 10, 100, 1000 and
# 10,000 on one gateway connection (bench/latency.sh at each level: the replay gateway with the
# short recorded run and 20 deltas, the in-memory store, every run started at once), written as a
# table (bench/cost-curve.md) and a plot (bench/cost-curve.svg).
#
#   bench/curve.sh            # CURVE_LEVELS="10 100 1000 10000" by default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LEVELS="${CURVE_LEVELS:-10 100 1000 10000}"
OUT_MD=bench/cost-curve.md; OUT_SVG=bench/cost-curve.svg
ROWS="$(mktemp)"; trap 'rm -f "$ROWS"' EXIT
for c in $LEVELS; do
  runs=$(( c * 3 )); [ "$runs" -lt 200 ] && runs=200; [ "$c" -ge 10000 ] && runs=$c
  echo "== C=$c, $runs runs ($(uptime | sed 's/.*load average/load average/'))" >&2
  out="$(CLAWMUX_MAX_RUNS=$(( c * 2 + 100 )) bench/latency.sh "$c" "$runs" 2>&1 | tail -9)"
  echo "$out" >&2
  C="$c" RUNS="$runs" OUT="$out" python3 -c '
import os, re, json
o = os.environ["OUT"]
g = lambda p: re.search(p, o).group(1)
print(json.dumps({"c": int(os.environ["C"]), "runs": int(os.environ["RUNS"]), "final": int(g(r"runs final: (\d+)")),
  "violations": int(g(r"isolation violations: (\d+)")), "p99_ms": g(r"p99: <= ([\d.]+) ms"),
  "runs_per_s": float(g(r"runs/s=([\d.]+)")), "accepted_p99_ms": float(g(r"accepted p99=([\d.]+)")),
  "first_delta_p99_ms": float(g(r"first-delta p99=([\d.]+)")), "cpu_s": float(g(r"clawmux CPU=([\d.]+) s")),
  "cpu_ms_per_run": float(g(r"\(([\d.]+) ms/run\)")), "rss_mib": float(g(r"peak RSS=([\d.]+) MiB")),
  "kib_per_run": float(g(r"peak RSS=([\d.]+) MiB")) * 1024 / int(os.environ["C"]), "gw_cpu_s": float(g(r"replay gateway ([\d.]+) s")),
  "load_cpu_s": float(g(r"load driver ([\d.]+) s"))}))' >> "$ROWS"
done
COMMIT="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src actors protocol || echo '+changes')"
MACHINE="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
ROWS="$ROWS" COMMIT="$COMMIT" MACHINE="$MACHINE" OUT_MD="$OUT_MD" OUT_SVG="$OUT_SVG" SHARDS="${CLAWMUX_SHARDS:-cores}" python3 - <<'PY'
import json, math, os, datetime
rows = [json.loads(l) for l in open(os.environ["ROWS"])]
md = [f"Cost curve ({datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, commit {os.environ['COMMIT']}, {os.environ['MACHINE']}, "
      f"CLAWMUX_SHARDS={os.environ['SHARDS']}; `bench/curve.sh`). Per run = over the whole load, "
      "idle time of the process included; RSS per concurrent run = peak RSS / C.", "",
      "| C | runs | final | violations | frame→client p99 | accepted p99 | first delta p99 | runs/s | clawmux CPU | CPU per run | peak RSS | RSS per concurrent run | replay gateway CPU | load driver CPU |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    md.append(f"| {r['c']:,} | {r['runs']:,} | {r['final']:,} | {r['violations']} | <= {r['p99_ms']} ms | {r['accepted_p99_ms']:.0f} ms | "
              f"{r['first_delta_p99_ms']:.0f} ms | {r['runs_per_s']:.0f} | {r['cpu_s']:.2f} s | {r['cpu_ms_per_run']:.2f} ms | "
              f"{r['rss_mib']:.0f} MiB | {r['kib_per_run']:.0f} KiB | {r['gw_cpu_s']:.2f} s | {r['load_cpu_s']:.2f} s |")
open(os.environ["OUT_MD"], "w").write("\n".join(md) + "\n")
# Two panels, log-scale concurrency: CPU ms per run and KiB per run.
W, H, PAD = 360, 240, 48
def panel(x0, key, title, unit):
    xs = [math.log10(r["c"]) for r in rows]; ys = [r[key] for r in rows]
    xmin, xmax = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    ymax = max(ys) * 1.15 or 1
    px = lambda x: x0 + PAD + (x - xmin) / (xmax - xmin) * (W - 2 * PAD)
    py = lambda y: H - PAD - y / ymax * (H - 2 * PAD)
    pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
    s = [f'<text x="{x0 + W/2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
         f'<line x1="{x0+PAD}" y1="{H-PAD}" x2="{x0+W-PAD}" y2="{H-PAD}" stroke="black"/>',
         f'<line x1="{x0+PAD}" y1="{PAD}" x2="{x0+PAD}" y2="{H-PAD}" stroke="black"/>',
         f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>']
    for r, x, y in zip(rows, xs, ys):
        s.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="#1f77b4"/>')
        s.append(f'<text x="{px(x):.1f}" y="{py(y)-6:.1f}" text-anchor="middle" font-size="10">{y:.2f}</text>')
        s.append(f'<text x="{px(x):.1f}" y="{H-PAD+14}" text-anchor="middle" font-size="10">C={r["c"]:,}</text>')
    s.append(f'<text x="{x0+12}" y="{H/2}" font-size="10" transform="rotate(-90 {x0+12} {H/2})" text-anchor="middle">{unit}</text>')
    return s
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2*W}" height="{H}" font-family="sans-serif">',
       f'<rect width="{2*W}" height="{H}" fill="white"/>']
svg += panel(0, "cpu_ms_per_run", "clawmux CPU per run", "ms")
svg += panel(W, "kib_per_run", "clawmux peak RSS per concurrent run", "KiB")
svg.append("</svg>")
open(os.environ["OUT_SVG"], "w").write("\n".join(svg) + "\n")
print("\n".join(md))
PY
