package stream

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"math/bits"
)

// top names the state's buckets as a whole: a hash of their names.
func (s *State) top() [sumLen]byte {
	h := sha256.New()
	for _, b := range s.buckets {
		n := nameOf(b)
		h.Write(n[:])
	}
	var full [sha256.Size]byte
	return [sumLen]byte(h.Sum(full[:0]))
}

// Top is the wire form of the state's top: what a report names when
// another node's copy may already hold the very same rules.
func (s *State) Top() string {
	t := s.top()
	return hex.EncodeToString(t[:])
}

// ByTop returns r naming the state s (what r moves the other end to) by
// its top instead of carrying the changes or, for a full snapshot, every
// frontend: seq, root, node facts, signal, read stats and conntrack
// counts stay. The sender
// keeps what r moved the other end from (nothing, for a full snapshot)
// and to, to answer the wants that follow when the top is not known.
func (r *Report) ByTop(s *State) *Report {
	return &Report{Seq: r.Seq, Full: r.Full, Root: r.Root, Mode: r.Mode, NoRules: r.NoRules, Families: r.Families, Top: s.Top(),
		ReadError: r.ReadError, KubeProxy: r.KubeProxy, Reads: r.Reads, Conntrack: r.Conntrack}
}

// encodeBuckets names the buckets that differ between prev and next:
// a bitmap of their indexes, then each one's short name in order (all
// zeros for a bucket that became empty), in base64.
func encodeBuckets(prev, next *State) string {
	out := make([]byte, nBuckets/8, nBuckets/8+nBuckets*shortLen)
	for i := range nBuckets {
		a, b := nameOf(prev.buckets[i]), nameOf(next.buckets[i])
		if a == b {
			continue
		}
		out[i/8] |= 1 << (i % 8)
		if next.buckets[i] == nil {
			out = append(out, make([]byte, shortLen)...)
		} else {
			out = append(out, b[:shortLen]...)
		}
	}
	return base64.StdEncoding.EncodeToString(out)
}

// decodeBuckets reverses encodeBuckets.
func decodeBuckets(s string) (map[int][shortLen]byte, error) {
	if len(s) > base64.StdEncoding.EncodedLen(nBuckets/8+nBuckets*shortLen) {
		return nil, fmt.Errorf("bucket names of %d bytes: more than %d buckets", len(s), nBuckets)
	}
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("malformed bucket names: %v", err)
	}
	if len(raw) < nBuckets/8 {
		return nil, fmt.Errorf("malformed bucket names: %d bytes", len(raw))
	}
	n := 0
	for _, b := range raw[:nBuckets/8] {
		n += bits.OnesCount8(b)
	}
	if len(raw) != nBuckets/8+n*shortLen {
		return nil, fmt.Errorf("malformed bucket names: %d bytes for %d buckets", len(raw), n)
	}
	out := make(map[int][shortLen]byte, n)
	at := nBuckets / 8
	for i := range nBuckets {
		if raw[i/8]&(1<<(i%8)) != 0 {
			out[i] = [shortLen]byte(raw[at : at+shortLen])
			at += shortLen
		}
	}
	return out, nil
}
