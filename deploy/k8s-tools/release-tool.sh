#!/usr/bin/env bash
# Builds one of the release's pinned tools from its Go module and caches it
# under $PROXYAUDIT_CACHE (default: <repo>/.cache), as helm.sh does helm.
# Prints the binary's path.
#   registry         the OCI registry (distribution/distribution, what Docker
#                    Hub's and GitHub's registries are built on): the release test
#                    pushes to it
#   krew             kubectl's plugin manager (installed as kubectl-krew): the
#                    release test installs the krew manifest with it
#   cyclonedx-gomod  CycloneDX SBOMs from the build information of Go binaries
#   cosign           sigstore's signer (~5 min of two cores cold: make test builds it
#                    beside its end-to-end stage)
set -euo pipefail
tool=${1:?usage: release-tool.sh registry|krew|cyclonedx-gomod|cosign}
case $tool in
  registry)        pkg=github.com/distribution/distribution/v3/cmd/registry@v3.1.2; bin=registry ;;
  krew)            pkg=sigs.k8s.io/krew/cmd/krew@v0.4.3; bin=kubectl-krew
                   ldflags="-X sigs.k8s.io/krew/internal/version.gitTag=v0.4.3" ;;
  cyclonedx-gomod) pkg=github.com/CycloneDX/cyclonedx-gomod/cmd/cyclonedx-gomod@v1.10.0; bin=cyclonedx-gomod ;;
  cosign)          pkg=github.com/sigstore/cosign/v3/cmd/cosign@v3.1.3; bin=cosign ;;
  *) echo "release-tool.sh: unknown tool $tool" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
key=$(echo "$pkg ${ldflags:-}" | cat - "$0" | sha256sum | cut -c1-12)
dir="$cache/$tool-$key"
if [ -x "$dir/$bin" ]; then
  echo "$dir/$bin"; exit 0
fi
# Two builds at once (make test's side job and a test) each write a directory
# of their own; the first to finish is renamed into place, the other dropped.
mkdir -p "$cache"
tmp=$(mktemp -d "$dir.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$repo/deploy/quiet.sh" "$tool" "building $tool (${pkg#*@}) from the Go module proxy" -- \
  env CGO_ENABLED=0 GOBIN="$tmp" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w ${ldflags:-}" "$pkg" >&2
built=$(basename "${pkg%@*}")
[ "$built" = "$bin" ] || mv "$tmp/$built" "$tmp/$bin"
mv -T "$tmp" "$dir" 2>/dev/null || [ -x "$dir/$bin" ]
echo "$dir/$bin"
