#!/usr/bin/env bash
# Builds (or reuses) what the IPVS virtual machine boots: a Debian kernel
# (its modules include ip_vs, which the host kernel lacks) and an initramfs
# of busybox-static plus the modules the guest loads. The guest's userland
# is the host's own filesystem over 9p (see deploy/vm/init), so iptables,
# ipset, ipvsadm and the binaries this repository builds run unchanged.
# Cached under $PROXYAUDIT_CACHE (default: <repo>/.cache). Prints the
# directory holding vmlinuz and initramfs.gz. Needs Debian's
# qemu-system-x86, busybox-static and ipset (deploy/install-deps.sh) and
# apt-get download access to the Debian archive. Cold: ~1 min.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${PROXYAUDIT_CACHE:-$repo/.cache}
# The kernel package the linux-image-amd64 metapackage points at today;
# PROXYAUDIT_VM_KERNEL pins another (e.g. linux-image-6.1.0-56-amd64).
pkg=${PROXYAUDIT_VM_KERNEL:-$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')}
if [ -z "$pkg" ]; then
  echo "cannot find the Debian kernel package: apt-cache depends linux-image-amd64 named none (run apt-get update, or set PROXYAUDIT_VM_KERNEL)" >&2
  exit 1
fi
key=$( (cat "$0" "$here/init"; echo "$pkg") | sha256sum | cut -c1-12)
out="$cache/vm-$key"
if [ -f "$out/vmlinuz" ] && [ -f "$out/initramfs.gz" ]; then
  echo "$out"; exit 0
fi
for tool in busybox qemu-system-x86_64 depmod cpio; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin:/sbin command -v "$tool" >/dev/null || {
    echo "missing $tool: run deploy/install-deps.sh as root (Debian packages busybox-static, qemu-system-x86, kmod, cpio)" >&2; exit 1; }
done
echo "building the IPVS VM image from $pkg (~1 min)" >&2
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/vm-build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download "$pkg" >&2)
dpkg -x "$tmp"/"$pkg"_*.deb "$tmp/kernel"
kver=${pkg#linux-image-}
mods="$tmp/kernel/lib/modules/$kver"
[ -d "$mods" ] || { echo "no modules for $kver in $pkg" >&2; exit 1; }

root="$tmp/initramfs"
mkdir -p "$root"/{bin,sbin,proc,sys,dev,host,tmp,lib/modules/"$kver"/kernel}
cp "$(command -v busybox)" "$root/bin/busybox"
for a in sh mount umount mkdir modprobe insmod ip sleep cat echo chroot poweroff ls reboot; do
  ln -s busybox "$root/bin/$a"
done
k="$mods/kernel"
dst="$root/lib/modules/$kver/kernel"
for d in net lib crypto arch fs/9p fs/netfs fs/fscache fs/overlayfs drivers/virtio; do
  [ -d "$k/$d" ] && mkdir -p "$dst/$d" && cp -a "$k/$d/." "$dst/$d/"
done
mkdir -p "$dst/drivers/net"
for m in virtio_net net_failover dummy; do
  cp "$k/drivers/net/$m.ko" "$dst/drivers/net/"
done
cp "$mods"/modules.order "$mods"/modules.builtin* "$root/lib/modules/$kver/" 2>/dev/null || true
PATH=$PATH:/usr/sbin:/sbin depmod -b "$root" "$kver"
cp "$here/init" "$root/init"
chmod +x "$root/init"
mkdir -p "$out.tmp"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 >"$out.tmp/initramfs.gz")
cp "$tmp/kernel/boot/vmlinuz-$kver" "$out.tmp/vmlinuz"
echo "$kver" >"$out.tmp/kernel-version"
rm -rf "$out"; mv "$out.tmp" "$out"
# Images built from an older build.sh, init or kernel are not used again.
find "$cache" -maxdepth 1 -name 'vm-*' ! -name "vm-$key" -exec rm -rf {} +
echo "$out"
