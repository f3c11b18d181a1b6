#!/usr/bin/env bash
# A Docker engine for the tests: Debian's docker.io, started by hand with all traffic on loopback.
#
#   tests/support/docker.sh ensure            an engine answers (use it, or install + start one)
#   tests/support/docker.sh stop              stop the dockerd THIS script started (by its PID)
#   tests/support/docker.sh status            exit 0 when an engine answers; prints its version
#   tests/support/docker.sh apt-install PKG…  apt-get install -y PKG… when missing (apt-get update
#                                             at most once per call; used by docker-image.sh too)
#
# `ensure` is idempotent:
#   1. an engine already answers `docker info` (DOCKER_HOST or the default socket): nothing to do;
#   2. otherwise `dockerd` is installed from Debian's `docker.io` when missing, and started as
#        dockerd --bridge=none --iptables=false --ip-masq=false --data-root DATA
#                --pidfile CACHE/docker/dockerd.pid -H unix:///var/run/docker.sock
#      with its log in CACHE/docker/dockerd.log, then `docker info` is polled until it answers
#      (bounded by DOCKER_READY_TIMEOUT, default 60 s). With --bridge=none there is no docker0 and no
#      container gets a private-range address: test containers use --network host or none.
# `stop` only stops a dockerd whose PID is in CACHE/docker/dockerd.pid and whose command line is
# dockerd (SIGTERM, up to 30 s, then SIGKILL); an engine it did not start is left alone.
#
# Env: CLAWMUX_CACHE (default $HOME/.cache/clawmux), CLAWMUX_DOCKER_DATA_ROOT (default
#      CACHE/docker/data, so the images built by docker-image.sh stay cached), DOCKER_READY_TIMEOUT.
# Progress goes to stderr; nothing is printed on stdout (but by `status`).
set -euo pipefail

CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
STATE="$CACHE/docker"
DATA_ROOT="${CLAWMUX_DOCKER_DATA_ROOT:-$STATE/data}"
PIDFILE="$STATE/dockerd.pid"
LOG="$STATE/dockerd.log"
SOCK=/var/run/docker.sock
READY_TIMEOUT="${DOCKER_READY_TIMEOUT:-60}"

say() { printf 'docker.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

usage() {
  sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

engine_ok() { timeout 10 docker info >/dev/null 2>&1; }

alive() { # PID: running and not a zombie
  local st
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
  st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

our_dockerd() { # PID: alive and its command line is dockerd
  alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q '^[^ ]*dockerd '
}

read_pid() { if [ -f "$1" ]; then tr -dc '0-9' <"$1"; fi; }

# apt_install PKG...: install the packages that are not installed yet; `apt-get update` once.
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "need root to apt-get install ${missing[*]}"
  say "apt-get update (once), then apt-get install -y ${missing[*]}"
  local t0; t0="$(now)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  # No init system here: keep the packages' maintainer scripts from starting services
  # (policy-rc.d exit 101 = "action forbidden"); restore whatever policy was there before.
  local policy=/usr/sbin/policy-rc.d saved=""
  if [ -e "$policy" ]; then saved="$(mktemp)"; cp -p "$policy" "$saved"; fi
  printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"
  local rc=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || rc=$?
  if [ -n "$saved" ]; then mv -f "$saved" "$policy"; else rm -f "$policy"; fi
  [ "$rc" = 0 ] || die "apt-get install ${missing[*]} failed ($rc)"
  say "installed ${missing[*]} in $(elapsed "$t0") s"
}

cmd_ensure() {
  if engine_ok; then
    say "an engine answers: $(docker version -f '{{.Server.Version}}' 2>/dev/null || echo '?')"
    return 0
  fi
  mkdir -p "$STATE"
  # serialise concurrent callers (several test runs on one machine)
  exec 8>"$STATE/.lock"
  flock 8
  if engine_ok; then return 0; fi
  local t0 pid; t0="$(now)"
  if ! command -v dockerd >/dev/null 2>&1; then
    # Debian's docker.io brings dockerd, containerd and runc (tini: docker-init for --init).
    apt_install docker.io tini
  fi
  command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after installing docker.io"
  pid="$(read_pid "$PIDFILE")"
  if our_dockerd "$pid"; then
    say "dockerd ($pid) runs but does not answer yet; waiting"
  else
    rm -f "$PIDFILE"
    if [ -S "$SOCK" ]; then
      # a stale socket from a dockerd that died: dockerd refuses to start otherwise
      say "removing the stale socket $SOCK"
      rm -f "$SOCK"
    fi
    mkdir -p "$DATA_ROOT"
    printf '\n===== dockerd start %s =====\n' "$(date -u +%FT%TZ)" >>"$LOG"
    # setsid: the engine outlives this script (and the shell that ran it)
    setsid dockerd --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
      --data-root "$DATA_ROOT" --pidfile "$PIDFILE" -H "unix://$SOCK" \
      </dev/null >>"$LOG" 2>&1 &
    pid=$!
    # dockerd writes the pid file itself once started; write ours at once so `stop` can find it
    echo "$pid" >"$PIDFILE.launch"
  fi
  local deadline=$((SECONDS + READY_TIMEOUT))
  while ! engine_ok; do
    if ! alive "$pid"; then
      tail -n 40 "$LOG" >&2 || true
      die "dockerd exited before it answered (log: $LOG)"
    fi
    [ $SECONDS -lt $deadline ] || { tail -n 40 "$LOG" >&2 || true; die "dockerd not answering after ${READY_TIMEOUT} s (log: $LOG)"; }
    sleep 0.2
  done
  # dockerd's own pid file is authoritative once it exists
  [ -s "$PIDFILE" ] || echo "$pid" >"$PIDFILE"
  rm -f "$PIDFILE.launch"
  say "dockerd $(docker version -f '{{.Server.Version}}' 2>/dev/null) (pid $(read_pid "$PIDFILE")) ready in $(elapsed "$t0") s; data root $DATA_ROOT; log $LOG"
}

cmd_stop() {
  local pid
  pid="$(read_pid "$PIDFILE")"
  [ -n "$pid" ] || pid="$(read_pid "$PIDFILE.launch")"
  if ! our_dockerd "$pid"; then
    say "no dockerd started by this script is running"
    rm -f "$PIDFILE.launch"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 300); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    say "dockerd ($pid) ignored SIGTERM for 30 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$PIDFILE" "$PIDFILE.launch"
  say "stopped dockerd ($pid)"
}

cmd_status() {
  engine_ok || { say "no engine answers"; return 1; }
  docker version -f 'server {{.Server.Version}} (API {{.Server.APIVersion}})'
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
case "$cmd" in
  ensure) cmd_ensure ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  apt-install) [ $# -ge 1 ] || usage; apt_install "$@" ;;
  *) usage ;;
esac
