#!/usr/bin/env bash
# Builds the pinned cyclonedx-gomod (CycloneDX SBOMs from Go modules and
# binaries) from its Go module and caches it under $PROXYAUDIT_CACHE
# (default: <repo>/.cache), as helm.sh does helm. make release writes each
# binary's SBOM with it. Prints the binary's path.
set -euo pipefail
SBOM_VERSION=v1.10.0
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/cyclonedx-gomod-$SBOM_VERSION-$key"
if [ -x "$bin/cyclonedx-gomod" ]; then
  echo "$bin/cyclonedx-gomod"; exit 0
fi
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" cyclonedx-gomod "building cyclonedx-gomod $SBOM_VERSION from the Go module proxy (~1 min)" -- \
  env CGO_ENABLED=0 GOBIN="$bin.tmp" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
  "github.com/CycloneDX/cyclonedx-gomod/cmd/cyclonedx-gomod@$SBOM_VERSION" >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/cyclonedx-gomod"
