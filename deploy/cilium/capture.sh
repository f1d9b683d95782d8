#!/usr/bin/env bash
# capture.sh DIR — golden captures of the genuine Cilium agent's LB maps.
# capture.sh --dual-stack DIR — the same in a dual-stack cluster
# (deploy/cilium/dualstack.yaml) into DIR/dualstack, without the frozen
# phase: Cilium's IPv6 maps.
#
# Brings up, on this machine alone: etcd and kube-apiserver (the project's
# own builds) in network namespace pa-cilapi (198.18.90.1), and the genuine
# cilium-agent (deploy/k8s-tools/cilium.sh) with kube-proxy replacement in
# namespace pa-cilx (198.18.90.2) as node "cilx", its own BPF filesystem,
# state and library directories under a temporary directory. Applies
# deploy/cilium/scenario.yaml, waits until the agent has programmed every
# service, and writes to DIR/scenario: maps.json (the raw map entries,
# deploy/cilium/dump), lb-list.txt, lb-list.json, lb-backends.json and
# service-list.txt
# (cilium-dbg's own reading, the oracle the tests compare with),
# cluster.json (the API's services, slices and nodes, as `proxyaudit
# audit` takes them), scenario.yaml. Then freezes the agent (SIGSTOP, the
# hung agent of cilium#48050), changes the cluster under it (an endpoint
# leaves web, one joins dns, service late appears) and writes the same
# but service-list.txt (the frozen agent answers no API) to DIR/frozen:
# a node whose maps drifted, by the genuine agent's hand. Tears
# everything down on exit. Root; clang-19 and llc-19 (Debian).
set -euo pipefail
dual=""
if [ "${1:-}" = "--dual-stack" ]; then dual=1; shift; fi
dir=${1:?usage: capture.sh [--dual-stack] DIR}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
k8s=$("$repo/deploy/k8s-tools/build.sh")
cil=$("$repo/deploy/k8s-tools/cilium.sh")
for t in clang-19 llc-19; do command -v $t >/dev/null || { echo "capture.sh: $t missing (apt-get install clang-19 llvm-19)" >&2; exit 1; }; done
work=$(mktemp -d /tmp/pa-cilium.XXXXXX)
api=pa-cilapi node=pa-cilx
cleanup() {
  set +e
  [ -n "${agent:-}" ] && kill -CONT "$agent" 2>/dev/null && kill "$agent" 2>/dev/null && wait "$agent" 2>/dev/null
  [ -n "${apiserver:-}" ] && kill "$apiserver" 2>/dev/null && wait "$apiserver" 2>/dev/null
  [ -n "${etcd:-}" ] && kill "$etcd" 2>/dev/null && wait "$etcd" 2>/dev/null
  umount "$work/bpffs" 2>/dev/null
  ip netns del $node 2>/dev/null; ip netns del $api 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
ip netns del $node 2>/dev/null || true; ip netns del $api 2>/dev/null || true
ip netns add $api; ip netns add $node
ip link add pa-cil0 netns $api type veth peer name pa-cil1 netns $node
ip -n $api link set pa-cil0 name eth0; ip -n $node link set pa-cil1 name eth0
ip -n $api addr add 198.18.90.1/24 dev eth0; ip -n $node addr add 198.18.90.2/24 dev eth0
for ns in $api $node; do ip -n $ns link set eth0 up; ip -n $ns link set lo up; done
ip -n $node route add default via 198.18.90.1
svcrange=198.19.0.0/16 podcidrs='"198.18.128.0/24"' addrs='{"type":"InternalIP","address":"198.18.90.2"}' v6flags=(--enable-ipv6=false)
if [ -n "$dual" ]; then
  ip -n $api addr add 2001:2:0:90::1/64 dev eth0 nodad; ip -n $node addr add 2001:2:0:90::2/64 dev eth0 nodad
  ip -n $node -6 route add default via 2001:2:0:90::1
  svcrange=198.19.0.0/16,2001:2:0:ffff::/112 podcidrs='"198.18.128.0/24","2001:2:0:8000::/64"'
  addrs='{"type":"InternalIP","address":"198.18.90.2"},{"type":"InternalIP","address":"2001:2:0:90::2"}'
  v6flags=(--enable-ipv6=true --ipv6-native-routing-cidr=2001:2:0:8000::/56)
fi
openssl genrsa -out "$work/sa.key" 2048 2>/dev/null; openssl rsa -in "$work/sa.key" -pubout -out "$work/sa.pub" 2>/dev/null
echo 'admintoken,admin,admin,system:masters' > "$work/tokens.csv"
nsenter --net=/run/netns/$api "$k8s/etcd" --data-dir="$work/etcd" --listen-client-urls=http://127.0.0.1:2379 \
  --advertise-client-urls=http://127.0.0.1:2379 --listen-peer-urls=http://127.0.0.1:2380 >"$work/etcd.log" 2>&1 & etcd=$!
nsenter --net=/run/netns/$api "$k8s/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 --bind-address=198.18.90.1 \
  --advertise-address=198.18.90.1 --secure-port=6443 --cert-dir="$work/certs" --service-account-issuer=https://kubernetes.default.svc \
  --service-account-key-file="$work/sa.pub" --service-account-signing-key-file="$work/sa.key" --token-auth-file="$work/tokens.csv" \
  --authorization-mode=RBAC --service-cluster-ip-range=$svcrange --service-node-port-range=30000-32767 >"$work/apiserver.log" 2>&1 & apiserver=$!
cat >"$work/kubeconfig" <<EOK
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://198.18.90.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: admintoken}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
EOK
kc() { nsenter --net=/run/netns/$node "$k8s/kubectl" --kubeconfig "$work/kubeconfig" "$@"; }
for i in $(seq 120); do kc get --raw /readyz >/dev/null 2>&1 && break; sleep 0.5; done
kc get --raw /readyz >/dev/null
kc apply -f - >/dev/null <<EOY
apiVersion: v1
kind: Node
metadata: {name: cilx, labels: {kubernetes.io/hostname: cilx, topology.kubernetes.io/zone: a}}
spec: {podCIDR: 198.18.128.0/24, podCIDRs: [$podcidrs]}
EOY
kc patch node cilx --subresource=status --type=merge -p '{"status":{"addresses":['"$addrs"']}}' >/dev/null
kc apply -f "$cil/crds/v2" >/dev/null
kc apply -f "$cil/crds/v2alpha1" >/dev/null
mkdir -p "$work/bpffs" "$work/state" "$work/lib" "$work/path"
mount -t bpf bpf "$work/bpffs"
# cilium-dbg bpf reads the first BPF filesystem mounted: ours must be the
# only one.
if mount -t bpf | grep -v " $work/bpffs " | grep -q .; then
  echo "capture.sh: another BPF filesystem is mounted (cilium-dbg would read it): $(mount -t bpf | grep -v " $work/bpffs ")" >&2; exit 1
fi
# The agent wants the cgroup v2 hierarchy's mount point (given a cgroup
# below it, it mounts cgroup2 there: the whole hierarchy again). Its socket
# load balancing is off: on the root cgroup it would translate every
# process's connections on this machine; the service maps are the same.
cgroup=/sys/fs/cgroup
[ "$(stat -fc %T $cgroup)" = cgroup2fs ] || cgroup=/sys/fs/cgroup/unified
[ "$(stat -fc %T $cgroup 2>/dev/null)" = cgroup2fs ] || { echo "capture.sh: no cgroup v2 hierarchy mounted" >&2; exit 1; }
ln -s "$cil/lib/bpf" "$work/lib/bpf"
ln -s "$(command -v clang-19)" "$work/path/clang"; ln -s "$(command -v llc-19)" "$work/path/llc"
nsenter --net=/run/netns/$node env K8S_NODE_NAME=cilx PATH="$work/path:$PATH" "$cil/bin/cilium-agent" \
  --k8s-kubeconfig-path="$work/kubeconfig" --kube-proxy-replacement=true --routing-mode=native --ipv4-native-routing-cidr=198.18.128.0/17 \
  --ipam=kubernetes "${v6flags[@]}" --devices=eth0 --bpf-root="$work/bpffs" --cgroup-root="$cgroup" --bpf-lb-sock=false \
  --state-dir="$work/state" --lib-dir="$work/lib" --socket-path="$work/state/cilium.sock" \
  --enable-health-checking=false --enable-endpoint-health-checking=false --identity-allocation-mode=crd \
  --enable-l7-proxy=false --enable-hubble=false --enable-ipv4-masquerade=false --cni-exclusive=false >"$work/agent.log" 2>&1 & agent=$!
dbg() { "$cil/bin/cilium-dbg" -H "unix://$work/state/cilium.sock" "$@"; }
for i in $(seq 180); do dbg status --brief >/dev/null 2>&1 && break; sleep 1; done
dbg status --brief || { tail -50 "$work/agent.log" >&2; exit 1; }
if [ -n "$dual" ]; then
  kc apply -f "$here/dualstack.yaml" >/dev/null
  want='2001:2:0:90::2\]:30443'
else
  kc apply -f "$here/scenario.yaml" >/dev/null
  kc patch service shop --subresource=status --type=merge -p '{"status":{"loadBalancer":{"ingress":[{"ip":"198.18.201.1"}]}}}' >/dev/null
  want='198.18.201.1:8443'
fi
# Programmed: every frontend of the scenario in the agent's service list.
for i in $(seq 60); do dbg service list 2>/dev/null | grep -q "$want" && break; sleep 1; done
sleep 3 # the agent's reconciler writes the maps after its tables
capture() { # capture OUT [service list too]
  local out=$1
  mkdir -p "$out"
  go run -C "$repo" ./deploy/cilium/dump -bpffs "$work/bpffs" >"$out/maps.json"
  dbg bpf lb list >"$out/lb-list.txt"
  dbg bpf lb list -o json >"$out/lb-list.json"
  dbg bpf lb list --backends -o json >"$out/lb-backends.json"
  [ "${2:-}" = "" ] || dbg service list >"$out/service-list.txt"
  kc get services,endpointslices,nodes -A -o json >"$out/cluster.json"
  grep -m1 "^CILIUM_VERSION=" "$repo/deploy/k8s-tools/cilium.sh" >"$out/version.txt"
  echo "captured $(grep -c '"key"' "$out/maps.json") map entries from cilium-agent into $out"
}
if [ -n "$dual" ]; then
  capture "$dir/dualstack" services
  cp "$here/dualstack.yaml" "$dir/dualstack/scenario.yaml"
  exit 0
fi
capture "$dir/scenario" services
cp "$here/scenario.yaml" "$dir/scenario/scenario.yaml"
# The hung agent: its maps stay as they are while the cluster moves on.
kill -STOP "$agent"
kc patch endpointslice web-1 --type=json -p '[{"op":"remove","path":"/endpoints/1"}]' >/dev/null
kc patch endpointslice dns-1 --type=json -p '[{"op":"add","path":"/endpoints/-","value":{"addresses":["198.18.128.21"],"conditions":{"ready":true},"nodeName":"cilx"}}]' >/dev/null
kc apply -f - >/dev/null <<EOY
apiVersion: v1
kind: Service
metadata: {name: late, namespace: default}
spec:
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: late-1, namespace: default, labels: {kubernetes.io/service-name: late}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [198.18.129.80], conditions: {ready: true}, nodeName: other}
EOY
sleep 3
capture "$dir/frozen"
