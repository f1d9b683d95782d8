#!/usr/bin/env bash
# Runs a command in cluster lane N (1 or more): a network namespace and a
# mount namespace of its own, so its local clusters (API server ports, host
# links and addresses, the nodes' network namespaces in /run/netns, the
# cluster lock in /run/lock) cannot meet those of lane 0, the machine's own
# namespaces, where `go test` runs by default. make test runs the real-node
# suite in lane 0 and the other cluster suites in lanes 1 and 2, side by
# side: each lane's clusters still take one at a time (its own lock), but
# the lanes overlap, which the suites' idle waits on grace periods leave
# room for.
#
# What the lanes still share, and why that is safe: processes (the harness
# marks each with its owner's PID, and cleans up only those whose owner is
# gone: another lane's owner is alive), /tmp (lane N's TMPDIR is a
# directory of its own), cgroups and the host's IPv4 forwarding (only real
# kubelet nodes use them, and those run only in lane 0: PROXYAUDIT_LANE
# tells the harness), the Go build cache and .cache/ (read-only once make
# cluster-binaries has built it: a lane has no network, so nothing may be
# downloaded or built in it that was not built before).
#
# Usage: deploy/lane.sh N command [args...]   (root)
set -euo pipefail
lane=${1:?usage: deploy/lane.sh N command [args...]}
shift
case $lane in
  ''|*[!0-9]*|0) echo "deploy/lane.sh: lane must be a number from 1 (lane 0 is the machine's own namespaces)" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "deploy/lane.sh: needs root (unshare --net --mount)" >&2; exit 1; }
tmp=${TMPDIR:-/tmp}/proxyaudit-lane$lane
mkdir -p "$tmp"
export PROXYAUDIT_LANE=$lane TMPDIR=$tmp
exec unshare --net --mount --propagation private -- bash -euo pipefail -c '
  mkdir -p /run/netns /run/lock
  mount -t tmpfs -o mode=755 "proxyaudit-lane$PROXYAUDIT_LANE" /run/netns
  mount --make-shared /run/netns
  mount -t tmpfs -o mode=1777 "proxyaudit-lane$PROXYAUDIT_LANE" /run/lock
  ip link set lo up
  exec "$@"' lane "$@"
