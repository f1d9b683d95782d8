#!/usr/bin/env bash
# Builds the pinned krew (kubectl's plugin manager) from its Go module and
# caches it under $PROXYAUDIT_CACHE (default: <repo>/.cache), as helm.sh does
# helm. The release test installs the krew manifest with it. Prints the
# binary's path (kubectl-krew: `kubectl krew` when on PATH).
set -euo pipefail
KREW_VERSION=v0.4.3
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/krew-$KREW_VERSION-$key"
if [ -x "$bin/kubectl-krew" ]; then
  echo "$bin/kubectl-krew"; exit 0
fi
mkdir -p "$bin.tmp"
"$repo/deploy/quiet.sh" krew "building krew $KREW_VERSION from the Go module proxy (~1 min)" -- \
  env CGO_ENABLED=0 GOBIN="$bin.tmp" GOFLAGS=-mod=mod go install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/krew/internal/version.gitTag=$KREW_VERSION" \
  "sigs.k8s.io/krew/cmd/krew@$KREW_VERSION" >&2
mv "$bin.tmp/krew" "$bin.tmp/kubectl-krew"
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/kubectl-krew"
