#!/usr/bin/env bash
# Builds the pinned Helm CLI from its Go module (there is no registry or
# release download here, only the Go module proxy) and caches it under
# $PROXYAUDIT_CACHE (default: <repo>/.cache). Prints the binary's path.
# A cold build takes ~2 min on 2 cores.
set -euo pipefail
HELM_VERSION=v3.22.0
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
bin="$cache/helm-$HELM_VERSION-$key"
if [ -x "$bin/helm" ]; then
  echo "$bin/helm"; exit 0
fi
mkdir -p "$bin.tmp"
# -ldflags as helm's own Makefile sets them: the version helm reports, and the
# Kubernetes version `helm template` and `helm lint` assume without a cluster:
# 1.37, the API server the tests run (the module default 1.20 fails the
# chart's kubeVersion).
k8s="-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=37"
k8s="$k8s -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=37"
"$repo/deploy/quiet.sh" helm "building helm $HELM_VERSION from the Go module proxy (~2 min)" -- \
  env CGO_ENABLED=0 GOBIN="$bin.tmp" GOFLAGS=-mod=mod go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION $k8s" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin/helm"
