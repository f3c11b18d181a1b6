#!/usr/bin/env bash
# Builds the images of the compose stack (images/compose.yaml) from local installs: nothing is
# downloaded inside a build when BASE already has what the Dockerfiles need.
#
#   images/build.sh [clawmux] [openclaw] [litellm] [ephemeral]   (none: the first three)
#
#   clawmux   images/clawmux/Dockerfile, FROM scratch: the clawmux binary (CLAWMUX_BINARY, default
#             target/release/clawmux, built with `cargo build --release --locked` when missing;
#             debug info stripped into the image, symbols kept), git, /bin/sh, their libraries.
#   openclaw  images/openclaw/Dockerfile: Node 24 + openclaw@2026.9.6 as npm installed them
#             (tests/support/install-openclaw.sh: the npm registry the machine is configured
#             with, cached in ~/.cache/clawmux), git, the config that keeps the invariants.
#   ephemeral images/ephemeral/Dockerfile: the one-shot agent image of ephemeral runs (Node 24 +
#             openclaw@2026.9.6 as for the gateway image, git, the LLM socket bridge).
#   litellm   images/litellm/Dockerfile: LiteLLM 1.106.2 as pip installed it
#             (tests/support/install-litellm.sh: PyPI through pip's configuration, pinned by
#             tests/support/litellm/constraints.txt), on the base's Python (must be 3.11, the
#             venv's minor version), plus async-timeout (redis needs it on CPython < 3.11.3).
#
# Each build context is staged in a temporary directory (hard links when possible) and removed.
# Prints one line per image: name, size, build seconds (also to BUILD_REPORT when set).
#
# Env:
#   BASE                  base of all three images (default debian:bookworm-slim; the tests use
#                         their offline debootstrap base, which has git, ca-certificates, python3)
#   CLAWMUX_IMAGE         default clawmux/clawmux:local
#   OPENCLAW_IMAGE        default clawmux/openclaw:2026.9.6
#   LITELLM_IMAGE         default clawmux/litellm:1.106.2
#   EPHEMERAL_IMAGE       default clawmux/openclaw-ephemeral:2026.9.6
#   EPHEMERAL_LABEL       an extra label of the ephemeral image (tests: the hash of its inputs)
#   CLAWMUX_BINARY        the clawmux binary to ship (default target/release/clawmux)
#   DOCKER_BUILD_NETWORK  --network of the build containers (the tests: none, proving that no
#                         build step reaches the network); default: Docker's default
#   BUILD_REPORT          append "name size_bytes seconds" lines to this file
#   CLAWMUX_CACHE         the install cache (default ~/.cache/clawmux)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
BASE="${BASE:-debian:bookworm-slim}"
CLAWMUX_IMAGE="${CLAWMUX_IMAGE:-clawmux/clawmux:local}"
OPENCLAW_VERSION=2026.9.6
NODE_VERSION=24.21.0
LITELLM_VERSION=1.106.2
ASYNC_TIMEOUT_VERSION=5.0.1
CACHE="${CLAWMUX_CACHE:-$HOME/.cache/clawmux}"
OPENCLAW_IMAGE="${OPENCLAW_IMAGE:-clawmux/openclaw:$OPENCLAW_VERSION}"
LITELLM_IMAGE="${LITELLM_IMAGE:-clawmux/litellm:$LITELLM_VERSION}"
EPHEMERAL_IMAGE="${EPHEMERAL_IMAGE:-clawmux/openclaw-ephemeral:$OPENCLAW_VERSION}"

say() { printf 'build.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

command -v docker >/dev/null || die "docker is required"
# The Dockerfiles build with the classic builder and with BuildKit alike; without the buildx
# plugin the docker CLI needs to be told to use the classic one.
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
NETWORK_ARGS=()
if [ -n "${DOCKER_BUILD_NETWORK:-}" ]; then NETWORK_ARGS=(--network "$DOCKER_BUILD_NETWORK"); fi

STAGES=()
cleanup() { for d in "${STAGES[@]}"; do rm -rf "$d"; done; }
trap cleanup EXIT
# new_stage VAR: a fresh staging directory in VAR, removed on exit. Not `$(stage)`: a command
# substitution is a subshell, whose STAGES+= the exit trap never sees (each build leaked ~1 GB).
new_stage() {
  local d
  d="$(mktemp -d "${TMPDIR:-/tmp}/clawmux-image.XXXXXX")"
  STAGES+=("$d")
  printf -v "$1" '%s' "$d"
}
# link_or_copy SRC DST: a hard-linked copy of a tree when on one filesystem, else a real copy
link_or_copy() { cp -al "$1" "$2" 2>/dev/null || { rm -rf "$2"; cp -a "$1" "$2"; }; }

# build NAME IMAGE CONTEXT DOCKERFILE [--build-arg ...]
build() {
  local name="$1" image="$2" ctx="$3" dockerfile="$4" t0 secs size
  shift 4
  t0="$(date +%s.%N)"
  say "docker build $image (base $BASE, context $(du -sm "$ctx" | cut -f1) MB)"
  docker build --pull=false "${NETWORK_ARGS[@]}" --build-arg "BASE=$BASE" "$@" \
    --label "org.opencontainers.image.source=clawmux images/$name" -f "$dockerfile" -t "$image" "$ctx" >&2
  secs="$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
  size="$(docker image inspect -f '{{.Size}}' "$image")"
  say "$image: $(awk -v s="$size" 'BEGIN { printf "%.0f MB", s / 1e6 }') in $secs s"
  if [ -n "${BUILD_REPORT:-}" ]; then echo "$image $size $secs" >>"$BUILD_REPORT"; fi
}

build_clawmux() {
  local bin="${CLAWMUX_BINARY:-}" ctx
  if [ -z "$bin" ]; then
    bin="${CARGO_TARGET_DIR:-$REPO/target}/release/clawmux"
    if [ ! -x "$bin" ]; then
      say "no $bin: cargo build --release --locked --bin clawmux"
      (cd "$REPO" && cargo build --release --locked --bin clawmux) >&2
    fi
  fi
  [ -x "$bin" ] || die "no clawmux binary at $bin"
  new_stage ctx
  # debug info out (the release profile keeps line tables: ~100 MB), symbols in (named frames
  # in a backtrace)
  if command -v strip >/dev/null; then strip --strip-debug -o "$ctx/clawmux" "$bin"; else cp "$bin" "$ctx/clawmux"; fi
  cp "$HERE/clawmux/rootfs.sh" "$ctx/"
  build clawmux "$CLAWMUX_IMAGE" "$ctx" "$HERE/clawmux/Dockerfile" \
    --label "org.opencontainers.image.version=$("$ctx/clawmux" --version | awk '{ print $2 }')"
}

# openclaw_context DIR: node and the openclaw npm prefix into the staged context DIR
openclaw_context() {
  local out node_bin mjs prefix ctx
  out="$(OPENCLAW_VERSION="$OPENCLAW_VERSION" NODE_VERSION="$NODE_VERSION" "$REPO/tests/support/install-openclaw.sh" v4)"
  node_bin="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_NODE_BIN=//p')"
  mjs="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_OPENCLAW_MJS=//p')"
  prefix="${mjs%%/node_modules/*}"
  [ -x "$node_bin" ] && [ -d "$prefix/node_modules/openclaw" ] || die "node ($node_bin) or openclaw ($prefix) missing"
  ctx="$1"
  cp "$node_bin" "$ctx/node"
  mkdir "$ctx/openclaw"
  cp "$prefix/package.json" "$ctx/openclaw/"
  if [ -f "$prefix/package-lock.json" ]; then cp "$prefix/package-lock.json" "$ctx/openclaw/"; fi
  link_or_copy "$prefix/node_modules" "$ctx/openclaw/node_modules"
}

build_ephemeral() {
  local ctx
  new_stage ctx
  openclaw_context "$ctx"
  cp "$HERE/ephemeral/bridge.mjs" "$HERE/ephemeral/entrypoint.sh" "$ctx/"
  build ephemeral "$EPHEMERAL_IMAGE" "$ctx" "$HERE/ephemeral/Dockerfile" \
    --build-arg "OPENCLAW_VERSION=$OPENCLAW_VERSION" --build-arg "NODE_VERSION=$NODE_VERSION" \
    ${EPHEMERAL_LABEL:+--label "$EPHEMERAL_LABEL"}
}

build_openclaw() {
  local ctx
  new_stage ctx
  openclaw_context "$ctx"
  cp "$HERE/openclaw/openclaw.image.json" "$HERE/openclaw/healthcheck.mjs" "$HERE/openclaw/token-init.sh" "$ctx/"
  build openclaw "$OPENCLAW_IMAGE" "$ctx" "$HERE/openclaw/Dockerfile" \
    --build-arg "OPENCLAW_VERSION=$OPENCLAW_VERSION" --build-arg "NODE_VERSION=$NODE_VERSION"
}

build_litellm() {
  local out py site ver ctx
  out="$(LITELLM_VERSION="$LITELLM_VERSION" "$REPO/tests/support/install-litellm.sh")"
  py="$(printf '%s\n' "$out" | sed -n 's/^CLAWMUX_LITELLM_PYTHON=//p')"
  [ -x "$py" ] || die "no LiteLLM venv python at $py"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  ver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [ -d "$site/litellm" ] || die "no litellm package in $site"
  new_stage ctx
  link_or_copy "$site" "$ctx/site-packages"
  # redis (a LiteLLM dependency) imports async-timeout on CPython < 3.11.3, which is what
  # bookworm's python3 is (3.11.2); pip resolved the venv on a newer 3.11 and left it out
  local extra="$CACHE/litellm-extra-async-timeout-$ASYNC_TIMEOUT_VERSION"
  if [ ! -f "$extra/.clawmux-installed" ]; then
    rm -rf "$extra"
    "$py" -m pip install --quiet --disable-pip-version-check --no-input --no-deps --target "$extra" \
      "async-timeout==$ASYNC_TIMEOUT_VERSION" >&2
    touch "$extra/.clawmux-installed"
  fi
  cp -a "$extra"/async_timeout* "$ctx/site-packages/"
  cp "$HERE/litellm/config.yaml" "$ctx/config.yaml"
  build litellm "$LITELLM_IMAGE" "$ctx" "$HERE/litellm/Dockerfile" \
    --build-arg "LITELLM_VERSION=$LITELLM_VERSION" --build-arg "PYTHON_MINOR=$ver"
}

[ $# -gt 0 ] || set -- clawmux openclaw litellm
for what in "$@"; do
  case "$what" in
    clawmux) build_clawmux ;;
    openclaw) build_openclaw ;;
    litellm) build_litellm ;;
    ephemeral) build_ephemeral ;;
    *) die "unknown image '$what' (clawmux, openclaw, litellm, ephemeral)" ;;
  esac
done
