#!/usr/bin/env bash
# A real PostgreSQL (Debian's `postgresql` package) for the tests, in a directory of its own.
#
#   tests/support/postgres.sh start DIR   initdb DIR/data on first use (as an unprivileged user),
#                                         start the server on 127.0.0.1 on a free port (the same
#                                         port again when DIR was started before), wait until it
#                                         answers, create the database `clawmux`, write DIR/env and
#                                         print CLAWMUX_TEST_PG_URL=postgres://… on stdout (for eval)
#   tests/support/postgres.sh stop DIR    stop the server DIR/env names, by its PID (fast shutdown:
#                                         clients are disconnected; SIGKILL after 30 s)
#   tests/support/postgres.sh status DIR  exit 0 when that server runs; prints DIR/env
#
# Several instances run side by side, one per DIR (the fault tests start and stop one of their
# own). `start` after `stop` on the same DIR keeps the data, the port and the password: clients see
# the same database come back.
#
# The server refuses to run as root: it runs as the OS user `postgres` (created by the package), or
# CLAWMUX_PG_OS_USER. DIR is made traversable (711) for that user; its data, socket and password
# file are that user's. Unix sockets only in DIR/sock; TCP only on 127.0.0.1. Clients log in as
# `clawmux` with a random password (scram-sha-256), kept in DIR/password (0600). Durability is
# traded for speed (fsync off): this is a test server.
#
# DIR/env (KEY=VALUE lines, no quoting; also valid shell):
#   PG_PORT=<port>  PG_PID=<pid>  PG_DATA=<DIR>/data  PG_LOG=<DIR>/postgres.log
#   CLAWMUX_TEST_PG_URL=postgres://clawmux:<password>@127.0.0.1:<port>/clawmux
# Env: PG_READY_TIMEOUT (seconds, default 60), CLAWMUX_PG_OS_USER.
# Progress goes to stderr; stdout has only the URL line of `start` (and `status`'s env).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

say() { printf 'postgres.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

READY_TIMEOUT="${PG_READY_TIMEOUT:-60}"

bindir() {
  local d
  d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$d" ] && [ -x "$d/postgres" ] || return 1
  printf '%s\n' "$d"
}

ensure_installed() {
  bindir >/dev/null && return 0
  "$HERE/docker.sh" apt-install postgresql
  bindir >/dev/null || die "postgresql was installed but no /usr/lib/postgresql/*/bin/postgres was found"
}

alive() { # PID: running and not a zombie
  local st
  [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null || return 1
  st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

# PID DATA: alive and it is the postmaster of DATA (never another process that took the PID).
our_postgres() {
  alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "postgres -D $2 "
}

env_get() { [ -f "$1/env" ] || return 0; sed -n "s/^$2=//p" "$1/env" | tail -n 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cmd_start() {
  local dir="$1"
  [ "$(id -u)" = 0 ] || die "start needs root (to run the server as an unprivileged user)"
  ensure_installed
  local bin user group
  bin="$(bindir)"
  user="${CLAWMUX_PG_OS_USER:-postgres}"
  id "$user" >/dev/null 2>&1 || user=nobody
  group="$(id -gn "$user")"
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  chmod 711 "$dir"
  local data="$dir/data" pid port password
  pid="$(env_get "$dir" PG_PID)"
  if our_postgres "$pid" "$data"; then
    say "already running (pid $pid)"
    printf 'CLAWMUX_TEST_PG_URL=%s\n' "$(env_get "$dir" CLAWMUX_TEST_PG_URL)"
    return 0
  fi
  port="$(env_get "$dir" PG_PORT)"
  [ -n "$port" ] || port="$(free_port)"
  if [ ! -s "$dir/password" ]; then
    (umask 077; head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/password")
  fi
  password="$(cat "$dir/password")"
  if [ ! -f "$data/PG_VERSION" ]; then
    rm -rf "$data"
    install -d -m 700 -o "$user" -g "$group" "$data"
    # The password goes to initdb through a file only its user can read, never through argv.
    local pwfile="$dir/initdb-pw"
    (umask 077; printf '%s\n' "$password" >"$pwfile")
    chown "$user:$group" "$pwfile"
    setpriv --reuid="$user" --regid="$group" --init-groups -- "$bin/initdb" -D "$data" -U clawmux --pwfile="$pwfile" \
      --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --no-locale --no-sync >"$dir/initdb.log" 2>&1 \
      || { rm -f "$pwfile"; cat "$dir/initdb.log" >&2; die "initdb failed"; }
    rm -f "$pwfile"
  fi
  install -d -m 700 -o "$user" -g "$group" "$dir/sock"
  : >>"$dir/postgres.log"
  chown "$user:$group" "$dir/postgres.log"
  # setsid: the server outlives this script and the test that started it. setpriv execs, so $!
  # is the postmaster (checked against its own postmaster.pid below).
  setsid setpriv --reuid="$user" --regid="$group" --init-groups -- "$bin/postgres" -D "$data" \
    -c listen_addresses=127.0.0.1 -c port="$port" -c unix_socket_directories="$dir/sock" \
    -c max_connections=300 -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
    >>"$dir/postgres.log" 2>&1 </dev/null &
  local started=$! t0=$SECONDS
  until "$bin/pg_isready" -q -h "$dir/sock" -p "$port" -U clawmux -d postgres; do
    alive "$started" || { tail -n 20 "$dir/postgres.log" >&2; die "the server exited during startup"; }
    [ $((SECONDS - t0)) -lt "$READY_TIMEOUT" ] || { kill -KILL "$started" 2>/dev/null || true; die "not ready after $READY_TIMEOUT s"; }
    sleep 0.2
  done
  pid="$(head -n 1 "$data/postmaster.pid")"
  [ "$pid" = "$started" ] || say "note: postmaster pid $pid (started $started)"
  # Over the socket (trust): no password in argv.
  if ! "$bin/psql" -qAt -h "$dir/sock" -p "$port" -U clawmux -d postgres -c "SELECT 1 FROM pg_database WHERE datname = 'clawmux'" | grep -q 1; then
    "$bin/psql" -q -h "$dir/sock" -p "$port" -U clawmux -d postgres -c "CREATE DATABASE clawmux" >&2
  fi
  local url="postgres://clawmux:$password@127.0.0.1:$port/clawmux"
  (umask 077; cat >"$dir/env" <<EOF
PG_PORT=$port
PG_PID=$pid
PG_DATA=$data
PG_LOG=$dir/postgres.log
CLAWMUX_TEST_PG_URL=$url
EOF
)
  say "PostgreSQL $("$bin/postgres" --version | awk '{print $3}') on 127.0.0.1:$port (pid $pid, data $data) ready in $((SECONDS - t0)) s"
  printf 'CLAWMUX_TEST_PG_URL=%s\n' "$url"
}

cmd_stop() {
  local dir="$1" pid data
  [ -f "$dir/env" ] || { say "nothing to stop in $dir"; return 0; }
  pid="$(env_get "$dir" PG_PID)"
  data="$(env_get "$dir" PG_DATA)"
  our_postgres "$pid" "$data" || { say "not running"; return 0; }
  # SIGINT: fast shutdown (clients are disconnected; SIGTERM would wait for them).
  kill -INT "$pid"
  local i
  for i in $(seq 1 300); do
    alive "$pid" || { say "stopped (pid $pid)"; return 0; }
    sleep 0.1
  done
  say "still running after 30 s; SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

cmd_status() {
  local dir="$1"
  our_postgres "$(env_get "$dir" PG_PID)" "$(env_get "$dir" PG_DATA)" || return 1
  cat "$dir/env"
}

[ $# -ge 2 ] || usage
cmd="$1"
shift
case "$cmd" in
  start) cmd_start "$1" ;;
  stop) cmd_stop "$1" ;;
  status) cmd_status "$1" ;;
  *) usage ;;
esac
