#!/usr/bin/env bash
# Installs the Debian packages proxyaudit's local cluster and tests need.
# (ipset, qemu-system-x86, busybox-static, kmod and cpio are for the IPVS VM;
# containerd, runc and containernetworking-plugins for the real kubelet nodes;
# chromium for the status page's browser tests; gcc for go test -race.)
# Does nothing when they are present; needs root (apt-get) otherwise.
set -euo pipefail
need=()
for pair in ip:iproute2 iptables:iptables iptables-legacy:iptables nft:nftables ipvsadm:ipvsadm conntrack:conntrack ss:iproute2 /usr/bin/time:time ipset:ipset qemu-system-x86_64:qemu-system-x86 busybox:busybox-static depmod:kmod cpio:cpio containerd:containerd ctr:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins chromium:chromium gcc:gcc; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  PATH=$PATH:/usr/sbin:/sbin command -v "$cmd" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
if [ "$(id -u)" -ne 0 ]; then
  echo "missing packages: ${need[*]} (install them as root: apt-get install ${need[*]})" >&2
  exit 0
fi
echo "installing Debian packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
