package scenario

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// Sentinel returns a service applied after every other change: once a node's
// kube-proxy routes to its endpoint, it has processed what came before.
func Sentinel(round int) Entry {
	return One(fmt.Sprintf("zz-sentinel-%d", round), fmt.Sprintf("198.18.129.%d", round+1))
}

// One is a service named name with one ready endpoint, ip:8080 behind
// port 80/TCP.
func One(name, ip string) Entry {
	return Entry{
		Service: service(name, nil, svcPort("http", 80, corev1.ProtocolTCP)),
		Slices: []*discoveryv1.EndpointSlice{slice(name, name+"-1",
			[]discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP)}, Endpoint(ip, "ready", "", ""))},
	}
}

// SentinelEndpoint is the ip:port of Sentinel(round)'s endpoint.
func SentinelEndpoint(round int) string { return fmt.Sprintf("198.18.129.%d:8080", round+1) }

// WaitSynced applies Sentinel(round) and waits until every given node routes
// to it.
func WaitSynced(ctx context.Context, c *localcluster.Cluster, round int, nodes []*localcluster.Node) error {
	if err := Apply(ctx, c, []Entry{Sentinel(round)}); err != nil {
		return err
	}
	for _, n := range nodes {
		if err := n.WaitRules(ctx, 2*time.Minute, fmt.Sprintf("sentinel %d", round), func(r string) bool {
			return n.RoutesTo(r, SentinelEndpoint(round))
		}); err != nil {
			return err
		}
	}
	return nil
}

// Capture writes the cluster state (cluster.json) and every node's rules
// (<node>.rules: nat and filter tables in iptables mode, the kube-proxy
// table as JSON in nftables mode) into dir.
func Capture(ctx context.Context, c *localcluster.Cluster, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	state, err := c.DumpClusterJSON(ctx)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "cluster.json"), state, 0o644); err != nil {
		return err
	}
	for _, n := range c.Nodes() {
		rules, err := NodeRules(ctx, n)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, n.Name+".rules"), []byte(rules), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// NodeRules reads a node's rules as proxyaudit's readers consume them.
func NodeRules(ctx context.Context, n *localcluster.Node) (string, error) {
	if n.Mode == localcluster.ModeNFTables {
		return n.Rules(ctx)
	}
	var out strings.Builder
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		if n.Legacy {
			save = strings.Replace(save, "-save", "-legacy-save", 1)
		}
		for _, table := range []string{"nat", "filter"} {
			dump, err := n.Exec(ctx, save, "-t", table)
			if err != nil {
				return "", err
			}
			out.WriteString(dump)
		}
	}
	return out.String(), nil
}
