package collector

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
)

// maxConntrackFile bounds what is read of the conntrack file: the
// frontends of the rules (tens of thousands at the largest clusters) and
// up to ctMaxGone that left them, some 40 bytes each.
const maxConntrackFile = 8 << 20

// conntrackFile is what the collector keeps on the node across restarts
// of the frontends whose conntrack flows it counts: those of the rules
// at its last conntrack read, and those that left them (Unix seconds).
// Without it a collector restarted (a chart upgrade, an eviction) forgets
// a service scaled to zero and never counts the flows kube-proxy leaves
// pinned to its gone pod (kubernetes#139628: 13 hours).
type conntrackFile struct {
	Frontends []string         `json:"frontends"`
	Gone      map[string]int64 `json:"gone"`
}

// loadConntrack fills ctKeys and ctGone from cfg.ConntrackFile. A file
// that is not what saveConntrack writes is logged and ignored whole: it
// only helps, and a start without it counts what the rules show.
func (c *client) loadConntrack(now time.Time) {
	if c.cfg.ConntrackFile == "" {
		return
	}
	f, err := os.Open(c.cfg.ConntrackFile)
	if os.IsNotExist(err) {
		return
	}
	if err != nil {
		c.cfg.Log.Warn("cannot read the conntrack frontends kept from before; only the rules' own are counted until they change", zap.Error(err))
		return
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxConntrackFile+1))
	var kept conntrackFile
	switch {
	case err != nil:
	case len(b) > maxConntrackFile:
		err = fmt.Errorf("larger than %d bytes", maxConntrackFile)
	default:
		err = json.Unmarshal(b, &kept)
	}
	var keys map[audit.FrontendKey]bool
	var gone map[audit.FrontendKey]time.Time
	if err == nil {
		keys, gone, err = kept.parse(now)
	}
	if err != nil {
		c.cfg.Log.Warn("ignoring the conntrack frontends kept from before (the file is rewritten at the next conntrack read)",
			zap.String("file", c.cfg.ConntrackFile), zap.Error(err))
		return
	}
	c.ctKeys, c.ctGone = keys, gone
	c.cfg.Log.Info("conntrack frontends kept from before: their flows are counted as before the restart",
		zap.Int("frontends", len(keys)), zap.Int("left the rules", len(gone)))
}

func (k *conntrackFile) parse(now time.Time) (map[audit.FrontendKey]bool, map[audit.FrontendKey]time.Time, error) {
	if len(k.Frontends) > maxConntrackFile/16 || len(k.Gone) > ctMaxGone {
		return nil, nil, fmt.Errorf("%d frontends and %d gone: more than a collector keeps", len(k.Frontends), len(k.Gone))
	}
	keys := make(map[audit.FrontendKey]bool, len(k.Frontends))
	for _, s := range k.Frontends {
		fk, err := audit.ParseFrontendKey(s)
		if err != nil {
			return nil, nil, err
		}
		keys[fk] = true
	}
	gone := make(map[audit.FrontendKey]time.Time, len(k.Gone))
	for s, at := range k.Gone {
		fk, err := audit.ParseFrontendKey(s)
		if err != nil {
			return nil, nil, err
		}
		t := time.Unix(at, 0)
		if t.After(now.Add(time.Minute)) {
			return nil, nil, fmt.Errorf("frontend %s left the rules at %s, later than now", s, t.UTC().Format(time.RFC3339))
		}
		if now.Sub(t) <= ctRemember {
			gone[fk] = t
		}
	}
	return keys, gone, nil
}

// saveConntrack writes ctKeys and ctGone to cfg.ConntrackFile, atomically.
// A failure is logged: the file only helps a later start.
func (c *client) saveConntrack() {
	if c.cfg.ConntrackFile == "" {
		return
	}
	out := conntrackFile{Frontends: make([]string, 0, len(c.ctKeys)), Gone: make(map[string]int64, len(c.ctGone))}
	for k := range c.ctKeys {
		out.Frontends = append(out.Frontends, k.Wire())
	}
	for k, at := range c.ctGone {
		out.Gone[k.Wire()] = at.Unix()
	}
	b, err := json.Marshal(out)
	if err == nil {
		err = writeFileAtomic(c.cfg.ConntrackFile, b)
	}
	if err != nil {
		c.cfg.Log.Warn("cannot keep the conntrack frontends for a later start", zap.String("file", c.cfg.ConntrackFile), zap.Error(err))
	}
}
