#!/usr/bin/env bash
# Installs Debian packages for commands the operator-surface checks need, when the command is
# missing, through apt as the machine configures it (needs root then):
#
#   tests/support/install-apt-tools.sh chromium chromedriver promtool
#
# chromium -> package chromium, chromedriver -> chromium-driver (headless browser tests),
# promtool -> prometheus (alert rules and /metrics lint; its service is not started by us: in a
# container policy-rc.d refuses, and nothing here runs the server). A no-op when all are there.
set -euo pipefail
log() { printf 'install-apt-tools: %s\n' "$*" >&2; }
pkgs=()
for cmd in "$@"; do
  command -v "$cmd" >/dev/null 2>&1 && continue
  case "$cmd" in
    chromium) pkgs+=(chromium) ;;
    chromedriver) pkgs+=(chromium-driver) ;;
    promtool) pkgs+=(prometheus) ;;
    *) log "unknown tool $cmd"; exit 2 ;;
  esac
done
[ ${#pkgs[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { log "need root to install ${pkgs[*]} (or install them yourself)"; exit 1; }
T0=$SECONDS
log "installing ${pkgs[*]}"
export DEBIAN_FRONTEND=noninteractive
timeout --foreground 900 apt-get update -qq >&2
timeout --foreground 1200 apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
for cmd in "$@"; do
  command -v "$cmd" >/dev/null 2>&1 || { log "$cmd still missing after installing ${pkgs[*]}"; exit 1; }
done
log "installed ${pkgs[*]} ($((SECONDS - T0)) s)"
