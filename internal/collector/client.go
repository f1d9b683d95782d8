package collector

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/conntrack"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Config is what a collector needs to run.
type Config struct {
	Node string
	// Aggregator is host:port, or a comma-separated list; a host name is
	// resolved to every address (a headless Service lists every replica)
	// and each is tried until one answers (the leader, or a follower that
	// redirects to it).
	Aggregator string
	// Reader reads the rules; nil detects the mode on Host (and retries
	// detection every interval until kube-proxy has programmed the node).
	Reader RuleReader
	// Host is the node's kernel and tools; nil is NewHost().
	Host     *Host
	Interval time.Duration
	// TokenFile is the projected ServiceAccount token, re-read on every
	// connection (the kubelet rotates it).
	TokenFile string
	// TLS, when set, wraps the stream.
	TLS *tls.Config
	// CAFile, when set, is re-read at every connection for TLS.RootCAs:
	// a rotated CA (the Secret's mounted file) is trusted without a
	// restart. A file that no longer loads keeps the last good pool.
	CAFile          string
	MaxMessageBytes int
	Version         string
	Log             *zap.Logger
	// KubeProxyMetrics is kube-proxy's metrics URL, scraped with each read
	// as a second signal; empty disables it.
	KubeProxyMetrics string
	// Clock paces reads, read-now gaps and reconnects (network deadlines
	// stay on the real clock); nil is the real clock.
	Clock clock.WithTicker
	// FullReadInterval is the longest time between two reads of a source
	// with a change signal, for what the signal can miss (default 5m).
	FullReadInterval time.Duration
	// ReadBudget is the share of a core reads may average while the rules
	// keep changing: reads that changes or read-now requests cause wait
	// while reads have spent more than this earns (see readCredit), and
	// start at least 1 s and at most Interval apart. 0 means
	// DefaultReadBudget. ReadBurst is the CPU reads may spend at once
	// after a quiet spell (0: what the budget earns in
	// DefaultReadBurstWindow).
	ReadBudget float64
	ReadBurst  time.Duration
	// CPUTime is what the read budget measures a read's cost by: nil is
	// the CPU this process and the children it waited for used. Tests
	// in a synctest bubble give their own: the process's CPU is every
	// goroutine's, the aggregator's too when both run in one test.
	CPUTime func() time.Duration
	// Conntrack reads the node's conntrack table; nil: not read.
	// ConntrackInterval is the least time between two reads (a report
	// reads it when that much has passed since the last): a hung
	// kube-proxy changes no rules, so conntrack is read on its own clock.
	Conntrack         ConntrackSource
	ConntrackInterval time.Duration
	// ConntrackDelete lets the aggregator have stale conntrack entries
	// deleted (Flush): the collector's one power beyond reading. Off, a
	// flush is answered with a refusal.
	ConntrackDelete bool
	// Lookup resolves the aggregator's host name; nil is
	// net.DefaultResolver's (tests replace it).
	Lookup func(ctx context.Context, host string) ([]string, error)
	// Dial connects to an aggregator's address (host:port) without TLS;
	// nil is TCP with a 5 s timeout (tests in a synctest bubble replace it
	// with a network in memory).
	Dial func(ctx context.Context, addr string) (net.Conn, error)
	// PeersFile keeps the aggregator addresses the collector last knew
	// (from DNS, or the replicas the aggregator named) across restarts, on
	// the node: a collector started while the node's DNS is down (it goes
	// through the node's kube-proxy, which may be what drifted) dials
	// them. Empty: kept in memory only.
	PeersFile string
	// ConntrackFile keeps the frontends whose conntrack flows are counted
	// (the rules' at the last conntrack read, and those that left them in
	// the last day) across restarts, on the node: a service scaled to zero
	// is still watched for the flows kube-proxy leaves pinned to its gone
	// pod after a chart upgrade. Empty: kept in memory only.
	ConntrackFile string
}

// ConntrackDeleter deletes the conntrack entries of flush targets
// (conntrack.Reader).
type ConntrackDeleter interface {
	Delete(ctx context.Context, targets []conntrack.FlushTarget) ([]int, error)
}

// ConntrackSource reads what the node's conntrack table holds for its
// frontends (conntrack.Reader).
type ConntrackSource interface {
	Read(ctx context.Context, frontends []audit.FrontendKey) (*audit.Conntrack, error)
}

// DefaultReadBudget: 5 % of a core. A whole read at the anchors costs
// 0.5-1.9 s of CPU, so where every read is whole (the legacy backend)
// the collector reads under sustained churn about once an interval (10 s)
// instead of after every kube-proxy commit; a change after a quiet spell
// is still read at once, and reads of changes cost milliseconds.
const DefaultReadBudget = 0.05

// Run connects to the aggregator and reports until ctx ends, reconnecting
// with jittered exponential backoff (1 s to 30 s) and following redirects
// to the leader.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Node == "" {
		return errors.New("node name is empty (set --node-name or NODE_NAME)")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stream.DefaultMaxMessageBytes
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Host == nil {
		cfg.Host = NewHost()
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.FullReadInterval <= 0 {
		cfg.FullReadInterval = DefaultFullReadInterval
	}
	if cfg.ReadBudget <= 0 {
		cfg.ReadBudget = DefaultReadBudget
	}
	if cfg.ReadBurst <= 0 {
		cfg.ReadBurst = time.Duration(cfg.ReadBudget * float64(DefaultReadBurstWindow))
	}
	c := &client{cfg: cfg, reader: cfg.Reader, credit: newReadCredit(cfg.ReadBudget, cfg.ReadBurst, cfg.Interval)}
	c.cost.Reads = map[stream.ReadReason]uint64{}
	c.loadPeers()
	c.loadConntrack(cfg.Clock.Now())
	if src, ok := sourceOf(cfg.Reader); ok {
		c.openSignal(src)
	}
	defer func() {
		if c.signal != nil {
			c.signal.Close()
		}
	}()
	Reconnect(ctx, cfg.Clock, c.runStream, func(err error, wait time.Duration) {
		switch {
		case IsBusy(err):
			cfg.Log.Info("aggregator asked this collector to come back later", zap.Error(err), zap.Duration("retry_in", wait))
		case err != nil:
			cfg.Log.Warn("stream to the aggregator ended", zap.Error(err), zap.Duration("retry_in", wait))
		}
	})
	return nil
}

type client struct {
	cfg Config
	// noKubeProxy: the node's services are Cilium's (no kube-proxy
	// metrics to scrape).
	noKubeProxy bool
	// resolved keeps each aggregator name's last answer, from DNS or the
	// aggregator's list of its replicas (learnPeers).
	resolved map[string][]string
	// savedPeers digests resolved as last written to the peers file.
	savedPeers string
	// welcomed: the aggregator welcomed the current session.
	welcomed bool
	reader   RuleReader
	seq      uint64
	lastKP   *stream.KubeProxy // sent on this stream
	// ct is the last conntrack read (or its error) and ctAt when it was
	// made; ctSent the digest of the counts last sent on this stream.
	ct     *stream.Conntrack
	ctAt   time.Time
	ctSent uint64
	// ctKeys are the frontends of the rules at the last conntrack read;
	// ctGone those that left the rules since, and when — at a conntrack
	// read or at any rules read between two (leftRules): their flows are
	// still counted for ctRemember, and may be flushed. A service left
	// with no endpoints leaves the NAT rules (kube-proxy rejects it in
	// the filter table), and kube-proxy leaves its UDP entries alone (a
	// node port's, 1.37 too).
	ctKeys map[audit.FrontendKey]bool
	ctGone map[audit.FrontendKey]time.Time
	// ctSaved: ConntrackFile was written since the start (then again
	// only when the frontends change); ctDirty: a rules read added to
	// ctGone since it was last written.
	ctSaved, ctDirty bool
	http             http.Client

	// The last successful read, kept across streams: its state, the
	// change signal's token it reflects, and when it began.
	cached *stream.State
	token  uint64
	readAt time.Time

	signal      ChangeSignal
	signalTried bool
	// fed: the signal hands its notifications to the reader, whose reads
	// of changes say which generation they reflect.
	fed bool
	// legacy: the signal is the legacy backend's, which kube-proxy's own
	// sync time completes.
	legacy bool
	// kp is kube-proxy's metrics as last scraped; kpSyncAtRead its last
	// sync time as of the last read.
	kp           *stream.KubeProxy
	kpSyncAtRead float64
	// scraped delivers a heartbeat's scrape, run off the stream's loop: a
	// frozen kube-proxy holds a scrape for its whole timeout (3 s), and
	// that must not delay the heartbeat (an IPVS node at a 2 s interval
	// looked CollectorMissing while its kube-proxy was frozen).
	scraped  chan *stream.KubeProxy
	scraping bool

	// fallbacksSeen is the reader's count of fallbacks to the text tool
	// as last logged.
	fallbacksSeen uint64
	// credit is the read budget (see readCredit).
	credit *readCredit

	cost struct {
		Reads                       map[stream.ReadReason]uint64
		LastSeconds, LastCPUSeconds float64
		LastBytes                   int64
		// Whole*: the last whole read's (the last read may have read
		// only what changed).
		WholeSeconds, WholeCPUSeconds float64
		WholeBytes                    int64
		// Warnings: the last whole read's (Observed.Warnings).
		Warnings []string
	}
	statsChanged bool
}

// runStream runs one connection (a Session for Reconnect).
func (c *client) runStream(ctx context.Context, preferred string) (string, bool, error) {
	c.welcomed = false
	leader, err := c.connect(ctx, preferred)
	if leader != "" {
		c.cfg.Log.Info("following the aggregator leader", zap.String("leader", leader))
	}
	return leader, c.welcomed, err
}

// wantHistory is how many recent reports of changes answer a Want: with
// the state the oldest moved from, four states are kept (at the anchors a
// state is a few MB of the collector's heap).
const wantHistory = 3
