#!/usr/bin/env bash
# Installs the Debian packages proxyaudit's local cluster and tests need.
# (ipset, qemu-system-x86, busybox-static, kmod and cpio are for the IPVS VM;
# containerd, runc and containernetworking-plugins for the real kubelet nodes;
# chromium for the status page's browser tests; gcc for go test -race;
# bash-completion for the CLI's completion test in a real bash.)
# Does nothing when they are present; needs root (apt-get) otherwise.
# `install-deps.sh demo`: only what `make demo` runs (no VM, browser or gcc).
# `install-deps.sh cilium`: clang-19 and llvm-19, with which the genuine
# Cilium agent compiles its datapath (make e2e-cilium, deploy/cilium).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
demo="ip:iproute2 iptables:iptables iptables-legacy:iptables nft:nftables conntrack:conntrack ss:iproute2 containerd:containerd ctr:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins"
all="$demo ipvsadm:ipvsadm /usr/bin/time:time ipset:ipset qemu-system-x86_64:qemu-system-x86 busybox:busybox-static depmod:kmod cpio:cpio chromium:chromium gcc:gcc /usr/share/bash-completion/bash_completion:bash-completion"
case ${1:-} in
  demo) want=$demo ;;
  cilium) want="clang-19:clang-19 llc-19:llvm-19" ;;
  "") want=$all ;;
  *) echo "usage: $0 [demo|cilium]" >&2; exit 2 ;;
esac
need=()
for pair in $want; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  case $cmd in
    /*) [ -e "$cmd" ] || need+=("$pkg") ;; # a file of the package
    *) PATH=$PATH:/usr/sbin:/sbin command -v "$cmd" >/dev/null 2>&1 || need+=("$pkg") ;;
  esac
done
[ ${#need[@]} -eq 0 ] && exit 0
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
if [ "$(id -u)" -ne 0 ]; then
  echo "missing packages: ${need[*]} (install them as root: apt-get install ${need[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
"$here/quiet.sh" apt "installing Debian packages: ${need[*]}" -- \
  sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"' apt "${need[@]}"
