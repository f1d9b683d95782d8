// Package stream is the wire protocol between a node's collector and the
// aggregator: length-prefixed JSON messages over one TCP (or TLS)
// connection. The collector says hello with its node name and token, then
// reports its rules as digests and deltas: a full snapshot first, then per
// interval only the frontends that changed and the root digest over all of
// them (a steady node sends the root alone). The aggregator applies each
// delta to its copy and asks for a full resync when its root differs
// (anti-entropy). Every message is bounded before it is read.
package stream

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/proxyaudit/proxyaudit/audit"
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

// Message types.
const (
	TypeHello    = "hello"
	TypeWelcome  = "welcome"
	TypeRedirect = "redirect"
	TypeReject   = "reject"
	TypeReport   = "report"
	TypeResync   = "resync"
	TypeReadNow  = "read"
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
}

// Hello opens a stream: who the collector is and its credentials.
type Hello struct {
	Node    string `json:"node"`
	Token   string `json:"token,omitempty"`
	Version string `json:"version"`
	// IntervalSeconds is the collector's read interval: the aggregator
	// declares it missing after three intervals without a report.
	IntervalSeconds float64 `json:"intervalSeconds"`
}

// Redirect tells a collector that connected to a follower where the
// leader is.
type Redirect struct {
	Leader string `json:"leader"`
}

// Reject ends a stream with the reason.
type Reject struct {
	Reason string `json:"reason"`
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
	// Removed are keys of frontends gone since the last report.
	Removed []string `json:"removed,omitempty"`
	// ReadError is set when the collector could not read the rules; such
	// a report carries no state change and the receiver must not apply it.
	ReadError string `json:"readError,omitempty"`
	// KubeProxy is kube-proxy's own account of its syncs, sent when it
	// changed since the last report.
	KubeProxy *KubeProxy `json:"kubeProxy,omitempty"`
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
	// Weights are IPVS weights, parallel to Endpoints; absent elsewhere.
	Weights []int `json:"w,omitempty"`
}

// Write sends one message.
func Write(w io.Writer, m *Message) error {
	body, err := json.Marshal(m)
	if err != nil {
		return err
	}
	frame := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(frame, uint32(len(body)))
	copy(frame[4:], body)
	_, err = w.Write(frame)
	return err
}

// Read receives one message of at most max bytes. A larger message is
// ErrTooLarge and its body is not read: the stream must be closed.
func Read(r io.Reader, max int) (*Message, int, error) {
	body, n, err := ReadFrame(r, max)
	if err != nil {
		return nil, n, err
	}
	m, err := Decode(body)
	return m, n, err
}

// ReadFrame receives one message's body of at most max bytes without
// decoding it; n counts the frame with its header.
func ReadFrame(r io.Reader, max int) ([]byte, int, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, 0, err
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n > max {
		return nil, n, fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, n, max)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, n, fmt.Errorf("truncated message: %w", err)
	}
	return body, n + 4, nil
}

// Decode decodes a message body.
func Decode(body []byte) (*Message, error) {
	// Every frontend is one JSON object: a small message of empty ones
	// ("{},{},…", 3 bytes each, 112 once decoded) would make the decoder
	// allocate ~40 times the message. Count before decoding.
	if objs := bytes.Count(body, []byte("{")); objs > MaxFrontends+maxOtherObjects {
		return nil, fmt.Errorf("malformed message: %d JSON objects, more than the %d frontends a node can have", objs, MaxFrontends)
	}
	var m Message
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("malformed message: %v", err)
	}
	return &m, nil
}

// Budget bounds the bytes of large messages being decoded and applied at
// once across streams: a message decodes to about ten times its size, and
// after a leader change every collector sends its full snapshot (3 MB at
// 100k endpoints) at the same moment.
type Budget struct {
	mu   sync.Mutex
	cond *sync.Cond
	left int
	size int
}

// NewBudget returns a budget of n bytes.
func NewBudget(n int) *Budget {
	b := &Budget{left: n, size: n}
	b.cond = sync.NewCond(&b.mu)
	return b
}

// Take waits until n bytes (at most the whole budget) are free and takes
// them; Give returns them.
func (b *Budget) Take(n int) int {
	n = min(n, b.size)
	b.mu.Lock()
	for b.left < n {
		b.cond.Wait()
	}
	b.left -= n
	b.mu.Unlock()
	return n
}

// Give returns what Take took.
func (b *Budget) Give(n int) {
	b.mu.Lock()
	b.left += n
	b.mu.Unlock()
	b.cond.Broadcast()
}

// KeyString is the wire form of a frontend key: "198.19.0.10:53/UDP" or
// "nodeport:30080/TCP".
func KeyString(k audit.FrontendKey) string {
	if k.NodePort {
		return "nodeport:" + strconv.Itoa(int(k.Port)) + "/" + k.Protocol
	}
	return netip.AddrPortFrom(k.IP, k.Port).String() + "/" + k.Protocol
}

// ParseKey reverses KeyString.
func ParseKey(s string) (audit.FrontendKey, error) {
	addr, proto, ok := strings.Cut(s, "/")
	if !ok || (proto != "TCP" && proto != "UDP" && proto != "SCTP") {
		return audit.FrontendKey{}, fmt.Errorf("bad frontend key %q", clip(s))
	}
	if p, ok := strings.CutPrefix(addr, "nodeport:"); ok {
		n, err := strconv.ParseUint(p, 10, 16)
		if err != nil {
			return audit.FrontendKey{}, fmt.Errorf("bad node port in %q", clip(s))
		}
		return audit.FrontendKey{NodePort: true, Protocol: proto, Port: uint16(n)}, nil
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return audit.FrontendKey{}, fmt.Errorf("bad frontend key %q", clip(s))
	}
	return audit.FrontendKey{IP: ap.Addr(), Protocol: proto, Port: ap.Port()}, nil
}

// FromObserved converts an observed frontend to its wire form.
func FromObserved(of audit.ObservedFrontend) Frontend {
	f := Frontend{Key: KeyString(of.FrontendKey), Scope: string(of.Scope), Chain: of.Chain, Name: of.Name}
	weights := false
	for _, e := range of.Endpoints {
		f.Endpoints = append(f.Endpoints, e.Addr.String())
		if e.Weight >= 0 {
			weights = true
		}
	}
	if weights {
		for _, e := range of.Endpoints {
			f.Weights = append(f.Weights, e.Weight)
		}
	}
	return f
}

// ToObserved validates a wire frontend and converts it back.
func (f Frontend) ToObserved() (audit.ObservedFrontend, error) {
	k, err := ParseKey(f.Key)
	if err != nil {
		return audit.ObservedFrontend{}, err
	}
	// IPVS virtual servers carry no scope: "" is allowed.
	if f.Scope != string(audit.ScopeCluster) && f.Scope != string(audit.ScopeLocal) && f.Scope != "" {
		return audit.ObservedFrontend{}, fmt.Errorf("frontend %s: bad scope %q", f.Key, clip(f.Scope))
	}
	if len(f.Weights) != 0 && len(f.Weights) != len(f.Endpoints) {
		return audit.ObservedFrontend{}, fmt.Errorf("frontend %s: %d weights for %d endpoints", f.Key, len(f.Weights), len(f.Endpoints))
	}
	of := audit.ObservedFrontend{FrontendKey: k, Scope: audit.Scope(f.Scope), Chain: f.Chain, Name: f.Name}
	for i, e := range f.Endpoints {
		ap, err := netip.ParseAddrPort(e)
		if err != nil {
			return audit.ObservedFrontend{}, fmt.Errorf("frontend %s: bad endpoint %q", f.Key, clip(e))
		}
		w := -1
		if len(f.Weights) > 0 {
			w = f.Weights[i]
		}
		of.Endpoints = append(of.Endpoints, audit.Endpoint{Addr: ap, Weight: w, Chain: f.Chain})
	}
	return of, nil
}

// Digest hashes what routes traffic in a frontend: key, scope, endpoints
// and weights (not chain names, which only name things).
func (f Frontend) Digest() uint64 {
	h := fnv.New64a()
	h.Write([]byte(f.Key))
	h.Write([]byte{0})
	h.Write([]byte(f.Scope))
	eps := make([]string, len(f.Endpoints))
	for i, e := range f.Endpoints {
		eps[i] = e
		if len(f.Weights) > 0 {
			eps[i] += "=" + strconv.Itoa(f.Weights[i])
		}
	}
	slices.Sort(eps)
	for _, e := range eps {
		h.Write([]byte{0})
		h.Write([]byte(e))
	}
	return h.Sum64()
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
