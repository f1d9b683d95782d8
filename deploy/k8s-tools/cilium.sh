#!/usr/bin/env bash
# Builds the genuine Cilium agent (cilium-agent, cilium-dbg) from its Go
# module (no release images or downloads here, only the Go module proxy)
# and caches them under $PROXYAUDIT_CACHE (default: <repo>/.cache) with the
# module's bpf/ C sources, which the agent compiles with clang at start
# (clang-19 and llc-19 from Debian; bookworm's default clang 14 is too old).
# Prints the directory: bin/cilium-agent, bin/cilium-dbg, lib/bpf/, and
# crds/ (the CustomResourceDefinitions its operator would install).
#
# Why v1.20.2 and not v1.18.4: v1.18.4's go.mod replaces k8s.io/apimachinery
# and gobgp/v3 with Cilium's own forks, which the module proxy does not
# serve (403); v1.20.2 replaces only controller-tools (a tool, not built
# here) and names a gobgp/v4 pseudo-version the proxy does not serve either,
# so the build takes v4.7.0, the release that followed it.
set -euo pipefail
CILIUM_VERSION=v1.20.2
GOBGP=github.com/osrg/gobgp/v4@v4.7.0
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(sha256sum "$0" | cut -c1-12)
out="$cache/cilium-$CILIUM_VERSION-$key"
if [ -x "$out/bin/cilium-agent" ]; then
  echo "$out"; exit 0
fi
src=$(GOFLAGS=-mod=mod go mod download -json "github.com/cilium/cilium@$CILIUM_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
cp -r "$src" "$work/cilium"; chmod -R u+w "$work/cilium"
(cd "$work/cilium" && go mod edit -require="$GOBGP" -dropreplace=sigs.k8s.io/controller-tools)
rm -rf "$out.tmp"; mkdir -p "$out.tmp/bin" "$out.tmp/lib"
"$repo/deploy/quiet.sh" cilium "building cilium-agent $CILIUM_VERSION from the Go module proxy (~6 min cold)" -- \
  env -C "$work/cilium" CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$out.tmp/bin/" ./daemon ./cilium-dbg >&2
mv "$out.tmp/bin/daemon" "$out.tmp/bin/cilium-agent"
cp -r "$work/cilium/bpf" "$out.tmp/lib/bpf"
cp -r "$work/cilium/pkg/k8s/apis/cilium.io/client/crds" "$out.tmp/crds"
rm -rf "$out"; mv "$out.tmp" "$out"
echo "$out"
