#!/usr/bin/env bash
# The metrics, the alert rules and the Grafana dashboard against a live clawmux:
#
#   tests/support/metrics-checks.sh STACK_DIR
#
# STACK_DIR is a running tests/support/stack.sh. A run is posted and an LLM call no run owns is
# made (so run and refusal counters move), then /metrics is scraped and:
#   promtool check metrics          lints the scrape (names, types, units, help)
#   promtool check rules            images/grafana/alerts.yml is valid
#   promtool test rules             each alert fires when it should and not otherwise
#   check-dashboard.py              every metric and label the dashboard and the alerts query is
#                                   in the scrape
# The scrape is kept in STACK_DIR/metrics.txt.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
ROOT="$(cd "$HERE/../.." && pwd -P)"
[ $# -eq 1 ] || { echo "usage: $0 STACK_DIR" >&2; exit 2; }
STACK="$1"
# shellcheck disable=SC1091
. "$STACK/env"
auth=(-H @"$STACK/auth-header")
umask 077
printf 'Authorization: Bearer %s\n' "$CLAWMUX_API_TOKEN" >"$STACK/auth-header"

status="$(curl -sS -o "$STACK/run.json" -w '%{http_code}' --max-time 30 "${auth[@]}" -H 'Content-Type: application/json' \
  -d '{"message":"metrics check","billingAccountId":"acct-metrics"}' "$CLAWMUX_URL/v1/runs")"
[ "$status" = 200 ] || { echo "metrics-checks: POST /v1/runs answered $status: $(cat "$STACK/run.json")" >&2; exit 1; }
status="$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 -H 'Content-Type: application/json' -d '{"model":"m","messages":[]}' "$PROXY_URL/v1/chat/completions")"
[ "$status" = 409 ] || { echo "metrics-checks: an unattributable LLM call answered $status, not 409" >&2; exit 1; }

curl -fsS --max-time 10 "$CLAWMUX_URL/metrics" >"$STACK/metrics.txt"
grep -q '^sandbox_runs_total{agent="main",status="ok"} 1$' "$STACK/metrics.txt" \
  || { echo "metrics-checks: the run is not counted in sandbox_runs_total" >&2; exit 1; }
echo "== promtool check metrics (a live scrape, $(grep -vc '^#' "$STACK/metrics.txt") samples)"
promtool check metrics <"$STACK/metrics.txt"
echo "== promtool check rules / test rules"
promtool check rules "$ROOT/images/grafana/alerts.yml"
(cd "$ROOT/images/grafana" && promtool test rules alerts.test.yml)
echo "== the dashboard's and the alerts' queries against the scrape"
python3 "$HERE/check-dashboard.py" "$STACK/metrics.txt" "$ROOT/images/grafana/clawmux-dashboard.json" "$ROOT/images/grafana/alerts.yml"
