#!/usr/bin/env python3
"""Every metric and label the Grafana dashboard and the alert rules query must exist in a live
/metrics scrape of clawmux: a renamed metric or label would otherwise leave an empty panel or an
alert that can never fire, and nothing else would notice.

    tests/support/check-dashboard.py SCRAPE DASHBOARD_JSON ALERTS_YML

SCRAPE is the Prometheus text exposition of a live clawmux (tests/run.sh scrapes one started by
tests/support/stack.sh). The queries are the dashboard's `targets[].expr` and the alert file's
one-line `expr:` values. In each, every identifier that is not a PromQL function, keyword, label
name or Grafana variable is a metric name and must be in the scrape (histograms by their
`_bucket`/`_sum`/`_count` series); every label named in a selector or in `by (...)` must be a label
of one of the query's metrics, or one Prometheus adds at scrape time (`instance`, `job`).
Exit status 1 with one line per problem.
"""

import json
import re
import sys

FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp", "clamp_max",
    "clamp_min", "count", "count_over_time", "count_values", "delta", "deriv", "exp", "floor", "group", "histogram_quantile",
    "holt_winters", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln", "log2", "log10",
    "max", "max_over_time", "min", "min_over_time", "predict_linear", "quantile", "quantile_over_time", "rate", "resets",
    "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev", "stddev_over_time", "stdvar", "sum", "sum_over_time",
    "time", "timestamp", "topk", "vector",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "inf", "nan"}
SCRAPE_TIME_LABELS = {"instance", "job"}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def scrape_series(text):
    """{series name: set of label names} from the exposition text."""
    series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s", line)
        if not m:
            continue
        labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(3) or ""))
        series.setdefault(m.group(1), set()).update(labels)
    return series


def queries(dashboard, alerts_text):
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"dashboard panel {p.get('title')!r}", t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for v in dashboard.get("templating", {}).get("list", []):
        m = re.match(r"label_values\(([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\)", v.get("definition", ""))
        if m:
            out.append((f"dashboard variable {v['name']!r}", f"{m.group(1)}{{{m.group(2)}!=\"\"}}"))
    for line in alerts_text.splitlines():
        m = re.match(r"\s*expr:\s*(.+)$", line)
        if m:
            out.append(("alert rule", m.group(1).strip()))
    return out


def check(where, expr, series):
    problems = []
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings say nothing here
    text = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "", text)  # Grafana variables
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    selector_labels = []  # (metric or None, label)
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}", text):
        for label in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2)):
            selector_labels.append((m.group(1), label))
    text = re.sub(r"\{[^}]*\}", " ", text)
    grouping = []
    for m in re.finditer(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        grouping += [g.strip() for g in m.group(2).split(",") if g.strip()]
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    metrics = []
    for m in IDENT.finditer(text):
        name = m.group(0)
        after = text[m.end():].lstrip()
        if name in KEYWORDS or (name in FUNCTIONS and after.startswith("(")):
            continue
        if re.fullmatch(r"[0-9].*", name):
            continue
        metrics.append(name)
    if not metrics:
        problems.append(f"{where}: no metric found in {expr!r}")
    for name in metrics:
        if name not in series:
            problems.append(f"{where}: metric {name} is not in the scrape ({expr})")
    known = set(SCRAPE_TIME_LABELS)
    for name in metrics:
        known |= series.get(name, set())
    for metric, label in selector_labels:
        have = series.get(metric, set()) | SCRAPE_TIME_LABELS if metric else known
        if label != "__name__" and label not in have:
            problems.append(f"{where}: label {label} is not a label of {metric or 'its metrics'} in the scrape ({expr})")
    for label in grouping:
        if label not in known:
            problems.append(f"{where}: grouping label {label} is not a label of its metrics in the scrape ({expr})")
    return problems


def main(argv):
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        series = scrape_series(f.read())
    with open(argv[2], encoding="utf-8") as f:
        dashboard = json.load(f)
    with open(argv[3], encoding="utf-8") as f:
        alerts = f.read()
    qs = queries(dashboard, alerts)
    problems = [p for where, expr in qs for p in check(where, expr, series)]
    for p in problems:
        print(p)
    if not problems:
        print(f"check-dashboard: {len(qs)} queries, every metric and label in the scrape ({len(series)} series names)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
