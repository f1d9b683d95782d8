package iptables

import (
	"bytes"
	"net/netip"
)

// The nat table as the parser holds it while it reads: rules by chain,
// endpoint chains by their hash, DNAT targets by endpoint chain.

// iptRule is the part of an iptables rule the audit reads, for the few
// chains it parses in full (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-EXT-…,
// KUBE-FW-… and the filter table's REJECTs).
type iptRule struct {
	dst      netip.Addr
	proto    string
	dport    uint16
	jump     string
	comment  string
	cond     bool // matches on source or address type: not an unconditional jump
	hasDport bool
}

// chainKey is a chain name as a map key that costs no allocation; iptables
// limits chain names to 28 bytes.
type chainKey [32]byte

func keyOf(b []byte) (chainKey, bool) {
	var k chainKey
	if len(b) == 0 || len(b) > len(k) {
		return k, false
	}
	copy(k[:], b)
	return k, true
}

func keyString(s string) chainKey {
	k, _ := keyOf([]byte(s))
	return k
}

func (k chainKey) String() string {
	n := bytes.IndexByte(k[:], 0)
	if n < 0 {
		n = len(k)
	}
	return string(k[:n])
}

// sepID names an endpoint chain compactly: kube-proxy's names are
// "KUBE-SEP-" plus 16 base32 characters (80 bits), decoded exactly into a
// and b. Any other name gets a sequence number with b's top bit set.
type sepID struct {
	a uint64
	b uint32
}

const sepOther = 1 << 31

type sepSlot struct {
	b   uint32
	idx int32
}

func (p *parser) addMoreDNAT(id sepID, ap netip.AddrPort) {
	p.kept++
	if p.moreDNAT == nil {
		p.moreDNAT = map[sepID][]netip.AddrPort{}
	}
	p.moreDNAT[id] = append(p.moreDNAT[id], ap)
}

func (p *parser) lookupDNAT(id sepID) (int32, bool) {
	if s, ok := p.dnat[id.a]; ok && s.b == id.b {
		return s.idx, true
	}
	i, ok := p.collide[id]
	return i, ok
}

// iptables holds what one pass over iptables-save output keeps: the few
// dispatch chains in full, each service policy chain as its jumps to
// endpoint chains, and each endpoint chain as its DNAT target.
type parser struct {
	rules  map[chainKey][]iptRule
	policy map[chainKey][]sepID
	// iptables-save prints a chain's rules together, so consecutive jumps
	// of one policy chain collect in cur before one map write.
	curKey chainKey
	cur    []sepID
	// declaredSEPs counts ":KUBE-SEP-…" declarations, which precede the
	// rules, to size dnat once.
	declaredSEPs int
	// dnat maps an endpoint chain to the index of its DNAT target in
	// targets, keyed by the ID's first 64 bits: small slots and a fast hash
	// keep a 100k-entry map cache-friendly. IDs that share those bits with
	// another live in collide.
	dnat    map[uint64]sepSlot
	collide map[sepID]int32
	// walked counts the rules policyOf looked at (tests bound it).
	walked     int
	targets    []netip.AddrPort
	moreDNAT   map[sepID][]netip.AddrPort // a second DNAT in one chain: never kube-proxy's, kept anyway
	free       []int32                    // slots of targets no chain uses (NAT.SetChain)
	omitChains bool                       // endpointsOf leaves audit.Endpoint.Chain empty
	otherIDs   map[string]sepID
	otherNames []string
	filterSvc  []iptRule
	kept       int // rules retained, against MaxRules
}

// sepIDOf returns the ID of endpoint chain name (with its "KUBE-SEP-").
func (p *parser) sepIDOf(name []byte) sepID {
	if id, ok := canonicalSEP(name[len(prefixSEP):]); ok {
		return id
	}
	if id, ok := p.otherIDs[string(name)]; ok {
		return id
	}
	if p.otherIDs == nil {
		p.otherIDs = map[string]sepID{}
	}
	id := sepID{a: uint64(len(p.otherNames)), b: sepOther}
	p.otherIDs[string(name)] = id
	p.otherNames = append(p.otherNames, string(name))
	return id
}

func canonicalSEP(h []byte) (sepID, bool) {
	if len(h) != 16 {
		return sepID{}, false
	}
	var id sepID
	for i, c := range h {
		var v byte
		switch {
		case c >= 'A' && c <= 'Z':
			v = c - 'A'
		case c >= '2' && c <= '7':
			v = c - '2' + 26
		default:
			return sepID{}, false
		}
		if i < 12 {
			id.a = id.a<<5 | uint64(v)
		} else {
			id.b = id.b<<5 | uint32(v)
		}
	}
	return id, true
}

const base32Alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"

func (p *parser) sepName(id sepID) string {
	if id.b&sepOther != 0 {
		return p.otherNames[id.a]
	}
	var b [25]byte
	copy(b[:], prefixSEP)
	for i := 11; i >= 0; i-- {
		b[9+i] = base32Alphabet[id.a&31]
		id.a >>= 5
	}
	for i := 3; i >= 0; i-- {
		b[21+i] = base32Alphabet[id.b&31]
		id.b >>= 5
	}
	return string(b[:])
}

var (
	prefixSEP  = []byte("KUBE-SEP-")
	prefixSVC  = []byte("KUBE-SVC-")
	prefixSVL  = []byte("KUBE-SVL-")
	jumpSEP    = []byte(" -j KUBE-SEP-")
	toDest     = []byte(" --to-destination ")
	commitLine = []byte("COMMIT")
)

// ChainChecker says whether a table has a chain (go-iptables, or the
// kernel itself: KernelChains).
type ChainChecker interface {
	ChainExists(table, chain string) (bool, error)
}
