#!/bin/sh
# Assembles the clawmux runtime image's whole filesystem in OUT, from a Debian stage
# (images/clawmux/Dockerfile and Dockerfile.build run it; the image is `FROM scratch` + OUT).
#
#   rootfs.sh BINARY OUT
#
# What goes in, and why (nothing else: no package manager, no coreutils, no bash, no curl):
#   /usr/local/bin/clawmux     the service (its `healthcheck` subcommand is the HEALTHCHECK)
#   git: /usr/lib/git-core     the git relay's host side: clone, fetch, am, push (git with its
#   + git-core/templates       builtins, git-remote-http(s) for https remotes, the templates)
#   /bin/sh (dash)             git runs the relay's credential helper (`!f() { ... }; f`) with it
#   the shared libraries of all of the above (ldd), the dynamic loader
#   /etc/ssl/certs/ca-certificates.crt   git over https (clawmux's own HTTPS uses rustls' roots)
#   /etc/passwd, /etc/group    the user clawmux (UID/GID 10001) and nothing else but root
#   /etc/nsswitch.conf         name lookups: files, then DNS (compose service names)
#   /tmp (1777), /var/lib/clawmux (10001, the state volume: store, audit log, device key)
# The Debian stage needs git and ca-certificates installed (the Dockerfiles install them when
# the base lacks them), ldd (libc-bin), cp, find.
set -eu

BIN="${1:?usage: rootfs.sh BINARY OUT}"
OUT="${2:?usage: rootfs.sh BINARY OUT}"
UID_GID=10001

[ -x "$BIN" ] || { echo "rootfs.sh: $BIN is not an executable" >&2; exit 1; }
command -v git >/dev/null || { echo "rootfs.sh: git is not installed in this stage" >&2; exit 1; }
[ -s /etc/ssl/certs/ca-certificates.crt ] || { echo "rootfs.sh: no CA bundle (ca-certificates)" >&2; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT"
# merged /usr, as on the base: /bin, /lib, /lib64, /sbin are symlinks into /usr there too, so
# every path ldd prints resolves the same way in the image
for d in bin sbin lib lib64; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$OUT/$d"; fi
done

# put PATH: copy the file PATH resolves to, under its physical directory, keeping its name
put() {
  dir="$(cd "$(dirname "$1")" && pwd -P)"
  mkdir -p "$OUT$dir"
  cp -L --preserve=mode "$1" "$OUT$dir/$(basename "$1")"
}

mkdir -p "$OUT/usr/local/bin"
cp --preserve=mode "$BIN" "$OUT/usr/local/bin/clawmux"

GIT_EXEC="$(git --exec-path)"
mkdir -p "$OUT/usr/bin" "$OUT$(dirname "$GIT_EXEC")" "$OUT/usr/share"
# one cp: hard links inside git-core stay hard links (most of its commands are git itself)
cp -a "$GIT_EXEC" "$OUT$(dirname "$GIT_EXEC")/"
# keep git's builtins (hard links to git) and the http(s) remote helper; drop the daemons,
# servers, scripts (they need perl, sed, ...: not here) and helpers the relay never runs
for f in "$OUT$GIT_EXEC"/* "$OUT$GIT_EXEC"/.[!.]*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  case "$(basename "$f")" in git-remote-http | git-remote-https) continue ;; esac
  [ "$f" -ef "$OUT$GIT_EXEC/git" ] && continue
  rm -rf "$f"
done
ln -s "..${GIT_EXEC#/usr}/git" "$OUT/usr/bin/git"
# the templates for clone and init, without the sample hooks (scripts nobody runs here)
if [ -d /usr/share/git-core/templates ]; then
  mkdir -p "$OUT/usr/share/git-core"
  cp -a /usr/share/git-core/templates "$OUT/usr/share/git-core/"
  rm -rf "$OUT/usr/share/git-core/templates/hooks"
fi
put "$(readlink -f /bin/sh)"
ln -sf "$(basename "$(readlink -f /bin/sh)")" "$OUT/usr/bin/sh"

# the shared libraries of every executable above (ldd lists them transitively), and the loader
find "$OUT" -type f -perm -u+x | while read -r exe; do
  ldd "$exe" 2>/dev/null | awk '/=> \// { print $3 } /^[ \t]*\/[^ ]*ld-linux/ { print $1 }'
done | sort -u | while read -r lib; do
  put "$lib"
done

mkdir -p "$OUT/etc/ssl/certs"
cp -L /etc/ssl/certs/ca-certificates.crt "$OUT/etc/ssl/certs/ca-certificates.crt"
printf 'hosts:          files dns\n' >"$OUT/etc/nsswitch.conf"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nclawmux:x:%s:%s:clawmux:/var/lib/clawmux:/usr/sbin/nologin\n' "$UID_GID" "$UID_GID" >"$OUT/etc/passwd"
printf 'root:x:0:\nclawmux:x:%s:\n' "$UID_GID" >"$OUT/etc/group"

mkdir -p "$OUT/tmp" "$OUT/var/lib/clawmux"
chmod 1777 "$OUT/tmp"
chown "$UID_GID:$UID_GID" "$OUT/var/lib/clawmux"
chmod 0700 "$OUT/var/lib/clawmux"

# a last look: the loader finds every library (git needs a /dev, which only a container has:
# the tests run it in the image)
chroot "$OUT" /usr/local/bin/clawmux --version >/dev/null
chroot "$OUT" /bin/sh -c 'exit 0'
echo "rootfs.sh: $(du -sm "$OUT" | cut -f1) MB in $OUT" >&2
