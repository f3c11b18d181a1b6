#!/usr/bin/env bash
# The ephemeral agent image for the docker_ephemeral_ tests, built once per content: images/build.sh
# ephemeral on the offline base image (build containers on --network none), labelled with a hash of
# its inputs (images/ephemeral/*, images/build.sh); skipped when the image exists with that label.
# Prints IMAGE=<name> on stdout. Env: EPHEMERAL_IMAGE (default clawmux/openclaw-ephemeral:test),
# BASE (default the tests' base image, tests/support/docker-image.sh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
IMAGE="${EPHEMERAL_IMAGE:-clawmux/openclaw-ephemeral:test}"
hash="$(cat "$REPO"/images/ephemeral/* "$REPO/images/build.sh" | sha256sum | cut -c1-16)"
have="$(docker image inspect -f '{{ index .Config.Labels "io.clawmux.inputs" }}' "$IMAGE" 2>/dev/null || true)"
if [ "$have" != "$hash" ]; then
  base="${BASE:-$("$HERE/docker-image.sh" | sed -n 's/^IMAGE=//p')}"
  BASE="$base" EPHEMERAL_IMAGE="$IMAGE" DOCKER_BUILD_NETWORK=none EPHEMERAL_LABEL="io.clawmux.inputs=$hash" \
    "$REPO/images/build.sh" ephemeral >&2
else
  printf 'ephemeral-image.sh: %s is up to date (inputs %s)\n' "$IMAGE" "$hash" >&2
fi
echo "IMAGE=$IMAGE"
