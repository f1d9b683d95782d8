#!/usr/bin/env bash
# Builds the pinned promtool (Prometheus's rule checker and unit tester)
# from Prometheus's Go module and caches it under $PROXYAUDIT_CACHE (default:
# <repo>/.cache). Prints the binary's path. The chart's tests run the
# PrometheusRule's alerts through it (`promtool test rules`): Prometheus's
# own rule engine, not a re-implementation of PromQL. A cold build takes
# ~5 min on 2 cores.
set -euo pipefail
PROM_VERSION=v0.316.0
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/promtool-$PROM_VERSION-$key"
if [ -x "$bin/promtool" ]; then
  echo "$bin/promtool"; exit 0
fi
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" promtool "building promtool (prometheus $PROM_VERSION) from the Go module proxy (~5 min)" -- \
  env CGO_ENABLED=0 GOBIN="$bin.tmp" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
  "github.com/prometheus/prometheus/cmd/promtool@$PROM_VERSION" >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/promtool"
