// Package stream is the protocol between a node's collector and the
// aggregator, both ends of it:
//
//   - the messages (stream.go) and their framing (frame.go):
//     length-prefixed JSON over one TCP (or TLS) connection, every message
//     bounded before it is read;
//   - the rules state both ends keep in step (state.go, frontend.go): the
//     collector says hello with its node name and token, then reports its
//     rules as digests and deltas, a full snapshot first, then per
//     interval only the frontends that changed and the root digest over
//     all of them (a steady node sends the root alone); the aggregator
//     applies each (apply.go) and asks for a resync when its root differs;
//   - the names by hash a report may use instead of content (tops.go: a
//     whole state by one hash, its buckets' names) and the collector's
//     answers to the aggregator's wants (reply.go);
//   - the aggregator's interning of that state (pool.go): it shares the
//     state's representation (buckets and entries, interned by identity),
//     which would have to be exported to live elsewhere.
//
// Sessions (who says what when) live with each side: the aggregator's
// session and the collector's session; this package is what they say.
package stream

import (
	"errors"
	"fmt"
	"net/netip"
	"unicode/utf8"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

// DefaultMaxMessageBytes bounds one message: a full snapshot of a node at
// 100k endpoints is about 3 MB.
const DefaultMaxMessageBytes = 16 << 20

// Limits on what one node may claim, far above the Kubernetes scalability
// thresholds (10k services, 100k endpoints).
const (
	MaxFrontends = 200_000
	MaxEndpoints = 2_000_000
)

// maxOtherObjects bounds the JSON objects of a message that are not
// frontends (the message, its report, hello, kube-proxy signal).
const maxOtherObjects = 16

// ErrTooLarge is returned for a message over the size limit; its body is
// not read.
var ErrTooLarge = errors.New("message larger than the limit")

// Known says whether t is a message type of this protocol (metrics are
// labelled with known types only: a peer makes up any string).
func Known(t string) bool {
	switch t {
	case TypeHello, TypeWelcome, TypeRedirect, TypeReject, TypeReport, TypeResync, TypeReadNow, TypeAuth, TypeWant, TypeContent, TypeFlush, TypeFlushed, TypePeers:
		return true
	}
	return false
}

// Message types.
const (
	TypeHello    = "hello"
	TypeWelcome  = "welcome"
	TypeRedirect = "redirect"
	TypeReject   = "reject"
	TypeReport   = "report"
	TypeResync   = "resync"
	TypeReadNow  = "read"
	// TypeAuth carries a collector's fresh token on an open stream: the
	// stream lives no longer than the token it was opened with, unless
	// renewed this way.
	TypeAuth = "auth"
	// TypeWant asks the collector for the content of frontends a report
	// named by hash only; TypeContent is its answer.
	TypeWant    = "want"
	TypeContent = "content"
	// TypeFlush asks the collector to delete the conntrack entries of
	// named (frontend, gone destination) pairs; TypeFlushed is its answer.
	TypeFlush   = "flush"
	TypeFlushed = "flushed"
	// TypePeers tells the collector every aggregator replica's address, on
	// a new stream and whenever they change, so that it can reconnect
	// when the name it was given cannot be resolved (the node's DNS goes
	// through its own kube-proxy). A collector that predates it ignores it.
	TypePeers = "peers"
)

// Message is one frame. Type says which of the fields is set.
type Message struct {
	Type     string    `json:"type"`
	Hello    *Hello    `json:"hello,omitempty"`
	Redirect *Redirect `json:"redirect,omitempty"`
	Reject   *Reject   `json:"reject,omitempty"`
	Report   *Report   `json:"report,omitempty"`
	Resync   *Resync   `json:"resync,omitempty"`
	ReadNow  *ReadNow  `json:"read,omitempty"`
	Auth     *Auth     `json:"auth,omitempty"`
	Welcome  *Welcome  `json:"welcome,omitempty"`
	Want     *Want     `json:"want,omitempty"`
	Content  *Content  `json:"content,omitempty"`
	Flush    *Flush    `json:"flush,omitempty"`
	Flushed  *Flushed  `json:"flushed,omitempty"`
	Peers    *Peers    `json:"peers,omitempty"`
}

// MaxPeers bounds the addresses of one Peers message.
const MaxPeers = 64

// Peers lists the IP addresses of the aggregator replicas (the endpoints
// of the Service the collectors resolve), at the port the collector dials.
type Peers struct {
	IPs []string `json:"ips"`
}

// Check validates a peers message as a collector must before dialing what
// it names: 1 to MaxPeers IP addresses, no names, no ports, no zones.
func (p *Peers) Check() error {
	if len(p.IPs) == 0 || len(p.IPs) > MaxPeers {
		return fmt.Errorf("a peers message of %d addresses (1 to %d)", len(p.IPs), MaxPeers)
	}
	for _, ip := range p.IPs {
		a, err := netip.ParseAddr(ip)
		if err != nil || a.Zone() != "" || a.IsUnspecified() || a.IsMulticast() {
			return fmt.Errorf("bad peer address %q", clip(ip))
		}
	}
	return nil
}

// MaxFlushPairs bounds the pairs of one Flush.
const MaxFlushPairs = 1000

// Flush asks the collector to delete the conntrack entries DNATed from
// each pair's frontend to its destination, which the aggregator judged
// gone from the service past grace. The collector decides for itself what
// it deletes (see collector.Flusher): only while its own rules no longer
// send the frontend to that destination, UDP entries, and TCP only for
// connections never answered, when TCP is set.
type Flush struct {
	ID    uint64      `json:"id"`
	Pairs []FlushPair `json:"pairs"`
}

// FlushPair names one frontend (KeyString form) and one destination
// (ip:port).
type FlushPair struct {
	Frontend string `json:"k"`
	Dest     string `json:"d"`
	// TCP: also delete TCP connection attempts (SYN_SENT) of the pair.
	TCP bool `json:"tcp,omitempty"`
}

// Flushed answers a Flush: per pair, in its order, how many entries were
// deleted or why none were (Refused); Error when the table could not be
// read or written at all.
type Flushed struct {
	ID      uint64        `json:"id"`
	Results []FlushResult `json:"results,omitempty"`
	Error   string        `json:"error,omitempty"`
}

// FlushResult is what became of one pair.
type FlushResult struct {
	Deleted int    `json:"deleted"`
	Refused string `json:"refused,omitempty"`
}

// Check validates a flush request as a collector must before acting on it.
func (f *Flush) Check() error {
	if len(f.Pairs) == 0 || len(f.Pairs) > MaxFlushPairs {
		return fmt.Errorf("a flush of %d pairs (1 to %d)", len(f.Pairs), MaxFlushPairs)
	}
	for _, p := range f.Pairs {
		if _, err := ParseKey(p.Frontend); err != nil {
			return err
		}
		if _, err := netip.ParseAddrPort(p.Dest); err != nil {
			return fmt.Errorf("bad destination %q", clip(p.Dest))
		}
	}
	return nil
}

// Welcome accepts a stream and says what the aggregator speaks. An
// aggregator that predates it sends none: the collector then sends every
// frontend's content.
type Welcome struct {
	// Refs: the collector may name changed frontends by hash (Report.Refs).
	Refs bool `json:"refs,omitempty"`
	// Tops: the collector may name its whole state by its top
	// (Report.Top) and answer wants for bucket names and patches.
	Tops bool `json:"tops,omitempty"`
}

// Want asks the collector for the next level of what report Seq named
// and no node's copy holds, one level at a time: for a report naming its
// top, the names of the buckets it changed (Buckets); for named buckets
// no copy holds, the frontends that changed in them (Delta, bucket
// indexes), by hash; for frontends named by hash, their content (Sums).
type Want struct {
	Seq     uint64   `json:"seq"`
	Sums    []string `json:"sums,omitempty"`
	Buckets bool     `json:"buckets,omitempty"`
	Delta   []int    `json:"delta,omitempty"`
}

// Content answers a Want: the frontends that have the wanted hashes, the
// changed buckets' names, or the changed frontends of the buckets asked.
// What the collector no longer has is left out (the aggregator then asks
// for a full snapshot).
type Content struct {
	Frontends []Frontend `json:"frontends"`
	Buckets   string     `json:"buckets,omitempty"`
	Refs      []Ref      `json:"refs,omitempty"`
	Removed   []string   `json:"removed,omitempty"`
}

// Auth renews a stream's credentials with the token the kubelet rotated
// in (it rotates a projected token at 80 % of its life).
type Auth struct {
	Token string `json:"token"`
}

// Hello opens a stream: who the collector is and its credentials.
type Hello struct {
	Node    string `json:"node"`
	Token   string `json:"token,omitempty"`
	Version string `json:"version"`
	// IntervalSeconds is the collector's read interval: the aggregator
	// declares it missing after three intervals without a report.
	IntervalSeconds float64 `json:"intervalSeconds"`
	// Refs: the collector can name frontends by hash and answer a Want.
	Refs bool `json:"refs,omitempty"`
	// Tops: the collector can name its state by its top and answer wants
	// for bucket names and patches.
	Tops bool `json:"tops,omitempty"`
}

// Redirect tells a collector that connected to a follower where the
// leader is.
type Redirect struct {
	Leader string `json:"leader"`
}

// Reject ends a stream with the reason.
type Reject struct {
	Reason string `json:"reason"`
	// RetryAfterSeconds, when set, is when the aggregator expects to take
	// the collector (it is busy reviewing tokens): the collector comes
	// back then, with jitter, instead of backing off further.
	RetryAfterSeconds float64 `json:"retryAfterSeconds,omitempty"`
}

// Resync asks the collector for a full snapshot in its next report.
type Resync struct {
	Reason string `json:"reason"`
}

// ReadNow asks the collector to read and report at once instead of at its
// next interval: a change the node has not shown is crossing the grace
// period, and the verdict waits for the node's next word. A collector that
// does not know it ignores it.
type ReadNow struct {
	Reason string `json:"reason"`
}

// Report is one read of the node's rules.
type Report struct {
	Seq  uint64 `json:"seq"`
	Full bool   `json:"full,omitempty"`
	// Root digests the whole observed state after this report.
	Root     uint64 `json:"root"`
	Mode     string `json:"mode,omitempty"`
	NoRules  bool   `json:"noRules,omitempty"`
	Families []int  `json:"families,omitempty"`
	// Frontends are new or changed frontends (all of them when Full).
	Frontends []Frontend `json:"frontends,omitempty"`
	// Refs are new or changed frontends named by their content hash
	// instead of sent (only on a stream whose Welcome allowed them).
	Refs []Ref `json:"refs,omitempty"`
	// Removed are keys of frontends gone since the last report.
	Removed []string `json:"removed,omitempty"`
	// Top names the state the report moves the node to as a whole (a hash
	// over its buckets' names), instead of its changes: a node showing
	// rules another node's copy already held costs one hash. Only on a
	// stream whose Welcome allowed tops, never with a full snapshot.
	Top string `json:"top,omitempty"`
	// Buckets names the buckets the report changed (see encodeBuckets);
	// the aggregator fills it in from the collector's answer when it did
	// not know the Top.
	Buckets string `json:"buckets,omitempty"`
	// Patched are the named buckets whose changed frontends the report
	// carries (Frontends, Refs, Removed) because no copy held them; set by
	// the aggregator, never on the wire.
	Patched []int `json:"-"`
	// ReadError is set when the collector could not read the rules; such
	// a report carries no state change and the receiver must not apply it.
	ReadError string `json:"readError,omitempty"`
	// KubeProxy is kube-proxy's own account of its syncs, sent when it
	// changed since the last report.
	KubeProxy *KubeProxy `json:"kubeProxy,omitempty"`
	// Reads is what the collector's reads cost, sent after a read.
	Reads *ReadStats `json:"reads,omitempty"`
	// Conntrack is the node's conntrack counts, sent when they changed
	// by more than noise since the last ones sent on the stream.
	Conntrack *Conntrack `json:"conntrack,omitempty"`
}

// ReadStats is what a collector's reads of the rules cost: how many it
// made and why (cumulative since it started), and the last one's wall
// time, CPU (its own and the tool's) and bytes read.
type ReadStats struct {
	Reads          map[ReadReason]uint64 `json:"reads"`
	LastSeconds    float64               `json:"lastSeconds"`
	LastCPUSeconds float64               `json:"lastCPUSeconds"`
	LastBytes      int64                 `json:"lastBytes"`
	// WholeSeconds, WholeCPUSeconds and WholeBytes are the last whole
	// read's (the last read may have read only what changed: nothing, on
	// a node whose kube-proxy stopped writing). Absent from collectors
	// before 0.2.
	WholeSeconds    float64 `json:"wholeSeconds,omitempty"`
	WholeCPUSeconds float64 `json:"wholeCPUSeconds,omitempty"`
	WholeBytes      int64   `json:"wholeBytes,omitempty"`
	// FullReadIntervalSeconds is the collector's backstop: the longest
	// time between two reads of a source with a change signal.
	FullReadIntervalSeconds float64 `json:"fullReadIntervalSeconds,omitempty"`
	// SignalLost counts the kernel's change announcements lost to a full
	// socket buffer (each answered by a generation check).
	SignalLost uint64 `json:"signalLost,omitempty"`
	// Reader names what reads the rules ("iptables (nf_tables backend,
	// netlink)").
	Reader string `json:"reader,omitempty"`
	// Fallbacks counts reads that fell back to the text tool because the
	// reader could not decode a rule; FallbackReason says why, last.
	Fallbacks      uint64 `json:"fallbacks,omitempty"`
	FallbackReason string `json:"fallbackReason,omitempty"`
	// Warnings are what the last whole read noticed that is not a
	// finding (kube-proxy's leftover rules on a Cilium node, a Cilium
	// slot naming a missing backend), at most MaxReadWarnings.
	Warnings []string `json:"warnings,omitempty"`
}

// maxReaderText bounds the reader's name, fallback reason and each
// warning a report carries.
const maxReaderText = 512

// MaxReadWarnings bounds the warnings of one ReadStats.
const MaxReadWarnings = 4

// ReadReason is why a collector read the rules.
type ReadReason string

// Reasons for a read.
const (
	// ReadChange: the change signal moved (a commit was announced, or the
	// token differs at a heartbeat).
	ReadChange ReadReason = "change"
	// ReadBackstop: the full-read interval passed since the last read, for
	// what a signal can miss (a same-size rewrite on the legacy backend).
	ReadBackstop ReadReason = "backstop"
	// ReadAsked: the aggregator asked (a missed change crossed grace).
	ReadAsked ReadReason = "read-now"
	// ReadResync: a new stream or the aggregator's resync, with no earlier
	// read to send (or one the signal says is out of date).
	ReadResync ReadReason = "resync"
	// ReadHeartbeat: the interval, for a source without a change signal
	// (IPVS), or one whose signal could not be read.
	ReadHeartbeat ReadReason = "heartbeat"
	// ReadFlushed: the node's rules were flushed (the dispatch every
	// service is reached through emptied, its table deleted, IPVS
	// cleared): read at once, whatever the read budget holds.
	ReadFlushed ReadReason = "flushed"
)

// ReadReasons lists every ReadReason this version makes.
var ReadReasons = []ReadReason{ReadChange, ReadBackstop, ReadAsked, ReadResync, ReadHeartbeat, ReadFlushed}

// maxReadReasons and maxReasonText bound the reasons one ReadStats may
// name: a newer collector may name reasons this version does not know
// (they are shown as they are), but not without end.
const (
	maxReadReasons = 16
	maxReasonText  = 32
)

// Validate checks what a collector claims about its reads: a bounded
// set of short reasons (unknown ones are kept: a newer collector reads
// for reasons of its own), and figures that are not negative or absurd.
func (r *ReadStats) Validate() error {
	if len(r.Reads) > maxReadReasons {
		return fmt.Errorf("read stats: %d reasons (at most %d)", len(r.Reads), maxReadReasons)
	}
	for k := range r.Reads {
		if len(k) == 0 || len(k) > maxReasonText || !printableASCII(string(k)) {
			return fmt.Errorf("read stats: a reason of %d bytes (want 1 to %d printable characters): %q", len(k), maxReasonText, clip(string(k)))
		}
	}
	if r.LastSeconds < 0 || r.LastSeconds > 3600 || r.LastCPUSeconds < 0 || r.LastCPUSeconds > 3600 || r.LastBytes < 0 ||
		r.FullReadIntervalSeconds < 0 {
		return fmt.Errorf("read stats out of range: %gs, %gs CPU, %d bytes", r.LastSeconds, r.LastCPUSeconds, r.LastBytes)
	}
	if r.WholeSeconds < 0 || r.WholeSeconds > 3600 || r.WholeCPUSeconds < 0 || r.WholeCPUSeconds > 3600 || r.WholeBytes < 0 {
		return fmt.Errorf("read stats out of range: last whole read %gs, %gs CPU, %d bytes", r.WholeSeconds, r.WholeCPUSeconds, r.WholeBytes)
	}
	if len(r.Reader) > maxReaderText || len(r.FallbackReason) > maxReaderText {
		return fmt.Errorf("read stats: a reader name or fallback reason of %d bytes (at most %d)", max(len(r.Reader), len(r.FallbackReason)), maxReaderText)
	}
	if len(r.Warnings) > MaxReadWarnings {
		return fmt.Errorf("read stats: %d warnings (at most %d)", len(r.Warnings), MaxReadWarnings)
	}
	for _, w := range r.Warnings {
		if len(w) > maxReaderText {
			return fmt.Errorf("read stats: a warning of %d bytes (at most %d)", len(w), maxReaderText)
		}
	}
	return nil
}

// KubeProxy is what kube-proxy's metrics endpoint says about its syncs:
// the second signal beside the rules. Times are Unix seconds on the node's
// clock, shown to people and never used for grace.
type KubeProxy struct {
	LastSync               float64 `json:"lastSync,omitempty"`
	LastQueued             float64 `json:"lastQueued,omitempty"`
	EndpointChangesPending float64 `json:"endpointChangesPending"`
	ServiceChangesPending  float64 `json:"serviceChangesPending"`
	EndpointChangesTotal   float64 `json:"endpointChangesTotal"`
	// Version is kube-proxy's git version (kubernetes_build_info).
	Version string `json:"version,omitempty"`
	// Error says why the metrics could not be read.
	Error string `json:"error,omitempty"`
}

// Frontend is an observed frontend on the wire.
type Frontend struct {
	Key       string   `json:"k"`
	Scope     string   `json:"s"`
	Chain     string   `json:"c,omitempty"`
	Name      string   `json:"n,omitempty"`
	Endpoints []string `json:"e,omitempty"`
	// Weights are IPVS weights, parallel to Endpoints (in Cilium mode 0
	// marks a terminating backend after the active slots); absent
	// elsewhere.
	Weights []int `json:"w,omitempty"`
}

// CheckFacts validates what a report says about the node as a whole: a
// known mode and at most the two IP families (a 16 MiB list of integers
// once cost the aggregator a second per report).
func (r *Report) CheckFacts() error {
	switch audit.Mode(r.Mode) {
	case "", audit.ModeIPTables, audit.ModeNFTables, audit.ModeIPVS, audit.ModeCilium:
	default:
		return fmt.Errorf("unknown proxy mode %q", clip(r.Mode))
	}
	if len(r.Families) > 2 {
		return fmt.Errorf("%d IP families (a node has at most 4 and 6)", len(r.Families))
	}
	for i, f := range r.Families {
		if (f != 4 && f != 6) || (i == 1 && f == r.Families[0]) {
			return fmt.Errorf("bad IP families %v", r.Families)
		}
	}
	return nil
}

// clip is a node's text quoted in an error: cleaned and short.
func clip(s string) string { return safetext.Clean(s, 80) }

// maxName bounds a frontend's chain and rule names; kube-proxy's are at
// most a few dozen bytes (nft chain names carry the service's name), and
// the kernel's at most 255. maxKey bounds a key and an endpoint address
// ("[ffff:…:ffff]:65535/SCTP" is 52 bytes).
const (
	maxName = 256
	maxKey  = 64
)

// cutName cuts a name to maxName bytes on a character boundary.
func cutName(s string) string {
	if len(s) <= maxName {
		return s
	}
	s = s[:maxName]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// printableASCII reports whether s holds only printable ASCII (a name
// shown to people as it is).
func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
