#!/usr/bin/env bash
# Builds a genuine component of another Kubernetes release (VERSION, e.g.
# v1.33.7; TOOL kube-proxy, the default, or kube-apiserver) from that
# release's own k8s.io/kubernetes module, for the fixtures captured per
# version and the chart installed on the oldest supported API server (issue
# #56), and caches it under $PROXYAUDIT_CACHE like build.sh's tools. The
# module is made here from the release's go.mod: every staging module it
# replaces with ./staging is pinned to that release's v0.X.Y. Prints the
# binary's path on stdout.
set -euo pipefail
v=${1:?usage: tool-at.sh vX.Y.Z [kube-proxy|kube-apiserver]}
tool=${2:-kube-proxy}
case $v in v1.*.*) ;; *) echo "tool-at.sh: $v: want vX.Y.Z" >&2; exit 2 ;; esac
case $tool in kube-proxy|kube-apiserver) ;; *) echo "tool-at.sh: $tool: want kube-proxy or kube-apiserver" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
out="$cache/$tool-$v"
if [ -x "$out/$tool" ]; then echo "$out/$tool"; exit 0; fi
staging="v0.${v#v1.}"
mod=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$v" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -f "$mod" ] || { echo "tool-at.sh: the module proxy has no k8s.io/kubernetes $v" >&2; exit 1; }
src="$out/src"
rm -rf "$src"; mkdir -p "$src"
{
  printf 'module proxyaudit.local/%s-%s\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$tool" "$v" "$(awk '/^go /{print $2; exit}' "$mod")" "$v"
  grep -oE '^[[:space:]]*k8s.io/[a-z0-9.-]+ => \./staging' "$mod" | awk -v s="$staging" '{print "\t" $1 " => " $1 " " s}'
  printf ')\n'
} > "$src/go.mod"
cp "$here/$tool/main.go" "$src/main.go"
minor=$(echo "$v" | cut -d. -f2)
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
"$repo/deploy/quiet.sh" "$tool-$v" "building $tool $v from its module (~3 min cold)" -- \
  env -C "$src" CGO_ENABLED=0 GOFLAGS=-mod=mod sh -c "go mod tidy && go build -trimpath -ldflags='$ldflags' -o '$out/$tool.tmp' ." >&2
mv "$out/$tool.tmp" "$out/$tool"
echo "$out/$tool"
