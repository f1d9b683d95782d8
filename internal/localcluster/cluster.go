// Package localcluster runs a real Kubernetes control plane (etcd and
// kube-apiserver built from the pinned k8s.io/kubernetes module) and real
// kube-proxy processes, one per network namespace, on this machine. It is the
// ground truth for proxyaudit's end-to-end tests and for `make demo`.
//
// Everything it creates carries the "pa-" prefix (network namespaces, links)
// or the PROXYAUDIT_LOCALCLUSTER environment marker (processes), so that a run
// after a crash removes what a previous run left and tests can assert that
// nothing is left. Only one test process runs clusters on a machine at a
// time: Start takes a machine-wide file lock and holds it until Stop. Inside
// that process a second control plane may run beside the first
// (Config.Instance), as a platform team's second cluster.
//
// Addresses: the API server is advertised on 198.18.0.1 (a host-only veth);
// node i gets a veth pair 198.18.0.(4i+1) (host) / 198.18.0.(4i+2) (node);
// services use 198.19.0.0/16 and pods 198.18.128.0/17. A second instance
// uses 198.18.2.0/24 the same way (its API server on 198.18.2.1:6444). All
// of it is in the 198.18.0.0/15 benchmarking range and no traffic leaves the
// machine.
package localcluster

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Fixed addresses and ports of the local cluster.
const (
	APIServerIP   = "198.18.0.1"
	APIServerPort = 6443
	ServiceCIDR   = "198.19.0.0/16"
	PodCIDR       = "198.18.128.0/17"
	// ServiceCIDR6 and PodCIDR6 are the IPv6 ranges of a dual-stack
	// cluster (Config.DualStack), in the benchmarking range 2001:2::/48.
	ServiceCIDR6 = "2001:2:0:ffff::/112"
	PodCIDR6     = "2001:2:0:8000::/56"
	// APIServerIP6 is the API server's advertised address in an IPv6-only
	// cluster (default/kubernetes' endpoint); clients still dial
	// APIServerIP.
	APIServerIP6 = "2001:2::1"
	// KubernetesServiceIP is the cluster IP of default/kubernetes, the first
	// address of ServiceCIDR.
	KubernetesServiceIP = "198.19.0.1"
	// VMHostIP is how a QEMU user-mode guest reaches the host (IPVS tests).
	VMHostIP = "198.18.64.2"

	etcdClientURL = "http://127.0.0.1:32379"
	etcdPeerURL   = "http://127.0.0.1:32380"
	apiLink       = "pa-api"
	namePrefix    = "pa-"
	lockPath      = "/run/lock/proxyaudit-localcluster.lock"
	maxNodes      = 60
)

// Mode is the proxy mode kube-proxy runs in on a node.
type Mode string

// Proxy modes the local cluster can run (IPVS needs a VM; see the ipvs tests).
const (
	ModeIPTables Mode = "iptables"
	ModeNFTables Mode = "nftables"
)

// NodeSpec describes a node to add.
type NodeSpec struct {
	Name string
	Mode Mode
	// Zone is the topology.kubernetes.io/zone label; empty means none.
	Zone string
	// LegacyIPTables makes kube-proxy (iptables mode) use the legacy
	// x_tables backend instead of nf_tables.
	LegacyIPTables bool
	// NoProxy registers the node and its network namespace without a
	// kube-proxy: the test writes the node's rules itself (synthetic
	// rules at scale, flushes and churn of its own).
	NoProxy bool
	// ProxyReady bounds how long kube-proxy may take to program
	// default/kubernetes (60 s): its first sync programs every service, and
	// at the anchors (10k services) that and reading the rules back to check
	// take minutes on this machine.
	ProxyReady time.Duration
}

// Config configures Start.
type Config struct {
	// BinDir holds kube-apiserver, kube-proxy, etcd and kubectl. Empty means
	// build or reuse the cached ones (EnsureBinaries).
	BinDir string
	// Logf receives progress lines; nil discards them.
	Logf func(format string, args ...any)
	// KeepWorkDir leaves logs and configs on disk after Stop.
	KeepWorkDir bool
	// KubeProxy is the kube-proxy binary the namespace nodes run; empty is
	// the pinned one in BinDir (PROXYAUDIT_KUBE_PROXY sets it for the
	// suites' shared cluster: another release's, deploy/k8s-tools/tool-at.sh).
	KubeProxy string
	// APIServer is the kube-apiserver binary; empty is the pinned one in
	// BinDir (another release's: deploy/k8s-tools/tool-at.sh, ToolAt).
	APIServer string
	// DualStack gives the API server an IPv6 service range beside the
	// IPv4 one, each namespace-only node an IPv6 address (2001:2:0:N::2)
	// beside its IPv4 one, and kube-proxy both cluster CIDRs.
	DualStack bool
	// IPv6Only gives the API server only the IPv6 service range (and
	// advertises APIServerIP6), the nodes an IPv6 address as their only
	// InternalIP and kube-proxy the IPv6 cluster CIDR: kube-proxy's
	// primary family is IPv6. The nodes keep their IPv4 link to reach the
	// API server.
	IPv6Only bool
	// Instance 1 starts a second control plane beside the one this
	// process already runs (instance 0, the default): its own etcd, API
	// server (SecondAPIServerIP:SecondAPIServerPort), host link and node
	// addresses (198.18.2.0/24) and namespaces (pa-c1-NAME), so node names
	// may repeat the first cluster's. It does not clean the machine at
	// Start and removes only what is its own at Stop (stop it before
	// instance 0, whose Stop removes everything). It runs namespace-only
	// nodes, IPv4 only.
	Instance int
}

// The second instance's API server (Config.Instance 1).
const (
	SecondAPIServerIP   = "198.18.2.1"
	SecondAPIServerPort = 6444
)

// instance holds what differs between control planes on one machine.
type instance struct {
	apiIP                string
	apiPort              int
	etcdClient, etcdPeer string
	link                 string // the host-only link holding apiIP
	prefix               string // of network namespaces and node links
	nodeNet              string // node i: NET.(4i+1) / NET.(4i+2)
}

var instances = []instance{
	{APIServerIP, APIServerPort, etcdClientURL, etcdPeerURL, apiLink, namePrefix, "198.18.0"},
	{SecondAPIServerIP, SecondAPIServerPort, "http://127.0.0.1:32389", "http://127.0.0.1:32390", "pa-api1", namePrefix + "c1-", "198.18.2"},
}

// Cluster is a running local control plane with its nodes.
type Cluster struct {
	// Client is an admin client for the API server.
	Client kubernetes.Interface
	// RESTConfig is the admin configuration behind Client.
	RESTConfig *rest.Config
	// Dir is the work directory (logs, kubeconfigs, certificates).
	Dir string
	// AdminKubeconfig is a kubeconfig file for the admin user.
	AdminKubeconfig string

	cfg             Config
	in              instance
	bin             string
	pki             pki
	adminToken      string
	proxyToken      string
	proxyKubeconfig string
	release         func()
	etcd, apiserver *process

	mu    sync.Mutex
	nodes map[string]*Node
	// registries every real node's containerd trusts (TrustRegistry).
	registries []trustedRegistry
	extra      []*process // StartProcess: stopped first

	// Real nodes (kubelet.go): built once, on the first.
	cpOnce      sync.Mutex
	controllers []*process
	images      []string
	ciliumCRDs  bool     // Cilium's CRDs applied (the first Cilium node)
	undo        []func() // host settings to restore at Stop
}

// Node is one simulated node: a network namespace running kube-proxy.
type Node struct {
	Name   string
	Mode   Mode
	Zone   string
	Index  int
	NetNS  string
	HostIP string // host end of the node's veth
	IP     string // the node's InternalIP
	// HostIP6 and IP6 are the IPv6 ends of the veth in a dual-stack
	// cluster; empty otherwise.
	HostIP6, IP6 string
	Legacy       bool
	// proxyReady: see NodeSpec.ProxyReady.
	proxyReady time.Duration

	c     *Cluster
	mu    sync.Mutex
	proxy *process
	real  *realNode // a kubelet node (AddKubeletNode); nil for a namespace-only one
	// cilium: the node runs Cilium's agent instead of kube-proxy
	// (ModeCilium); nil otherwise.
	cilium *ciliumNode
}

func (c *Cluster) logf(format string, args ...any) {
	if c.cfg.Logf != nil {
		c.cfg.Logf(format, args...)
	}
}

// Start brings up etcd and kube-apiserver. It waits for the machine-wide
// lock, removes anything a crashed run left behind, and returns once the API
// server is ready. On error everything started so far is torn down.
func Start(ctx context.Context, cfg Config) (c *Cluster, err error) {
	if err := CanRun(); err != nil {
		return nil, err
	}
	if err := checkLane(); err != nil {
		return nil, err
	}
	if cfg.Instance < 0 || cfg.Instance >= len(instances) {
		return nil, fmt.Errorf("local cluster instance %d: want 0 (the first) or 1 (a second beside it)", cfg.Instance)
	}
	if cfg.Instance > 0 && (cfg.DualStack || cfg.IPv6Only) {
		return nil, errors.New("a second local cluster instance is IPv4 only")
	}
	c = &Cluster{cfg: cfg, in: instances[cfg.Instance], nodes: map[string]*Node{}}
	if c.release, err = takeLock(ctx, c.logf); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Stop()
			c = nil
		}
	}()
	// The first instance clears what a crashed run left; a second one
	// must not touch the first's.
	if cfg.Instance == 0 {
		if err := CleanupStale(ctx); err != nil {
			return c, fmt.Errorf("clean up a previous run: %w", err)
		}
	} else if err := c.removeOwn(ctx); err != nil {
		return c, fmt.Errorf("clean up a previous run: %w", err)
	}
	c.bin = cfg.BinDir
	if c.bin == "" {
		if c.bin, err = EnsureBinaries(ctx, c.logf); err != nil {
			return c, err
		}
	}
	if c.Dir, err = os.MkdirTemp("", "proxyaudit-localcluster-"); err != nil {
		return c, err
	}
	c.logf("local cluster work dir %s", c.Dir)
	// A host-only veth pair holds the API server's advertised address.
	link := [][]string{
		{"ip", "link", "add", c.in.link, "type", "veth", "peer", "name", c.in.link + "-peer"},
		{"ip", "addr", "add", c.in.apiIP + "/32", "dev", c.in.link},
		{"ip", "link", "set", c.in.link, "up"},
		{"ip", "link", "set", c.in.link + "-peer", "up"},
	}
	if cfg.IPv6Only {
		link = append(link, []string{"ip", "addr", "add", APIServerIP6 + "/128", "dev", c.in.link, "nodad"})
	}
	for _, argv := range link {
		if _, err := run(ctx, argv...); err != nil {
			return c, err
		}
	}
	ips := []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(c.in.apiIP), net.ParseIP(KubernetesServiceIP), net.ParseIP(VMHostIP)}
	if c.pki, err = writePKI(c.Dir, ips); err != nil {
		return c, fmt.Errorf("write certificates: %w", err)
	}
	// The API server's identity towards kubelets (logs, exec, port-forward).
	if _, _, err := c.pki.clientCert(filepath.Join(c.Dir, "apiserver-kubelet-client"), "kube-apiserver-kubelet-client", "system:masters"); err != nil {
		return c, err
	}
	c.adminToken = randomToken()
	c.proxyToken = randomToken()
	tokens := fmt.Sprintf("%s,admin,1,system:masters\n%s,system:kube-proxy,2,\n", c.adminToken, c.proxyToken)
	if err := os.WriteFile(filepath.Join(c.Dir, "tokens.csv"), []byte(tokens), 0o600); err != nil {
		return c, err
	}
	c.AdminKubeconfig = filepath.Join(c.Dir, "admin.kubeconfig")
	if err := writeKubeconfig(c.AdminKubeconfig, c.localURL(), c.pki.CACert, c.adminToken, ""); err != nil {
		return c, err
	}
	c.proxyKubeconfig = filepath.Join(c.Dir, "kube-proxy.kubeconfig")
	if err := writeKubeconfig(c.proxyKubeconfig, "https://"+c.APIServer(), c.pki.CACert, c.proxyToken, ""); err != nil {
		return c, err
	}
	if err := c.startEtcd(ctx); err != nil {
		return c, err
	}
	if err := c.startAPIServer(ctx); err != nil {
		return c, err
	}
	return c, nil
}

// localURL is the API server as host processes reach it.
func (c *Cluster) localURL() string { return fmt.Sprintf("https://127.0.0.1:%d", c.in.apiPort) }

// APIServer is the API server's address as nodes reach it, ip:port.
func (c *Cluster) APIServer() string {
	return net.JoinHostPort(c.in.apiIP, strconv.Itoa(c.in.apiPort))
}

// procLock shares the machine-wide lock inside one process: a test
// package's shared cluster and the scratch namespaces its tests create hold
// it together (flock would make them wait for each other forever).
var procLock struct {
	sync.Mutex
	f     *os.File
	holds int
}

// takeLock waits for the machine-wide lock every local cluster and scratch
// namespace holds while it exists, and returns its release.
func takeLock(ctx context.Context, logf func(string, ...any)) (func(), error) {
	procLock.Lock()
	defer procLock.Unlock()
	release := func() {
		procLock.Lock()
		defer procLock.Unlock()
		if procLock.holds--; procLock.holds == 0 {
			syscall.Flock(int(procLock.f.Fd()), syscall.LOCK_UN)
			procLock.f.Close()
			procLock.f = nil
		}
	}
	if procLock.holds > 0 {
		procLock.holds++
		return release, nil
	}
	if err := os.MkdirAll(filepath.Dir(lockPath), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", lockPath, err)
	}
	logged := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			procLock.f, procLock.holds = f, 1
			return release, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", lockPath, err)
		}
		if !logged && logf != nil {
			logf("another local cluster is running on this machine; waiting for %s", lockPath)
			logged = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for %s: %w", lockPath, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (c *Cluster) startEtcd(ctx context.Context) error {
	var err error
	c.etcd, err = startProcess("etcd", filepath.Join(c.Dir, "etcd.log"), []string{
		filepath.Join(c.bin, "etcd"),
		"--name=default",
		"--data-dir=" + filepath.Join(c.Dir, "etcd"),
		"--listen-client-urls=" + c.in.etcdClient,
		"--advertise-client-urls=" + c.in.etcdClient,
		"--listen-peer-urls=" + c.in.etcdPeer,
		"--initial-advertise-peer-urls=" + c.in.etcdPeer,
		"--initial-cluster=default=" + c.in.etcdPeer,
		"--unsafe-no-fsync",
		"--log-level=warn",
	})
	if err != nil {
		return err
	}
	hc := &http.Client{Timeout: time.Second}
	return c.waitProcess(ctx, c.etcd, 60*time.Second, "etcd healthy", func() bool {
		resp, err := hc.Get(c.in.etcdClient + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
}

func (c *Cluster) startAPIServer(ctx context.Context) error {
	auditPolicy := filepath.Join(c.Dir, "audit-policy.yaml")
	if err := os.WriteFile(auditPolicy, []byte(auditPolicyYAML), 0o644); err != nil {
		return err
	}
	var err error
	c.apiserver, err = startProcess("kube-apiserver", filepath.Join(c.Dir, "kube-apiserver.log"), []string{
		c.apiServerBinary(),
		"--etcd-servers=" + c.in.etcdClient,
		"--bind-address=" + c.bindAddress(),
		fmt.Sprintf("--secure-port=%d", c.in.apiPort),
		"--advertise-address=" + c.advertiseAddress(),
		"--tls-cert-file=" + c.pki.ServingCert,
		"--tls-private-key-file=" + c.pki.ServingKey,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + c.pki.SAPub,
		"--service-account-signing-key-file=" + c.pki.SAKey,
		"--token-auth-file=" + filepath.Join(c.Dir, "tokens.csv"),
		// Real nodes' kubelets authenticate with certificates this CA signs.
		"--client-ca-file=" + c.pki.CACert,
		"--enable-admission-plugins=NodeRestriction",
		"--allow-privileged=true", // kube-proxy runs privileged, as kubeadm runs it
		"--kubelet-client-certificate=" + filepath.Join(c.Dir, "apiserver-kubelet-client.crt"),
		"--kubelet-client-key=" + filepath.Join(c.Dir, "apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP", // node names do not resolve here
		"--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=" + c.serviceCIDRs(),
		"--cert-dir=" + filepath.Join(c.Dir, "certs"),
		"--profiling=false",
		// proxyaudit's writes, as the API server saw them (AuditedWrites).
		"--audit-policy-file=" + auditPolicy,
		"--audit-log-path=" + filepath.Join(c.Dir, "audit.log"),
		"--audit-log-maxsize=0",
	})
	if err != nil {
		return err
	}
	c.RESTConfig = &rest.Config{
		Host:            c.localURL(),
		BearerToken:     c.adminToken,
		TLSClientConfig: rest.TLSClientConfig{CAFile: c.pki.CACert},
		QPS:             200,
		Burst:           400,
	}
	if c.Client, err = kubernetes.NewForConfig(c.RESTConfig); err != nil {
		return err
	}
	caPEM, err := os.ReadFile(c.pki.CACert)
	if err != nil {
		return err
	}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: certPool(caPEM)}}}
	ready := func() bool {
		req, _ := http.NewRequest("GET", c.localURL()+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+c.adminToken)
		resp, err := hc.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	}
	if err := c.waitProcess(ctx, c.apiserver, 120*time.Second, "kube-apiserver ready", ready); err != nil {
		return err
	}
	// kube-proxy programs default/kubernetes; wait until it exists so that
	// "rules present" has something to look for.
	return c.waitProcess(ctx, c.apiserver, 60*time.Second, "default/kubernetes service", func() bool {
		_, err := c.Client.CoreV1().Services("default").Get(ctx, "kubernetes", metav1.GetOptions{})
		return err == nil
	})
}

// waitProcess polls cond until it holds, the process exits (an error that
// quotes the end of its log), or the timeout passes.
func (c *Cluster) waitProcess(ctx context.Context, p *process, timeout time.Duration, what string, cond func() bool) error {
	start := time.Now()
	deadline := start.Add(timeout)
	for !cond() {
		if p != nil && p.exited() {
			return fmt.Errorf("%s exited while waiting for %s: %v; last log lines:\n%s", p.name, what, p.err, tailFile(p.log.Name(), 15))
		}
		if time.Now().After(deadline) {
			msg := fmt.Sprintf("timed out after %s waiting for %s", timeout, what)
			if p != nil {
				msg += "; last log lines of " + p.name + ":\n" + tailFile(p.log.Name(), 15)
			}
			return errors.New(msg)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	c.logf("%s after %s", what, time.Since(start).Round(time.Millisecond))
	return nil
}

// AddNode creates the node's namespace and veth pair, registers the Node
// object (zone label, InternalIP) and starts kube-proxy, returning once
// kube-proxy has programmed default/kubernetes.
func (c *Cluster) AddNode(ctx context.Context, spec NodeSpec) (*Node, error) {
	if spec.Mode == ModeCilium {
		return c.addCiliumNode(ctx, spec)
	}
	if spec.Mode != ModeIPTables && spec.Mode != ModeNFTables {
		return nil, fmt.Errorf("node %s: unsupported mode %q (want iptables, nftables or cilium)", spec.Name, spec.Mode)
	}
	n, err := c.newNodeNet(ctx, spec.Name, spec.Mode, spec.Zone)
	if err != nil {
		return nil, err
	}
	n.Legacy, n.proxyReady = spec.LegacyIPTables, spec.ProxyReady
	if err := c.registerNode(ctx, n); err != nil {
		return nil, err
	}
	if spec.NoProxy {
		return n, nil
	}
	if err := n.StartProxy(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// newNodeNet makes a node's namespace and its veth pair to the host.
func (c *Cluster) newNodeNet(ctx context.Context, name string, mode Mode, zone string) (*Node, error) {
	c.mu.Lock()
	if _, dup := c.nodes[name]; dup {
		c.mu.Unlock()
		return nil, fmt.Errorf("node %s already exists", name)
	}
	idx := len(c.nodes) + 1
	if idx > maxNodes {
		c.mu.Unlock()
		return nil, fmt.Errorf("at most %d nodes", maxNodes)
	}
	n := &Node{
		Name: name, Mode: mode, Zone: zone, Index: idx,
		NetNS:  c.in.prefix + name,
		HostIP: fmt.Sprintf("%s.%d", c.in.nodeNet, 4*idx+1),
		IP:     fmt.Sprintf("%s.%d", c.in.nodeNet, 4*idx+2),
		c:      c,
	}
	c.nodes[name] = n
	c.mu.Unlock()

	hostLink, nodeLink := fmt.Sprintf("%sh%d", c.in.prefix, idx), fmt.Sprintf("%sn%d", c.in.prefix, idx)
	for _, argv := range [][]string{
		{"ip", "netns", "add", n.NetNS},
		{"ip", "link", "add", hostLink, "type", "veth", "peer", "name", nodeLink},
		{"ip", "link", "set", nodeLink, "netns", n.NetNS},
		{"ip", "-n", n.NetNS, "link", "set", nodeLink, "name", "eth0"},
		{"ip", "addr", "add", n.HostIP + "/30", "dev", hostLink},
		{"ip", "link", "set", hostLink, "up"},
		{"ip", "-n", n.NetNS, "addr", "add", n.IP + "/30", "dev", "eth0"},
		{"ip", "-n", n.NetNS, "link", "set", "eth0", "up"},
		{"ip", "-n", n.NetNS, "link", "set", "lo", "up"},
		{"ip", "-n", n.NetNS, "route", "add", "default", "via", n.HostIP},
	} {
		if _, err := run(ctx, argv...); err != nil {
			return nil, fmt.Errorf("node %s network: %w", n.Name, err)
		}
	}
	if c.cfg.DualStack || c.cfg.IPv6Only {
		n.HostIP6, n.IP6 = fmt.Sprintf("2001:2:0:%x::1", idx), fmt.Sprintf("2001:2:0:%x::2", idx)
		for _, argv := range [][]string{
			{"ip", "addr", "add", n.HostIP6 + "/64", "dev", hostLink, "nodad"},
			{"ip", "-n", n.NetNS, "addr", "add", n.IP6 + "/64", "dev", "eth0", "nodad"},
			{"ip", "-n", n.NetNS, "-6", "route", "add", "default", "via", n.HostIP6},
		} {
			if _, err := run(ctx, argv...); err != nil {
				return nil, fmt.Errorf("node %s IPv6 network: %w", n.Name, err)
			}
		}
	}
	return n, nil
}

// serviceCIDRs is the API server's --service-cluster-ip-range.
func (c *Cluster) serviceCIDRs() string {
	switch {
	case c.cfg.IPv6Only:
		return ServiceCIDR6
	case c.cfg.DualStack:
		return ServiceCIDR + "," + ServiceCIDR6
	}
	return ServiceCIDR
}

// podCIDRs is kube-proxy's --cluster-cidr.
func (c *Cluster) podCIDRs() string {
	switch {
	case c.cfg.IPv6Only:
		return PodCIDR6
	case c.cfg.DualStack:
		return PodCIDR + "," + PodCIDR6
	}
	return PodCIDR
}

// advertiseAddress is the API server's address in default/kubernetes:
// of the primary service family.
func (c *Cluster) advertiseAddress() string {
	if c.cfg.IPv6Only {
		return APIServerIP6
	}
	return c.in.apiIP
}

// bindAddress: both families where the API server advertises IPv6.
func (c *Cluster) bindAddress() string {
	if c.cfg.IPv6Only {
		return "::"
	}
	return "0.0.0.0"
}

// KubernetesEndpoint is default/kubernetes' endpoint, ip:port, as
// kube-proxy DNATs to it.
func (c *Cluster) KubernetesEndpoint() string {
	return net.JoinHostPort(c.advertiseAddress(), strconv.Itoa(c.in.apiPort))
}

func (c *Cluster) registerNode(ctx context.Context, n *Node) error {
	labels := map[string]string{"kubernetes.io/hostname": n.Name, "kubernetes.io/os": "linux"}
	if n.Zone != "" {
		labels["topology.kubernetes.io/zone"] = n.Zone
	}
	obj := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: labels}}
	created, err := c.Client.CoreV1().Nodes().Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = c.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	}
	if err != nil {
		return fmt.Errorf("create Node %s: %w", n.Name, err)
	}
	// kube-proxy waits for the node's addresses before it programs anything.
	created.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: n.IP}}
	if c.cfg.IPv6Only {
		created.Status.Addresses = nil
	}
	if n.IP6 != "" {
		created.Status.Addresses = append(created.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: n.IP6})
	}
	created.Status.Addresses = append(created.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeHostName, Address: n.Name})
	created.Status.Conditions = []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "LocalCluster",
		LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now(),
	}}
	if _, err := c.Client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("set status of Node %s: %w", n.Name, err)
	}
	return nil
}

// Node returns the named node, or nil.
func (c *Cluster) Node(name string) *Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[name]
}

// Nodes returns every node, sorted by name.
func (c *Cluster) Nodes() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*Node, 0, len(c.nodes))
	for _, n := range c.nodes {
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Stop tears everything down: kube-proxies, the API server, etcd, network
// namespaces, links and (unless KeepWorkDir) the work directory, then
// releases the lock. It is safe to call more than once.
func (c *Cluster) Stop() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	extra := c.extra
	c.mu.Unlock()
	for _, p := range extra {
		p.stop(5 * time.Second)
	}
	for _, n := range c.Nodes() {
		n.mu.Lock()
		n.proxy.stop(5 * time.Second)
		n.mu.Unlock()
	}
	c.apiserver.stop(10 * time.Second)
	c.etcd.stop(10 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var err error
	if c.cfg.Instance == 0 {
		err = CleanupStale(ctx)
	} else {
		err = c.removeOwn(ctx)
	}
	if c.Dir != "" && c.cfg.Instance == 0 {
		err = errors.Join(err, cleanupRealNodes(c.Dir+"/"))
	}
	c.mu.Lock()
	undo := c.undo
	c.undo = nil
	c.mu.Unlock()
	for _, u := range undo {
		u()
	}
	if c.Dir != "" && !c.cfg.KeepWorkDir {
		os.RemoveAll(c.Dir)
	}
	if c.release != nil {
		c.release()
		c.release = nil
	}
	return err
}

// CanRun reports why this machine cannot run a local cluster, or nil.
func CanRun() error {
	if os.Geteuid() != 0 {
		return errors.New("the local cluster needs root (network namespaces, iptables)")
	}
	for _, tool := range []string{"ip", "iptables", "iptables-save", "nft"} {
		if _, err := lookPath(tool); err != nil {
			return fmt.Errorf("%s is not installed (Debian packages: iproute2 iptables nftables)", tool)
		}
	}
	return nil
}

// CleanupStale removes every process, network namespace and link a local
// cluster may have left behind. Call it only while holding the lock (Start
// does) or when no cluster runs.
func CleanupStale(ctx context.Context) error {
	var errs []error
	if err := killMarked(); err != nil {
		errs = append(errs, err)
	}
	// Real nodes' containers, mounts and cgroups (a crashed run's too).
	if err := cleanupRealNodes(filepath.Join(os.TempDir(), "proxyaudit-localcluster-")); err != nil {
		errs = append(errs, err)
	}
	restoreForwarding()
	for _, ns := range ourNetNS() {
		if _, err := run(ctx, "ip", "netns", "del", ns); err != nil {
			errs = append(errs, err)
		}
	}
	for _, l := range ourLinks() {
		// Deleting one end of a veth removes its peer: ignore "not found".
		if out, err := run(ctx, "ip", "link", "del", l); err != nil && !strings.Contains(out, "Cannot find device") {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeOwn removes a second instance's network namespaces and links (its
// processes Stop has ended), leaving the first instance's alone.
func (c *Cluster) removeOwn(ctx context.Context) error {
	var errs []error
	for _, ns := range ourNetNS() {
		if strings.HasPrefix(ns, c.in.prefix) {
			if _, err := run(ctx, "ip", "netns", "del", ns); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, l := range ourLinks() {
		if strings.HasPrefix(l, c.in.prefix) || l == c.in.link || l == c.in.link+"-peer" {
			if out, err := run(ctx, "ip", "link", "del", l); err != nil && !strings.Contains(out, "Cannot find device") {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Leftovers lists what a local cluster left on the machine: processes,
// network namespaces and links. Empty means clean.
func Leftovers() []string {
	var out []string
	for _, pid := range markedPIDs() {
		if pidAlive(pid) {
			cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			out = append(out, fmt.Sprintf("process %d: %s", pid, strings.ReplaceAll(strings.TrimRight(string(cmd), "\x00"), "\x00", " ")))
		}
	}
	for _, ns := range ourNetNS() {
		out = append(out, "network namespace "+ns)
	}
	for _, l := range ourLinks() {
		out = append(out, "link "+l)
	}
	var cgroups []string
	if machineLane() { // another lane's are lane 0's real nodes
		cgroups, _ = filepath.Glob("/sys/fs/cgroup/*/" + namePrefix + "*")
	}
	for _, cg := range cgroups {
		out = append(out, "cgroup "+cg)
	}
	for _, m := range mountsUnder(filepath.Join(os.TempDir(), "proxyaudit-localcluster-")) {
		out = append(out, "mount "+m)
	}
	return out
}

func ourNetNS() []string {
	entries, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), namePrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

func ourLinks() []string {
	ifs, _ := net.Interfaces()
	var out []string
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, namePrefix) {
			out = append(out, i.Name)
		}
	}
	return out
}

func randomToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// writeKubeconfig writes a kubeconfig for a bearer token; as, when set,
// impersonates that user.
func writeKubeconfig(path, server, caFile, token, as string) error {
	user := "token: " + token
	if as != "" {
		user += "\n    as: " + as
	}
	return kubeconfigFile(path, server, caFile, user)
}

// kubeconfigFile writes a kubeconfig for one cluster and one user, whose
// credentials user holds (YAML lines under "user:").
func kubeconfigFile(path, server, caFile, user string) error {
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: user
  user:
    %s
contexts:
- name: local
  context: {cluster: local, user: user}
current-context: local
`, server, caFile, user)
	return os.WriteFile(path, []byte(cfg), 0o600)
}

// AddHostAddress adds ip/32 to the host-only link that carries the API
// server's address, so a host process (an aggregator replica) can listen
// on an address of its own that every node routes to, as pods have. It
// goes away with the cluster.
func (c *Cluster) AddHostAddress(ctx context.Context, ip string) error {
	_, err := run(ctx, "ip", "addr", "replace", ip+"/32", "dev", c.in.link)
	return err
}
