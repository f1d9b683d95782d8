#!/usr/bin/env bash
# Builds the pinned kube-apiserver, kube-proxy, etcd, kubectl and the node components (kubelet, kube-controller-manager, kube-scheduler) from Go modules and
# caches them under $PROXYAUDIT_CACHE (default: <repo>/.cache). The cache key is
# a hash of this module's go.mod, go.sum and sources, so a changed pin rebuilds
# and an unchanged one is reused. Prints the bin directory on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(cd "$here" && cat go.mod go.sum */main.go build.sh | sha256sum | cut -c1-16)
bin="$cache/k8s-$key/bin"
tools="kube-apiserver kube-proxy etcd kubectl kubelet kube-controller-manager kube-scheduler"
have=1
for t in $tools; do [ -x "$bin/$t" ] || have=0; done
if [ $have = 1 ]; then
  echo "$bin"; exit 0
fi
mkdir -p "$bin.tmp"
# The version the binaries report (/version, kube-proxy --version), as a
# release build sets it; without it the API server says v0.0.0-master and
# `helm install` refuses a chart with a kubeVersion constraint.
v=$(grep -oE 'k8s.io/kubernetes v[0-9.]+' "$here/go.mod" | cut -d' ' -f2)
minor=$(echo "$v" | cut -d. -f2)
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
"$repo/deploy/quiet.sh" k8s-tools "building the control plane, kubelet and kube-proxy (k8s $v; ~6 min cold)" -- \
  env -C "$here" CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags="$ldflags" -o "$bin.tmp/" $(for t in $tools; do echo "./$t"; done) >&2
rm -rf "$bin"; mv "$bin.tmp" "$bin"
echo "$bin"
