#!/usr/bin/env python3
"""Cost curve (issue 12): clawmux CPU per run and RSS per run against concurrency, from the JSON
lines of bench/system.sh (one line per build and level). Prints a Markdown table and writes an SVG
plot (no plotting library needed).

    for lv in "10 100" "100 500" "1000 2000" "10000 10000"; do set -- $lv
      BENCH_BINS="<main> <hot>" SYS_C=$1 SYS_RUNS=$2 bench/system.sh >> curve.jsonl; done
    bench/curve.py curve.jsonl bench/issue12-cost-curve.svg [BASE_RSS_MB]

RSS per run = (peak RSS - BASE_RSS_MB, the idle process, 19 MB by default) / concurrency.
"""
import json
import math
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
out = sys.argv[2]
base = float(sys.argv[3]) if len(sys.argv) > 3 else 19.0
builds = sorted({r["bin"] for r in rows})
name = {b: b.rsplit("/", 1)[-1] for b in builds}


def per_run_kib(r):
    return max(0.0, (r["cmPeakRssMb"] - base) * 1024 / r["concurrency"])


print("| C | build | runs | finals / errors / violations | CPU per run (ms) | peak RSS (MB) | RSS per run (KiB) | accepted p99 (ms) | first delta p99 (ms) | load avg |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r["concurrency"], r["bin"])):
    acc = (r.get("acceptedMs") or {}).get("p99")
    fd = (r.get("firstDeltaMs") or {}).get("p99")
    print(f'| {r["concurrency"]:,} | {name[r["bin"]]} | {r["runs"]:,} | {r["finals"]} / {r["errors"]} / {r["violations"]} '
          f'| {r["cmCpuMsPerRun"]:.2f} | {r["cmPeakRssMb"]:.0f} | {per_run_kib(r):.1f} '
          f'| {acc:,.0f} | {fd:,.0f} | {r["loadavg1AtEnd"]} |')

# Two panels side by side, log-scaled concurrency on x.
W, H, PAD = 420, 300, 50
colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
levels = sorted({r["concurrency"] for r in rows})
lx0, lx1 = math.log10(levels[0]), math.log10(levels[-1])


def panel(ox, title, value, unit):
    ys = [value(r) for r in rows]
    ymax = max(ys) * 1.1 or 1.0
    sx = lambda c: ox + PAD + (math.log10(c) - lx0) / max(lx1 - lx0, 1e-9) * (W - 2 * PAD)
    sy = lambda v: H - PAD - v / ymax * (H - 2 * PAD)
    svg = [f'<text x="{ox + W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{ox + PAD}" y1="{H - PAD}" x2="{ox + W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{ox + PAD}" y1="{PAD}" x2="{ox + PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{ox + W / 2}" y="{H - 12}" text-anchor="middle" font-size="12">concurrent runs</text>',
           f'<text x="{ox + 12}" y="{H / 2}" font-size="12" transform="rotate(-90 {ox + 12} {H / 2})" text-anchor="middle">{unit}</text>']
    for c in levels:
        svg.append(f'<text x="{sx(c)}" y="{H - PAD + 15}" text-anchor="middle" font-size="11">{c:,}</text>')
    for k in range(5):
        v = ymax * k / 4
        svg.append(f'<text x="{ox + PAD - 5}" y="{sy(v) + 4}" text-anchor="end" font-size="10">{v:.1f}</text>')
    for i, b in enumerate(builds):
        pts = sorted((r["concurrency"], value(r)) for r in rows if r["bin"] == b)
        path = " ".join(f"{sx(c):.1f},{sy(v):.1f}" for c, v in pts)
        svg.append(f'<polyline points="{path}" fill="none" stroke="{colors[i % 4]}" stroke-width="2"/>')
        svg += [f'<circle cx="{sx(c):.1f}" cy="{sy(v):.1f}" r="3" fill="{colors[i % 4]}"/>' for c, v in pts]
        svg.append(f'<text x="{ox + W - PAD}" y="{PAD + 15 * i}" text-anchor="end" font-size="11" fill="{colors[i % 4]}">{name[b]}</text>')
    return svg


body = panel(0, "clawmux CPU per run", lambda r: r["cmCpuMsPerRun"], "ms")
body += panel(W, "clawmux RSS per concurrent run", per_run_kib, "KiB")
with open(out, "w") as f:
    f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>{"".join(body)}</svg>\n')
print(f"wrote {out}", file=sys.stderr)
