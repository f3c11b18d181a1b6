#!/usr/bin/env bash
# Install schemathesis (PyPI) into a venv in the cache dir: the OpenAPI fuzzer tests/run.sh points
# at a live clawmux (tests/support/schemathesis.sh).
#
# Usage:
#   eval "$(tests/support/install-schemathesis.sh)"   # sets CLAWMUX_SCHEMATHESIS_BIN
#
# stdout carries ONLY one shell-sourceable line (CLAWMUX_SCHEMATHESIS_BIN=<venv>/bin/schemathesis);
# progress and pip output go to stderr.
#
# Env: CLAWMUX_CACHE (default $HOME/.cache/clawmux), SCHEMATHESIS_VERSION (default 4.32.5),
# PYTHON (default python3; >= 3.10).
#
# Layout: $CACHE/schemathesis-venv with a marker file written only after a successful install and
# version check; a venv without a matching marker is wiped and reinstalled, so an interrupted
# install is redone, and with the marker present this is a fast no-op. Every dependency is pinned
# by tests/support/schemathesis/constraints.txt (what that version resolved to); pip is used as
# the machine configures it. Concurrent callers are serialised with flock.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
VERSION="${SCHEMATHESIS_VERSION:-4.32.5}"
PY="${PYTHON:-python3}"
VENV="$CACHE/schemathesis-venv"
CONSTRAINTS="$HERE/schemathesis/constraints.txt"
MARKER=.clawmux-installed

log() { printf 'install-schemathesis: %s\n' "$*" >&2; }
emit() { printf 'CLAWMUX_SCHEMATHESIS_BIN=%q\n' "$VENV/bin/schemathesis"; }

command -v "$PY" >/dev/null 2>&1 || { log "need $PY (CPython >= 3.10)"; exit 1; }
PY_VERSION="$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
STAMP="schemathesis==$VERSION python=$PY_VERSION constraints=$(sha256sum "$CONSTRAINTS" | cut -c1-16)"
marker_ok() { [ -f "$VENV/$MARKER" ] && [ "$(cat "$VENV/$MARKER")" = "$STAMP" ] && [ -x "$VENV/bin/schemathesis" ]; }

if marker_ok; then emit; exit 0; fi
mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE/.install.lock"
  flock 9
fi
if marker_ok; then emit; exit 0; fi

T0=$SECONDS
log "installing schemathesis==$VERSION (python $PY_VERSION) into $VENV"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
timeout --foreground 900 "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --progress-bar off \
  -c "$CONSTRAINTS" "schemathesis==$VERSION" >&2
got="$("$VENV/bin/schemathesis" --version 2>&1 || true)"
case "$got" in
  *"version $VERSION"*) ;;
  *) log "sanity check failed: schemathesis --version printed: $got"; exit 1 ;;
esac
printf '%s' "$STAMP" >"$VENV/$MARKER"
log "schemathesis $VERSION ready ($((SECONDS - T0)) s)"
emit
