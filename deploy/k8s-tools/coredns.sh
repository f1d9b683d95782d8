#!/usr/bin/env bash
# Builds the pinned CoreDNS from its Go module (the cluster DNS of the local
# cluster's real nodes: the chart's collectors find the aggregator by its
# Service name) and caches it under $PROXYAUDIT_CACHE (default:
# <repo>/.cache). Prints the binary's path. A cold build takes ~3 min on 2 cores.
set -euo pipefail
COREDNS_VERSION=v1.14.7
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/coredns-$COREDNS_VERSION-$key"
if [ -x "$bin/coredns" ]; then
  echo "$bin/coredns"; exit 0
fi
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" coredns "building coredns $COREDNS_VERSION from the Go module proxy (~3 min)" -- \
  env CGO_ENABLED=0 GOBIN="$bin.tmp" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
  "github.com/coredns/coredns@$COREDNS_VERSION" >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/coredns"
