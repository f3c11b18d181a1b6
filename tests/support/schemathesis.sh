#!/usr/bin/env bash
# schemathesis (PyPI) against a live clawmux: the API must answer what its own OpenAPI document
# (/openapi.json) says, for generated valid and invalid requests alike.
#
#   tests/support/schemathesis.sh STACK_DIR [REPORT_DIR]
#
# STACK_DIR is a running tests/support/stack.sh (its env file gives the URL and the admin token).
# Checks: all of schemathesis's checks (no 5xx; status codes, content types, headers and bodies as
# documented, the error shape included; invalid requests refused; the bearer token really
# required; stateful links) except `positive_data_acceptance`: some refusals depend on state or
# rules a JSON Schema cannot state (an agent id that is not in the registry, a run id already
# taken, `maxTokens` without `periodSec`, webhooks outside the allow-list), and those answers
# are documented 4xx with the error shape, which the other checks hold them to.
# Bounded: at most SCHEMATHESIS_MAX_EXAMPLES (default 100) cases per operation and phase, the whole
# run under `timeout` (SCHEMATHESIS_TIMEOUT, default 300 s). SCHEMATHESIS_SEED fixes the seed (the
# seed of every run is printed, so a failure can be replayed).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
[ $# -ge 1 ] || { echo "usage: $0 STACK_DIR [REPORT_DIR]" >&2; exit 2; }
STACK="$1"
REPORT="${2:-$STACK/schemathesis-report}"
[ -f "$STACK/env" ] || { echo "schemathesis: $STACK/env missing (tests/support/stack.sh start $STACK)" >&2; exit 2; }
eval "$("$HERE/install-schemathesis.sh")"
set -a
# shellcheck disable=SC1091
. "$STACK/env"
set +a
seed=()
[ -n "${SCHEMATHESIS_SEED:-}" ] && seed=(--seed "$SCHEMATHESIS_SEED")
mkdir -p "$REPORT"
# Its own working directory: schemathesis writes state (.hypothesis) where it runs.
cd "$REPORT"
timeout --foreground "${SCHEMATHESIS_TIMEOUT:-300}" "$CLAWMUX_SCHEMATHESIS_BIN" --config-file "$HERE/schemathesis/schemathesis.toml" \
  run "$CLAWMUX_URL/openapi.json" \
  --checks all --exclude-checks positive_data_acceptance \
  --max-examples "${SCHEMATHESIS_MAX_EXAMPLES:-100}" --request-timeout 30 --workers 1 \
  --report junit --report-dir "$REPORT" --output-truncate true "${seed[@]}"
