package stream

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"strconv"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

// Ref names a frontend by its key and content hash.
type Ref struct {
	Key string `json:"k"`
	Sum string `json:"h"`
}

// sumLen is the bytes of SHA-256 a Sum keeps: 128 bits, so that no node
// can make up a frontend with the hash of another node's (a Ref resolves
// to content another node sent; the 64-bit FNV digests below are for
// change detection only and are trivially forged).
const sumLen = 16

// Sum hashes everything a frontend holds, in order, chain names included:
// two frontends with one Sum are the same frontend.
func (f Frontend) Sum() string {
	s := f.sum()
	return hex.EncodeToString(s[:])
}

func (f Frontend) sum() [sumLen]byte {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	put := func(s string) {
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(s)))])
		h.Write([]byte(s))
	}
	put(f.Key)
	put(f.Scope)
	put(f.Chain)
	put(f.Name)
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(f.Endpoints)))])
	for _, e := range f.Endpoints {
		put(e)
	}
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(f.Weights)))])
	for _, w := range f.Weights {
		h.Write(n[:binary.PutVarint(n[:], int64(w))])
	}
	var full [sha256.Size]byte
	return [sumLen]byte(h.Sum(full[:0]))
}

// parseSum decodes a Sum's wire form.
func parseSum(s string) ([sumLen]byte, bool) {
	var out [sumLen]byte
	if len(s) != 2*sumLen {
		return out, false
	}
	if _, err := hex.Decode(out[:], []byte(s)); err != nil {
		return out, false
	}
	return out, hex.EncodeToString(out[:]) == s // lower case only: one spelling per hash
}

// KeyString is the wire form of a frontend key (audit.FrontendKey.Wire).
func KeyString(k audit.FrontendKey) string { return k.Wire() }

// ParseKey reverses KeyString.
func ParseKey(s string) (audit.FrontendKey, error) { return audit.ParseFrontendKey(s) }

// FromObserved converts an observed frontend to its wire form.
func FromObserved(of audit.ObservedFrontend) Frontend {
	f := Frontend{Key: KeyString(of.FrontendKey), Scope: string(of.Scope), Chain: cutName(of.Chain), Name: cutName(of.Name)}
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
	// A node's copy keeps what its reports sent: every string is bounded
	// here, where it enters (names were kept whole and only cut when read:
	// 24 small reports with a 12 MiB chain name each grew the leader's heap
	// by 300 MiB). The kernel bounds the names kube-proxy writes (255 bytes)
	// and FromObserved cuts them to maxName, so a genuine collector never
	// sends longer.
	if len(f.Key) > maxKey || len(f.Chain) > maxName || len(f.Name) > maxName {
		return audit.ObservedFrontend{}, fmt.Errorf("frontend %s: key, chain or rule name of %d, %d and %d bytes: longer than any kube-proxy writes (%d, %d)",
			clip(f.Key), len(f.Key), len(f.Chain), len(f.Name), maxKey, maxName)
	}
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
	// Names are shown to people (details, explain, Slack): cleaned and
	// bounded here, where they enter.
	of := audit.ObservedFrontend{FrontendKey: k, Scope: audit.Scope(f.Scope), Chain: safetext.Clean(f.Chain, maxName), Name: safetext.Clean(f.Name, maxName)}
	for i, e := range f.Endpoints {
		ap, err := netip.ParseAddrPort(e)
		if err == nil && (len(e) > maxKey || ap.Addr().Zone() != "") {
			err = errors.New("not an endpoint address")
		}
		if err != nil {
			return audit.ObservedFrontend{}, fmt.Errorf("frontend %s: bad endpoint %q", f.Key, clip(e))
		}
		w := -1
		if len(f.Weights) > 0 {
			w = f.Weights[i]
		}
		of.Endpoints = append(of.Endpoints, audit.Endpoint{Addr: ap, Weight: w, Chain: of.Chain})
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
