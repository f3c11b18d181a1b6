#!/usr/bin/env bash
# docker-compose for the stack on a Docker engine WITHOUT a bridge network (dockerd --bridge=none,
# as on this project's test machines): images/compose.yaml + images/compose.host.yaml.
#
#   images/compose-host.sh -p PROJECT --env-file ENV_FILE [-f EXTRA.yaml]... COMMAND [ARGS...]
#   images/compose-host.sh -p clawmux --env-file images/.env up -d
#   images/compose-host.sh -p clawmux --env-file images/.env exec clawmux clawmux doctor
#   images/compose-host.sh -p clawmux --env-file images/.env down
#
# Why a script: with host networking a service can publish no port, and a compose override file
# can add to compose.yaml's `ports:` list but not remove it. So this merges the files with
# `docker-compose config`, deletes `ports:` from the host-networked services (nothing else), writes
# the result to ENV_FILE.compose.yaml (mode 0600: `config` substitutes the env file's values, the
# secrets included; rewritten on every call) and runs docker-compose COMMAND on it.
# Needs docker-compose and python3 with PyYAML (Debian's docker-compose brings it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
die() { printf 'compose-host.sh: %s\n' "$*" >&2; exit 2; }

project="" env_file="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -p | --project-name) [ $# -ge 2 ] || die "$1 needs a value"; project="$2"; shift 2 ;;
    --env-file) [ $# -ge 2 ] || die "$1 needs a value"; env_file="$2"; shift 2 ;;
    -f | --file) [ $# -ge 2 ] || die "$1 needs a value"; extra+=(-f "$2"); shift 2 ;;
    -*) die "unknown option $1 (only -p, --env-file, -f before the command)" ;;
    *) break ;;
  esac
done
[ -n "$project" ] && [ -n "$env_file" ] && [ $# -ge 1 ] || die "usage: $0 -p PROJECT --env-file ENV_FILE [-f EXTRA.yaml]... COMMAND [ARGS...]"
[ -f "$env_file" ] || die "no env file $env_file"

merged="$env_file.compose.yaml"
(
  umask 077
  docker-compose -p "$project" --env-file "$env_file" -f "$HERE/compose.yaml" -f "$HERE/compose.host.yaml" "${extra[@]}" \
    config >"$merged.tmp"
  python3 - "$merged.tmp" <<'PY'
import sys, yaml
path = sys.argv[1]
c = yaml.safe_load(open(path))
for svc in c["services"].values():
    if svc.get("network_mode") == "host":
        svc.pop("ports", None)
with open(path, "w") as f:
    yaml.safe_dump(c, f, sort_keys=False)
PY
  mv -f "$merged.tmp" "$merged"
)
exec docker-compose -p "$project" --env-file "$env_file" -f "$merged" "$@"
