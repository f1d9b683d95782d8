#!/usr/bin/env bash
# Builds the pinned OCI registry (distribution/distribution, the registry
# Docker Hub, GitHub's and most others are built on) from its Go module and
# caches it under $PROXYAUDIT_CACHE (default: <repo>/.cache), as helm.sh does
# helm. The release test pushes to it. Prints the binary's path.
set -euo pipefail
REGISTRY_VERSION=v3.1.2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/registry-$REGISTRY_VERSION-$key"
if [ -x "$bin/registry" ]; then
  echo "$bin/registry"; exit 0
fi
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" registry "building the OCI registry (distribution $REGISTRY_VERSION) from the Go module proxy (~2 min)" -- \
  env CGO_ENABLED=0 GOBIN="$bin.tmp" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
  "github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION" >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/registry"
