#!/usr/bin/env bash
# The tests' base image, built offline: a minimal Debian with git and python3, from the apt mirror
# this machine is configured with (no registry pull, no host name in this file). It is the BASE
# of every image the tests build (images/build.sh: clawmux, the gateway, LiteLLM) and the gateway
# container of the relay tests; python3 is there for the LiteLLM image (one debootstrap for all).
#
#   tests/support/docker-image.sh            ensure the image exists; prints IMAGE=<name> on stdout
#   tests/support/docker-image.sh --rebuild  rebuild the root tarball and re-import
#   tests/support/docker-image.sh --tarball  steps 1-3 only, no engine needed (tests/support/prefetch.sh)
#
# Steps (each skipped when its result exists):
#   1. the mirror: the first `deb` source of this machine's apt configuration that carries the
#      suite (/etc/apt/sources.list.d/*.sources in deb822 form, then *.list and sources.list);
#   2. `debootstrap --variant=minbase --include=PACKAGES SUITE ROOTFS MIRROR` with PACKAGES =
#      git,ca-certificates,python3 (debootstrap is installed with apt when missing), apt caches
#      and logs dropped;
#   3. the root tarball, cached as CACHE/images/base-SUITE.tar (its package list beside it);
#   4. `docker import` as clawmux/base:SUITE, labelled with the package list (skipped when the
#      image exists with that label; an image or tarball of another package list is rebuilt).
# Node 24 and openclaw are not in the image: tests/support/gateway-container.sh bind-mounts them
# read-only from the cache (tests/support/install-openclaw.sh).
#
# Env: CLAWMUX_CACHE (default $HOME/.cache/clawmux), CLAWMUX_BASE_SUITE (default bookworm),
#      CLAWMUX_BASE_IMAGE (default clawmux/base:<suite>), CLAWMUX_APT_MIRROR (override the
#      mirror taken from the apt configuration).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
SUITE="${CLAWMUX_BASE_SUITE:-bookworm}"
IMAGE="${CLAWMUX_BASE_IMAGE:-clawmux/base:$SUITE}"
DIR="$CACHE/images"
TARBALL="$DIR/base-$SUITE.tar"
PACKAGES=git,ca-certificates,python3

say() { printf 'docker-image.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

REBUILD=0
TARBALL_ONLY=0
case "${1:-}" in
  "") ;;
  --rebuild) REBUILD=1 ;;
  --tarball) TARBALL_ONLY=1 ;;
  *) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

# apt_mirror SUITE: the URI of the first enabled `deb` source that serves SUITE (not -security).
apt_mirror() {
  python3 - "$1" <<'PY'
import glob, sys
suite = sys.argv[1]
files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))
lists = ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list"))

def deb822(path):
    """Stanzas of a deb822 .sources file (comments dropped, continuation lines joined)."""
    out, cur, key = [], {}, None
    for raw in open(path, encoding="utf-8", errors="replace"):
        line = raw.rstrip("\n")
        if line.startswith("#"):
            continue
        if not line.strip():
            if cur:
                out.append(cur)
            cur, key = {}, None
            continue
        if line[0] in " \t" and key:
            cur[key] += " " + line.strip()
            continue
        if ":" in line:
            key, val = line.split(":", 1)
            key = key.strip().lower()
            cur[key] = val.strip()
    if cur:
        out.append(cur)
    return out

for path in files:
    for st in deb822(path):
        if st.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in st.get("types", "").split():
            continue
        if suite in st.get("suites", "").split() and "main" in st.get("components", "").split():
            for uri in st.get("uris", "").split():
                if uri.startswith(("http://", "https://", "file:/")):
                    print(uri)
                    sys.exit(0)
for path in lists:
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # [arch=... signed-by=...]
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 3 and words[1] == suite and "main" in words[2:]:
            print(words[0])
            sys.exit(0)
sys.exit(1)
PY
}

image_exists() {
  [ "$(docker image inspect -f '{{index .Config.Labels "clawmux.base.packages"}}' "$IMAGE" 2>/dev/null)" = "$PACKAGES" ]
}
tarball_ok() { [ -s "$TARBALL" ] && [ "$(cat "$TARBALL.packages" 2>/dev/null)" = "$PACKAGES" ]; }

[ "$TARBALL_ONLY" = 1 ] || "$HERE/docker.sh" ensure

if [ "$TARBALL_ONLY" = 0 ] && [ "$REBUILD" = 0 ] && image_exists; then
  say "$IMAGE exists ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
  echo "IMAGE=$IMAGE"
  exit 0
fi

mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9

if [ "$REBUILD" = 1 ] || ! tarball_ok; then
  MIRROR="${CLAWMUX_APT_MIRROR:-$(apt_mirror "$SUITE" || true)}"
  [ -n "$MIRROR" ] || die "no deb source for '$SUITE' in this machine's apt configuration; set CLAWMUX_APT_MIRROR"
  "$HERE/docker.sh" apt-install debootstrap
  ROOTFS="$DIR/rootfs-$SUITE.tmp"
  rm -rf "$ROOTFS"
  say "debootstrap --variant=minbase --include=$PACKAGES $SUITE (mirror from the apt configuration)"
  t0="$(now)"
  if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" \
    >"$DIR/debootstrap.log" 2>&1; then
    tail -n 30 "$DIR/debootstrap.log" >&2
    die "debootstrap failed (log: $DIR/debootstrap.log)"
  fi
  say "debootstrap done in $(elapsed "$t0") s"
  # smaller and reproducible-ish: no package caches, no apt lists, no logs
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
    "$ROOTFS"/var/log/* "$ROOTFS"/tmp/* "$ROOTFS"/debootstrap
  mkdir -p "$ROOTFS/workspace"
  chmod 1777 "$ROOTFS/tmp"
  t0="$(now)"
  tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.tmp" .
  mv -f "$TARBALL.tmp" "$TARBALL"
  printf '%s' "$PACKAGES" >"$TARBALL.packages"
  rm -rf "$ROOTFS"
  say "root tarball $TARBALL ($(du -m "$TARBALL" | cut -f1) MB) in $(elapsed "$t0") s"
fi
if [ "$TARBALL_ONLY" = 1 ]; then
  say "root tarball $TARBALL ready"
  exit 0
fi

if [ "$REBUILD" = 1 ] || ! image_exists; then
  t0="$(now)"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --change "LABEL clawmux.base.packages=$PACKAGES" \
    --message "clawmux test base: debootstrap minbase $SUITE + $PACKAGES" \
    "$TARBALL" "$IMAGE" >/dev/null
  say "imported $IMAGE in $(elapsed "$t0") s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
fi
echo "IMAGE=$IMAGE"
