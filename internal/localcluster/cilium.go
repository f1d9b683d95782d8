package localcluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/cilium"
)

// ModeCilium runs the genuine Cilium agent (deploy/k8s-tools/cilium.sh)
// with kube-proxy replacement on a namespace-only node instead of
// kube-proxy: its own BPF filesystem, state and library directories. Its
// socket load balancing is off (--bpf-lb-sock=false): its programs would
// attach to the cgroup v2 root, which every process of the machine is
// in, and translate their connections with this node's services. (Given
// a cgroup below the root instead, the agent mounts cgroup2 there: the
// whole hierarchy again, under a pa- name the cleanup would kill every
// process of.) Its service maps are the same either way. It needs
// Debian's clang-19 and llc-19, with which it compiles its datapath at
// start.
const ModeCilium Mode = "cilium"

// ciliumNode is what a Cilium node keeps beside the Node.
type ciliumNode struct {
	dir    string // the agent's build (bin/, lib/bpf, crds/)
	work   string // bpffs/, state/, lib/, path/
	cgroup string // the cgroup v2 hierarchy's mount point (the agent checks it)
}

// BPFFS is the node's BPF filesystem, where its Cilium agent pins its maps
// ("" on other nodes).
func (n *Node) BPFFS() string {
	if n.cilium == nil {
		return ""
	}
	return filepath.Join(n.cilium.work, "bpffs")
}

// EnsureCilium builds the genuine Cilium agent (or reuses the cached
// build) and checks the compiler it needs; it returns the build's
// directory.
func EnsureCilium(ctx context.Context) (string, error) {
	for _, t := range []string{"clang-19", "llc-19"} {
		if _, err := exec.LookPath(t); err != nil {
			return "", fmt.Errorf("%s is not installed: Cilium's agent compiles its datapath at start (deploy/install-deps.sh cilium installs Debian's clang-19 and llvm-19)", t)
		}
	}
	return ensureTool(ctx, "cilium.sh")
}

func (c *Cluster) addCiliumNode(ctx context.Context, spec NodeSpec) (*Node, error) {
	dir, err := EnsureCilium(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.applyCiliumCRDs(ctx, dir); err != nil {
		return nil, err
	}
	n, err := c.newNodeNet(ctx, spec.Name, spec.Mode, spec.Zone)
	if err != nil {
		return nil, err
	}
	n.proxyReady = spec.ProxyReady
	n.cilium = &ciliumNode{dir: dir, work: filepath.Join(c.Dir, "cilium-"+n.Name)}
	if err := c.registerNode(ctx, n); err != nil {
		return nil, err
	}
	if err := c.ciliumPodCIDR(ctx, n, fmt.Sprintf("198.18.%d.0/24", 128+n.Index)); err != nil {
		return nil, err
	}
	w := n.cilium.work
	for _, d := range []string{"bpffs", "state", "lib", "path"} {
		if err := os.MkdirAll(filepath.Join(w, d), 0o755); err != nil {
			return nil, err
		}
	}
	// The agent reaches the API server from the node's namespace, as
	// kube-proxy does; as admin (Cilium's ClusterRole is not applied).
	if err := writeKubeconfig(filepath.Join(w, "kubeconfig"), "https://"+c.APIServer(), c.pki.CACert, c.adminToken, ""); err != nil {
		return nil, err
	}
	if err := unix.Mount("bpf", filepath.Join(w, "bpffs"), "bpf", 0, ""); err != nil {
		return nil, fmt.Errorf("node %s: mount a BPF filesystem: %w", n.Name, err)
	}
	clang, _ := exec.LookPath("clang-19")
	llc, _ := exec.LookPath("llc-19")
	for link, target := range map[string]string{"lib/bpf": filepath.Join(dir, "lib", "bpf"), "path/clang": clang, "path/llc": llc} {
		if err := os.Symlink(target, filepath.Join(w, link)); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, err
		}
	}
	hier, err := cgroup2Hierarchy()
	if err != nil {
		return nil, err
	}
	n.cilium.cgroup = hier
	if err := n.StartProxy(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// applyCiliumCRDs applies Cilium's CRDs once per cluster, as its operator
// would (no operator runs: identities are CRDs the agents make).
func (c *Cluster) applyCiliumCRDs(ctx context.Context, dir string) error {
	c.cpOnce.Lock()
	defer c.cpOnce.Unlock()
	if c.ciliumCRDs {
		return nil
	}
	for _, v := range []string{"v2", "v2alpha1"} {
		if _, err := run(ctx, c.Kubectl(), "--kubeconfig", c.AdminKubeconfig, "apply", "--server-side", "-f", filepath.Join(dir, "crds", v)); err != nil {
			return fmt.Errorf("apply Cilium's CRDs: %w", err)
		}
	}
	c.ciliumCRDs = true
	return nil
}

// cgroup2Hierarchy is where the cgroup v2 hierarchy is mounted (the
// whole of it, or the unified one beside v1's).
func cgroup2Hierarchy() (string, error) {
	for _, hier := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		var st unix.Statfs_t
		if unix.Statfs(hier, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			return hier, nil
		}
	}
	return "", errors.New("no cgroup v2 hierarchy mounted: Cilium's agent wants one")
}

// ciliumAgentFlags are the agent's flags on every node here: kube-proxy
// replacement, native routing over the node's eth0, Kubernetes IPAM, the
// BPF filesystem and cgroup root given, and what needs more than a node
// (health checks, Hubble, the L7 proxy, masquerading, owning CNI) off.
func ciliumAgentFlags(bpfRoot, cgroupRoot string, socketLB bool) []string {
	return []string{
		"--kube-proxy-replacement=true", "--routing-mode=native", "--ipv4-native-routing-cidr=" + PodCIDR,
		"--ipam=kubernetes", "--enable-ipv6=false", "--devices=eth0",
		"--bpf-root=" + bpfRoot, "--cgroup-root=" + cgroupRoot, "--bpf-lb-sock=" + strconv.FormatBool(socketLB),
		"--enable-health-checking=false", "--enable-endpoint-health-checking=false", "--identity-allocation-mode=crd",
		"--enable-l7-proxy=false", "--enable-hubble=false", "--enable-ipv4-masquerade=false", "--cni-exclusive=false",
	}
}

// startAgent starts the node's Cilium agent without waiting for its maps.
func (n *Node) startAgent() (*process, error) {
	cn, w := n.cilium, n.cilium.work
	// nsenter, not ip netns exec: that remounts /sys and would hide the
	// BPF filesystem and the cgroup from the agent.
	argv := []string{"nsenter", "--net=/run/netns/" + n.NetNS, "env", "K8S_NODE_NAME=" + n.Name, "PATH=" + filepath.Join(w, "path") + ":" + os.Getenv("PATH"),
		filepath.Join(cn.dir, "bin", "cilium-agent"),
		"--k8s-kubeconfig-path=" + filepath.Join(w, "kubeconfig"),
		"--state-dir=" + filepath.Join(w, "state"), "--lib-dir=" + filepath.Join(w, "lib"), "--socket-path=" + filepath.Join(w, "state", "cilium.sock"),
	}
	// Socket load balancing off: this agent runs on the host's cgroup
	// root, and its socket programs would translate the whole machine's
	// connections.
	argv = append(argv, ciliumAgentFlags(filepath.Join(w, "bpffs"), cn.cgroup, false)...)
	return startProcess("cilium-agent["+n.Name+"]", n.ProxyLog(), argv)
}

// ciliumRules is the node's Cilium maps as a JSON list of maps (what
// `proxyaudit diff` takes, deploy/cilium/dump prints).
func (n *Node) ciliumRules() (string, error) {
	dumps, err := cilium.Read(n.BPFFS())
	if err != nil {
		return "", err
	}
	for i := range dumps {
		dumps[i] = dumps[i].WithEntries()
	}
	b, err := json.Marshal(dumps)
	return string(b), err
}

// ciliumRoutesTo reports whether the node's Cilium maps (rules as
// ciliumRules returns them) send a frontend to ipPort.
func ciliumRoutesTo(rules, ipPort string) bool {
	want, err := netip.ParseAddrPort(ipPort)
	if err != nil {
		return false
	}
	obs, err := cilium.ParseMaps(strings.NewReader(rules))
	if err != nil {
		return false
	}
	for _, f := range obs.Frontends {
		for _, e := range f.Endpoints {
			if e.Addr == want && e.Weight != 0 {
				return true
			}
		}
	}
	return false
}

// FreezeProxy stops the node's kube-proxy or Cilium agent with SIGSTOP,
// as a hung process: alive, its rules kept, following nothing.
// ThawProxy lets it go on.
func (n *Node) FreezeProxy() error { return n.signalProxy(syscall.SIGSTOP) }

// ThawProxy resumes a frozen kube-proxy or agent (SIGCONT).
func (n *Node) ThawProxy() error { return n.signalProxy(syscall.SIGCONT) }

func (n *Node) signalProxy(sig syscall.Signal) error {
	pid := n.ProxyPID()
	if pid == 0 {
		return fmt.Errorf("no kube-proxy or agent runs on %s", n.Name)
	}
	return syscall.Kill(pid, sig)
}

// agentAnswers says whether the node's Cilium agent serves its API (its
// socket accepts connections: a dead agent's socket file refuses them).
func (n *Node) agentAnswers() bool {
	conn, err := net.DialTimeout("unix", filepath.Join(n.cilium.work, "state", "cilium.sock"), time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// ciliumReady is how long a new agent may take to compile and attach its
// datapath and program default/kubernetes: ~10 s here, minutes on a busy
// machine's first compile.
const ciliumReady = 3 * time.Minute
