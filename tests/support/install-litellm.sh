#!/usr/bin/env bash
# Install a real LiteLLM proxy (PyPI: litellm[proxy]) into a venv in the cache dir, for tests.
#
# Usage:
#   tests/support/install-litellm.sh
#   eval "$(tests/support/install-litellm.sh)"   # sets CLAWMUX_LITELLM_BIN / CLAWMUX_LITELLM_PYTHON
#
# stdout carries ONLY two shell-sourceable lines:
#   CLAWMUX_LITELLM_BIN=<venv>/bin/litellm
#   CLAWMUX_LITELLM_PYTHON=<venv>/bin/python
# Progress and pip output go to stderr.
#
# Env:
#   CLAWMUX_CACHE     cache dir (default $HOME/.cache/clawmux)
#   LITELLM_VERSION   litellm version (default 1.106.2)
#   PYTHON            the interpreter for the venv (default python3; needs >= 3.9, < 3.14)
#
# Layout: $CACHE/litellm-venv. Its marker file .clawmux-installed is written only after a
# successful install and sanity check (the proxy's modules import, with the model cost map
# read locally, and the installed version is the wanted one); a venv without a matching marker
# is wiped and reinstalled, so an interrupted install is redone. With the marker present the
# script is a fast no-op. Concurrent callers are serialised with flock on $CACHE/.install.lock.
#
# Versions: litellm[proxy]==$LITELLM_VERSION with every dependency pinned by
# tests/support/litellm/constraints.txt (what that version resolved to), through pip as the
# machine configures it. No database driver or Prisma is installed: Prisma's `generate` fetches
# its query engine from a host outside the package registries, which is unreachable offline (see
# tests/support/litellm.sh for how the tests read LiteLLM's spend records without it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
LITELLM_VERSION="${LITELLM_VERSION:-1.106.2}"
PY="${PYTHON:-python3}"
VENV="$CACHE/litellm-venv"
CONSTRAINTS="$HERE/litellm/constraints.txt"
MARKER=.clawmux-installed

log() { printf 'install-litellm: %s\n' "$*" >&2; }

emit() {
  printf 'CLAWMUX_LITELLM_BIN=%q\n' "$VENV/bin/litellm"
  printf 'CLAWMUX_LITELLM_PYTHON=%q\n' "$VENV/bin/python"
}

command -v "$PY" >/dev/null 2>&1 || { log "need $PY (CPython >= 3.9, < 3.14)"; exit 1; }
[ -f "$CONSTRAINTS" ] || { log "missing $CONSTRAINTS"; exit 1; }
PY_VERSION="$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
CONSTRAINTS_SUM="$(sha256sum "$CONSTRAINTS" | cut -c1-16)"
STAMP="litellm[proxy]==$LITELLM_VERSION python=$PY_VERSION constraints=$CONSTRAINTS_SUM"

marker_ok() {
  [ -f "$VENV/$MARKER" ] && [ "$(cat "$VENV/$MARKER")" = "$STAMP" ] && [ -x "$VENV/bin/litellm" ] && [ -x "$VENV/bin/python" ]
}

# Fast path: nothing to do, no lock, no pip.
if marker_ok; then
  emit
  exit 0
fi

mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE/.install.lock"
  flock 9
fi
if marker_ok; then # another caller finished it while we waited
  emit
  exit 0
fi

T0=$SECONDS
log "installing litellm[proxy]==$LITELLM_VERSION (python $PY_VERSION) into $VENV"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
timeout --foreground 1200 "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --progress-bar off \
  -c "$CONSTRAINTS" "litellm[proxy]==$LITELLM_VERSION" >&2

# Sanity: the proxy's modules import offline (the cost map is read from the package, not
# fetched) and the installed version is the wanted one.
SANITY='
import importlib.metadata as md
import litellm.proxy.proxy_server  # fastapi, uvicorn, the proxy extras
from litellm.integrations.custom_logger import CustomLogger  # the spend-log callback base
from litellm.proxy.spend_tracking.spend_tracking_utils import get_logging_payload
print("litellm " + md.version("litellm"))
'
got="$(cd "$VENV" && LITELLM_LOCAL_MODEL_COST_MAP=True timeout --foreground 300 "$VENV/bin/python" -c "$SANITY" 2>&1 || true)"
case "$got" in
  *"litellm $LITELLM_VERSION"*) ;;
  *) log "sanity check failed: importing the LiteLLM proxy printed: $got"; exit 1 ;;
esac
[ -x "$VENV/bin/litellm" ] || { log "sanity check failed: $VENV/bin/litellm missing"; exit 1; }
printf '%s' "$STAMP" >"$VENV/$MARKER"
log "litellm $LITELLM_VERSION ready ($((SECONDS - T0)) s)"
emit
