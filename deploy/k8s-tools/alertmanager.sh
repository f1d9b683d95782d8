#!/usr/bin/env bash
# Builds the pinned Alertmanager from its Go module (no release download or
# registry here, only the Go module proxy) and caches it under
# $PROXYAUDIT_CACHE (default: <repo>/.cache). Prints the binary's path.
# The remediation tests start it as the local cluster starts kube-apiserver
# (internal/localcluster/alertmanager.go).
#
# The module's web UI embeds ui/app/dist, which its release pipeline builds
# with npm and the module zip does not hold, so `go install` of the module
# fails; this builds a copy of the module with a one-page placeholder there.
# Only the UI is affected: the v2 API, silences and receivers are the
# release's code.
set -euo pipefail
AM_VERSION=v0.35.0
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/alertmanager-$AM_VERSION-$key"
if [ -x "$bin/alertmanager" ]; then
  echo "$bin/alertmanager"; exit 0
fi
src=$(GOFLAGS=-mod=mod go mod download -json "github.com/prometheus/alertmanager@$AM_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
cp -r "$src" "$work/am"; chmod -R u+w "$work/am"
for ui in elm mantine; do
  mkdir -p "$work/am/ui/app/dist/$ui"
  echo '<!doctype html><title>Alertmanager</title><p>Built without its web UI; use the API (/api/v2/).' > "$work/am/ui/app/dist/$ui/index.html"
done
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" alertmanager "building alertmanager $AM_VERSION from the Go module proxy (~2 min)" -- \
  env -C "$work/am" CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -o "$bin.tmp/alertmanager" \
  -ldflags "-s -w -X github.com/prometheus/common/version.Version=${AM_VERSION#v}" ./cmd/alertmanager >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/alertmanager"
