#!/usr/bin/env bash
# Builds an OpenTelemetry Collector (v0.111.0: the k8sobjects receiver and the
# debug exporter, deploy/k8s-tools/otelcol) from the Go module proxy and caches
# it under $PROXYAUDIT_CACHE (default: <repo>/.cache). Prints the binary's path.
# It is the consumer proxyaudit did not write that reads its OpenReports in
# internal/chart's tests, as a hub collects ClusterReports from member clusters.
# Its own module: the collector's Kubernetes libraries (client-go v0.31) are not
# proxyaudit's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(cat "$0" "$here/otelcol/go.mod" "$here/otelcol/go.sum" "$here/otelcol/main.go" | sha256sum | cut -c1-12)
bin="$cache/otelcol-v0.111.0-$key"
if [ -x "$bin/otelcol" ]; then
  echo "$bin/otelcol"; exit 0
fi
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" otelcol "building the OpenTelemetry Collector (k8sobjects receiver) from the Go module proxy (~3 min)" -- \
  env -C "$here/otelcol" CGO_ENABLED=0 GOFLAGS=-mod=mod GOWORK=off go build -trimpath -o "$bin.tmp/otelcol" -ldflags "-s -w" . >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/otelcol"
