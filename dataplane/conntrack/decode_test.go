package conntrack

import (
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

func ctTuple(typ uint16, proto byte, src, dst netip.AddrPort) []byte {
	s, d := uint16(ctaIPv4Src), uint16(ctaIPv4Dst)
	if src.Addr().Is6() {
		s, d = ctaIPv6Src, ctaIPv6Dst
	}
	return ctNested(typ,
		ctNested(ctaTupleIP, ctAttr(s, src.Addr().AsSlice()), ctAttr(d, dst.Addr().AsSlice())),
		ctNested(ctaTupleProto, ctAttr(ctaProtoNum, []byte{proto}), ctAttr(ctaProtoSrcPort, be16(src.Port())), ctAttr(ctaProtoDstPort, be16(dst.Port()))))
}

// ctBody is one IPCTNL_MSG_CT_NEW body as the kernel sends it: a client
// to a frontend, DNATed to dest.
func ctBody(proto byte, client, frontend, dest netip.AddrPort, status uint32, tcpState int, start time.Time) []byte {
	b := []byte{2, 0, 0, 0} // nfgenmsg
	b = append(b, ctTuple(ctaTupleOrig, proto, client, frontend)...)
	b = append(b, ctTuple(ctaTupleReply, proto, dest, client)...)
	b = append(b, ctAttr(ctaStatus, be32(status))...)
	if tcpState >= 0 {
		b = append(b, ctNested(ctaProtoInfo, ctNested(ctaProtoInfoTCP, ctAttr(ctaProtoInfoTCPState, []byte{byte(tcpState)})))...)
	}
	if !start.IsZero() {
		b = append(b, ctNested(ctaTimestamp, ctAttr(ctaTimestampStart, binary.BigEndian.AppendUint64(nil, uint64(start.UnixNano()))))...)
	}
	return b
}

// ctDatagram frames bodies as the kernel's dump datagram, ending with
// NLMSG_DONE when done.
func ctDatagram(seq uint32, done bool, bodies ...[]byte) []byte {
	var out []byte
	frame := func(typ uint16, body []byte) {
		h := make([]byte, 16)
		binary.NativeEndian.PutUint32(h, uint32(16+len(body)))
		binary.NativeEndian.PutUint16(h[4:], typ)
		binary.NativeEndian.PutUint32(h[8:], seq)
		out = append(out, h...)
		out = append(out, body...)
	}
	for _, b := range bodies {
		frame(nfnlSubsysCTNetlink<<8|ipctnlMsgCTNew, b)
	}
	if done {
		frame(3, []byte{0, 0, 0, 0})
	}
	return out
}

var (
	ctClient = netip.MustParseAddrPort("198.18.5.5:40000")
	ctSvc    = netip.MustParseAddrPort("198.19.0.10:53")
	ctPod    = netip.MustParseAddrPort("198.18.77.2:5353")
)

func TestDecodeCT(t *testing.T) {
	start := time.Unix(1_800_000_000, 5)
	var e ctEntry
	if err := decodeCT(ctBody(6, ctClient, ctSvc, ctPod, ipsDstNAT|ipsSeenReply, 3, start), &e); err != nil {
		t.Fatal(err)
	}
	if e.proto != 6 || e.origSrc != ctClient || e.origDst != ctSvc || e.replySrc != ctPod || !e.hasTCPState || e.tcpState != 3 ||
		e.start != uint64(start.UnixNano()) || e.status != ipsDstNAT|ipsSeenReply {
		t.Errorf("decoded %+v", e)
	}
	v6c, v6s, v6p := netip.MustParseAddrPort("[2001:2::5]:40000"), netip.MustParseAddrPort("[2001:2:0:ffff::a]:53"), netip.MustParseAddrPort("[2001:2:1::2]:5353")
	if err := decodeCT(ctBody(17, v6c, v6s, v6p, ipsDstNAT, -1, time.Time{}), &e); err != nil || e.origDst != v6s || e.replySrc != v6p || e.hasTCPState {
		t.Errorf("IPv6: %+v %v", e, err)
	}
	for name, body := range map[string][]byte{
		"empty":              nil,
		"no tuples":          append([]byte{2, 0, 0, 0}, ctAttr(ctaStatus, be32(ipsDstNAT))...),
		"attribute too long": {2, 0, 0, 0, 200, 0, 1, 0},
		"truncated":          ctBody(17, ctClient, ctSvc, ctPod, ipsDstNAT, -1, time.Time{})[:30],
	} {
		if err := decodeCT(body, &e); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
}

func TestConntrackAggregation(t *testing.T) {
	o := ctFrontends()
	local := func(a netip.Addr) bool { return a == netip.MustParseAddr("198.18.77.1") }
	agg := NewCounter(ctKeys(o), local, 100)
	old := time.Unix(1_800_000_000, 0)
	var bodies [][]byte
	for i := range 5 {
		c := netip.AddrPortFrom(ctClient.Addr(), uint16(40000+i))
		bodies = append(bodies, ctBody(17, c, ctSvc, ctPod, ipsDstNAT|ipsSeenReply, -1, old.Add(time.Duration(i)*time.Second)))
	}
	bodies = append(bodies,
		ctBody(17, ctClient, ctSvc, netip.MustParseAddrPort("198.18.77.9:5353"), ipsDstNAT, -1, time.Time{}), // unreplied, another pod
		ctBody(6, ctClient, netip.MustParseAddrPort("198.19.0.10:80"), netip.MustParseAddrPort("198.18.77.2:8080"), ipsDstNAT|ipsSeenReply, 7, time.Time{}),
		ctBody(17, ctClient, netip.MustParseAddrPort("198.18.77.1:30053"), ctPod, ipsDstNAT|ipsSeenReply, -1, time.Time{}), // node port
		ctBody(17, ctClient, netip.MustParseAddrPort("198.18.99.1:30053"), ctPod, ipsDstNAT|ipsSeenReply, -1, time.Time{}), // not local
		ctBody(17, ctClient, netip.MustParseAddrPort("198.19.9.9:53"), ctPod, ipsDstNAT|ipsSeenReply, -1, time.Time{}),     // not a frontend
		ctBody(17, ctClient, ctSvc, ctSvc, ipsSeenReply, -1, time.Time{}),                                                  // not DNATed
		ctBody(1, ctClient, ctSvc, ctPod, ipsDstNAT, -1, time.Time{}),                                                      // ICMP
	)
	done, err := ctMessages(ctDatagram(7, true, bodies...), 7, countInto(agg, time.Time{}, nil))
	if err != nil || !done {
		t.Fatal(done, err)
	}
	got := agg.Result([]int{4})
	if got.Entries != 8 || got.Dropped != 0 || len(got.Flows) != 4 || !got.Timestamps {
		t.Fatalf("%+v", got)
	}
	byDest := map[string]string{}
	for _, f := range got.Flows {
		byDest[f.Frontend.String()+" "+f.Dest.String()] = ""
		switch {
		case f.Frontend.NodePort:
			if f.UDP != 1 || f.Frontend.Port != 30053 {
				t.Errorf("node port: %+v", f)
			}
		case f.Dest == ctPod:
			if f.UDP != 5 || f.Unreplied != 0 || !f.Oldest.Equal(old) || len(f.Samples) != Samples {
				t.Errorf("cluster IP to the pod: %+v", f)
			}
		case f.Dest.Port() == 8080:
			if f.TCP["TIME_WAIT"] != 1 || f.Total() != 1 {
				t.Errorf("TCP: %+v", f)
			}
		default:
			if f.UDP != 1 || f.Unreplied != 1 {
				t.Errorf("unreplied: %+v", f)
			}
		}
	}
	// Other sequences (another socket's dump) are not ours; an error
	// message ends the dump with the kernel's errno.
	if done, err := ctMessages(ctDatagram(8, false, bodies[0]), 7, func([]byte) error { t.Error("counted another dump's entry"); return nil }); done || err != nil {
		t.Errorf("another sequence: %v %v", done, err)
	}
	errMsg := ctDatagram(7, false)
	h := make([]byte, 16)
	binary.NativeEndian.PutUint32(h, 20)
	binary.NativeEndian.PutUint16(h[4:], 2) // NLMSG_ERROR
	binary.NativeEndian.PutUint32(h[8:], 7)
	errMsg = append(append(errMsg, h...), binary.NativeEndian.AppendUint32(nil, ^uint32(0))...) // -EPERM
	if _, err := ctMessages(errMsg, 7, func([]byte) error { return nil }); err == nil {
		t.Error("an EPERM answer read as a dump")
	}
}

// FuzzConntrackDump: whatever a dump datagram holds, the reader returns
// an error or counts, never panics or counts what is not a DNAT of a
// frontend.
func FuzzConntrackDump(f *testing.F) {
	f.Add(ctDatagram(1, true, ctBody(17, ctClient, ctSvc, ctPod, ipsDstNAT|ipsSeenReply, -1, time.Unix(1_800_000_000, 0))))
	f.Add(ctDatagram(1, false, ctBody(6, ctClient, netip.MustParseAddrPort("198.19.0.10:80"), ctPod, ipsDstNAT, 3, time.Time{}),
		ctBody(17, netip.MustParseAddrPort("[2001:2::5]:1"), netip.MustParseAddrPort("[2001:2::a]:53"), netip.MustParseAddrPort("[2001:2::b]:53"), ipsDstNAT, -1, time.Time{})))
	o := ctFrontends()
	f.Fuzz(func(t *testing.T, data []byte) {
		agg := NewCounter(ctKeys(o), func(netip.Addr) bool { return true }, 8)
		now := time.Unix(1_800_000_000, 0)
		_, _ = ctMessages(data, 1, countInto(agg, now, &defaultCTTimeouts))
		got := agg.Result([]int{4, 6})
		n := got.Dropped
		for _, fl := range got.Flows {
			n += fl.Total()
			if fl.Active.After(now) {
				t.Fatalf("a last packet after the read: %+v", fl)
			}
			if len(fl.Samples) > Samples || fl.Unreplied > fl.Total() {
				t.Fatalf("%+v", fl)
			}
		}
		if n != got.Entries || len(got.Flows) > 8 {
			t.Fatalf("entries %d, counted %d, pairs %d", got.Entries, n, len(got.Flows))
		}
	})
}

// An entry's last packet is dated from its remaining timeout and the
// timeout its state gets at each packet; where two may apply, the latest
// date (doubt makes a flow look live, never dying).
func TestConntrackLastPacket(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	to := defaultCTTimeouts
	to.udpStream = 180 // as on an older kernel's sysctl
	for _, c := range []struct {
		name string
		e    ctEntry
		ago  time.Duration // -1: unknown
	}{
		// The kernel's count is rounded down: a second is taken off.
		{"UDP, not assured", ctEntry{proto: 17, timeout: 25, hasTimeout: true}, 4 * time.Second},
		{"UDP, assured (stream)", ctEntry{proto: 17, status: ipsAssured, timeout: 100, hasTimeout: true}, 79 * time.Second},
		{"TCP SYN_SENT just sent", ctEntry{proto: 6, tcpState: 1, hasTCPState: true, timeout: 120, hasTimeout: true}, 0},
		{"TCP SYN_SENT first sent 100 s ago", ctEntry{proto: 6, tcpState: 1, hasTCPState: true, timeout: 20, hasTimeout: true}, 99 * time.Second},
		{"ESTABLISHED, days left", ctEntry{proto: 6, tcpState: 3, hasTCPState: true, timeout: 431990, hasTimeout: true}, 9 * time.Second},
		{"ESTABLISHED under 300 s left: unacknowledged data", ctEntry{proto: 6, tcpState: 3, hasTCPState: true, timeout: 290, hasTimeout: true}, 9 * time.Second},
		{"more left than the sysctl says", ctEntry{proto: 17, timeout: 500, hasTimeout: true}, 0},
		{"no timeout in the dump", ctEntry{proto: 17}, -1},
		{"TCP without a state", ctEntry{proto: 6, timeout: 10, hasTimeout: true}, -1},
		{"SCTP", ctEntry{proto: 132, timeout: 10, hasTimeout: true}, -1},
	} {
		got := c.e.lastPacket(now, &to)
		want := now.Add(-c.ago)
		if c.ago == -1 {
			want = time.Time{}
		}
		if !got.Equal(want) {
			t.Errorf("%s: last packet %v, want %v", c.name, got, want)
		}
	}
}

// The node's sysctls set the timeouts; one that cannot be read keeps the
// kernel's default.
func TestReadCTTimeouts(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "nf_conntrack_udp_timeout_stream"), []byte("180\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "nf_conntrack_tcp_timeout_syn_sent"), []byte("60\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "nf_conntrack_udp_timeout"), []byte("garbage\n"), 0o644)
	to := readCTTimeouts(dir)
	if to.udpStream != 180 || to.tcp[1] != 60 || to.tcp[9] != 60 || to.udp != 30 || to.tcp[3] != 432000 {
		t.Errorf("timeouts %+v", to)
	}
}

// CTA_TIMEOUT is decoded (big-endian seconds) and a short one refused.
func TestDecodeCTTimeout(t *testing.T) {
	ap := netip.MustParseAddrPort
	body := ctBody(17, ap("198.18.5.5:40000"), ap("198.19.0.10:53"), ap("198.18.77.3:5353"), ipsDstNAT, -1, time.Time{})
	var e ctEntry
	with := append(slices.Clone(body), ctAttr(ctaTimeout, binary.BigEndian.AppendUint32(nil, 27))...)
	if err := decodeCT(with, &e); err != nil || !e.hasTimeout || e.timeout != 27 {
		t.Errorf("timeout %d (%v), err %v", e.timeout, e.hasTimeout, err)
	}
	short := append(slices.Clone(body), ctAttr(ctaTimeout, []byte{1, 2})...)
	if err := decodeCT(short, &e); err == nil {
		t.Error("a two-byte timeout was taken")
	}
}
