#!/usr/bin/env bash
# Builds the genuine kube-proxy of another Kubernetes release (VERSION, e.g.
# v1.33.7) from that release's own k8s.io/kubernetes module, for the fixtures
# captured per version (issue #56), and caches it under $PROXYAUDIT_CACHE like
# build.sh's tools. The module is made here from the release's go.mod: every
# staging module it replaces with ./staging is pinned to that release's v0.X.Y.
# Prints the binary's path on stdout.
set -euo pipefail
v=${1:?usage: kube-proxy-at.sh vX.Y.Z}
case $v in v1.*.*) ;; *) echo "kube-proxy-at.sh: $v: want vX.Y.Z" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
out="$cache/kube-proxy-$v"
if [ -x "$out/kube-proxy" ]; then echo "$out/kube-proxy"; exit 0; fi
staging="v0.${v#v1.}"
mod=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$v" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -f "$mod" ] || { echo "kube-proxy-at.sh: the module proxy has no k8s.io/kubernetes $v" >&2; exit 1; }
src="$out/src"
rm -rf "$src"; mkdir -p "$src"
{
  printf 'module proxyaudit.local/kube-proxy-%s\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$v" "$(awk '/^go /{print $2; exit}' "$mod")" "$v"
  grep -oE '^[[:space:]]*k8s.io/[a-z0-9.-]+ => \./staging' "$mod" | awk -v s="$staging" '{print "\t" $1 " => " $1 " " s}'
  printf ')\n'
} > "$src/go.mod"
cp "$here/kube-proxy/main.go" "$src/main.go"
minor=$(echo "$v" | cut -d. -f2)
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
"$repo/deploy/quiet.sh" "kube-proxy-$v" "building kube-proxy $v from its module (~3 min cold)" -- \
  env -C "$src" CGO_ENABLED=0 GOFLAGS=-mod=mod sh -c "go mod tidy && go build -trimpath -ldflags='$ldflags' -o '$out/kube-proxy.tmp' ." >&2
mv "$out/kube-proxy.tmp" "$out/kube-proxy"
echo "$out/kube-proxy"
