package collector

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// maxPeersFile bounds what is read of the peers file: a few names of up
// to MaxPeers+keptPeers addresses each.
const maxPeersFile = 16 << 10

// loadPeers fills resolved from cfg.PeersFile, the aggregator addresses a
// collector on this node last knew: a collector started while the node's
// DNS is down (it goes through the node's own kube-proxy, whose rules may
// be the drift) still reaches the aggregator. Only names of --aggregator
// are taken, each with a valid list of addresses; anything else in the
// file is logged and ignored (the file is a cache, never needed).
func (c *client) loadPeers() {
	if c.cfg.PeersFile == "" {
		return
	}
	f, err := os.Open(c.cfg.PeersFile)
	if os.IsNotExist(err) {
		return
	}
	if err != nil {
		c.cfg.Log.Warn("cannot read the aggregator addresses kept from before; DNS alone will find the aggregator", zap.Error(err))
		return
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxPeersFile+1))
	var kept map[string][]string
	switch {
	case err != nil:
	case len(b) > maxPeersFile:
		err = fmt.Errorf("larger than %d bytes", maxPeersFile)
	default:
		err = json.Unmarshal(b, &kept)
	}
	if err != nil {
		c.cfg.Log.Warn("ignoring the aggregator addresses kept from before; DNS alone will find the aggregator (the file is rewritten at the next answer)",
			zap.String("file", c.cfg.PeersFile), zap.Error(err))
		return
	}
	for _, host := range c.aggregatorNames() {
		ips := kept[host]
		if len(ips) == 0 {
			continue
		}
		if err := (&stream.Peers{IPs: ips}).Check(); err != nil || len(ips) > stream.MaxPeers {
			c.cfg.Log.Warn("ignoring the aggregator addresses kept from before for a name", zap.String("host", host), zap.Error(err))
			continue
		}
		if c.resolved == nil {
			c.resolved = map[string][]string{}
		}
		c.resolved[host] = slices.Clone(ips)
		c.cfg.Log.Info("aggregator addresses kept from before: dialed when the name cannot be resolved", zap.String("host", host), zap.Strings("addresses", ips))
	}
	c.savedPeers = peersDigest(c.resolved)
}

// savePeers writes resolved to cfg.PeersFile when it changed, atomically
// (a temporary file renamed over it). A failure is logged: the file only
// helps a later start.
func (c *client) savePeers() {
	if c.cfg.PeersFile == "" {
		return
	}
	d := peersDigest(c.resolved)
	if d == c.savedPeers {
		return
	}
	b, err := json.Marshal(c.resolved)
	if err == nil {
		err = writeFileAtomic(c.cfg.PeersFile, b)
	}
	if err != nil {
		c.cfg.Log.Warn("cannot keep the aggregator addresses for a later start", zap.String("file", c.cfg.PeersFile), zap.Error(err))
		return
	}
	c.savedPeers = d
}

// aggregatorNames are the host names (not IP literals) of --aggregator.
func (c *client) aggregatorNames() []string {
	var out []string
	for _, a := range strings.Split(c.cfg.Aggregator, ",") {
		host, _, err := net.SplitHostPort(strings.TrimSpace(a))
		if err == nil && net.ParseIP(host) == nil {
			out = append(out, host)
		}
	}
	return out
}

func peersDigest(m map[string][]string) string {
	var parts []string
	for host, ips := range m {
		parts = append(parts, host+"="+strings.Join(slices.Sorted(slices.Values(ips)), ","))
	}
	slices.Sort(parts)
	return strings.Join(parts, ";")
}

func writeFileAtomic(name string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+".*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), name)
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
	return err
}
