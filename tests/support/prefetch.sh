#!/usr/bin/env bash
# Installs what tests/run.sh's later phases need while its build compiles, so that a cold
# machine's downloads (apt, npm, PyPI, debootstrap) overlap the build instead of following it.
# Measured cold on 2 cores (2026-12-02): the steps took 746 s beside the build, and the build
# 918 s where it took 524 s alone (npm's and dpkg's unpacking want the CPU too), so it saves
# ~2 minutes, not the whole download time. A no-op (~1 s) when the caches are warm.
#
#   tests/support/prefetch.sh     # run.sh starts it in the background before its build and
#                                 # waits for it before the first test
#
# Every step is one of the installers the phases call anyway (each idempotent and a fast no-op
# once done), so this script changes no result: a step that fails here is only reported; the
# phase that needs it runs the same installer again and fails there, with its own message.
# The apt steps run one after another (dpkg takes one installer at a time); the npm and PyPI
# installs run beside them (install-openclaw.sh and install-litellm.sh take turns on their
# cache's lock). The package names repeat what postgres.sh, docker.sh, docker-image.sh and
# compose-stack.sh install; one that goes stale here only costs its phase the install. Nothing
# here starts a service: docker.io is installed with its service held
# back (docker.sh apt-install), and the base image's root tarball is built without an engine
# (docker-image.sh --tarball); the git relay phase starts dockerd and imports it.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
say() { printf 'prefetch: %s\n' "$*" >&2; }

# step NAME CMD...: run one installer, its output to stderr, its outcome in one line.
step() {
  local name="$1" t0=$SECONDS rc=0
  shift
  "$@" >/dev/null || rc=$?
  if [ "$rc" = 0 ]; then say "$name ready ($((SECONDS - t0)) s)"; else say "$name FAILED ($rc): its phase installs it again"; fi
  return "$rc"
}

apt_chain() {
  local rc=0
  step "chromium, chromium-driver, prometheus" "$HERE/install-apt-tools.sh" chromium chromedriver promtool || rc=1
  step "postgresql, docker.io, tini, debootstrap, docker-compose" \
    "$HERE/docker.sh" apt-install postgresql docker.io tini debootstrap docker-compose || rc=1
  step "the base image's root tarball" "$HERE/docker-image.sh" --tarball || rc=1
  return "$rc"
}

registry_chain() {
  local rc=0
  step "openclaw (protocol 3)" "$HERE/install-openclaw.sh" v3 || rc=1
  step "LiteLLM" "$HERE/install-litellm.sh" || rc=1
  step "schemathesis" "$HERE/install-schemathesis.sh" || rc=1
  return "$rc"
}

t0=$SECONDS
apt_chain &
apt_pid=$!
registry_chain &
registry_pid=$!
rc=0
wait "$apt_pid" || rc=1
wait "$registry_pid" || rc=1
say "done in $((SECONDS - t0)) s"
exit "$rc"
