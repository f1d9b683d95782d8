package conntrack

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
)

// protoNumbers are the protocols conntrack -L names.
var protoNumbers = map[string]uint8{"tcp": 6, "udp": 17, "sctp": 132}

// ParseList reads the text `conntrack -L` prints (plain or
// `-o extended`), one entry a line, and hands each TCP, UDP or SCTP
// entry to add; other protocols are skipped. It streams: a dump of a
// million entries costs one line at a time. A line it cannot read is an
// error naming the line.
func ParseList(r io.Reader, add func(*Entry)) (entries int, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 64<<10)
	line := 0
	for sc.Scan() {
		line++
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.Contains(text, "flow entries have been shown") || strings.HasPrefix(text, "conntrack v") {
			continue
		}
		if strings.HasPrefix(text, "<") {
			return entries, fmt.Errorf("line %d: XML (conntrack -o xml) is not read: save the table with conntrack -L -o extended", line)
		}
		e, ok, err := parseConntrackLine(text)
		if err != nil {
			return entries, fmt.Errorf("line %d: %v (want conntrack -L output, e.g. \"udp 17 29 src=... dst=... sport=... dport=... src=...\")", line, err)
		}
		if ok {
			entries++
			add(&e)
		}
	}
	if err := sc.Err(); err != nil {
		return entries, fmt.Errorf("line %d: %v", line+1, err)
	}
	return entries, nil
}

func parseConntrackLine(text string) (Entry, bool, error) {
	var e Entry
	fs := strings.Fields(text)
	if len(fs) > 0 && (fs[0] == "ipv4" || fs[0] == "ipv6") {
		if len(fs) < 2 {
			return e, false, fmt.Errorf("no protocol after %s", fs[0])
		}
		fs = fs[2:]
	}
	if len(fs) < 3 {
		return e, false, fmt.Errorf("too few fields")
	}
	proto, known := protoNumbers[fs[0]]
	if !known {
		if _, err := strconv.Atoi(fs[1]); err != nil {
			return e, false, fmt.Errorf("%q is not a protocol and its number", clipField(fs[0]+" "+fs[1]))
		}
		return e, false, nil // ICMP and the like: not a service's
	}
	e.Proto = proto
	fs = fs[3:] // name, number, timeout
	var src, dst [2]netip.Addr
	var sport, dport [2]uint16
	var seen [4]int // src, dst, sport, dport occurrences
	e.SeenReply = true
	for _, f := range fs {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			switch {
			case f == "[UNREPLIED]":
				e.SeenReply = false
			case strings.HasPrefix(f, "["):
			case e.TCPState == "" && seen[0] == 0:
				e.TCPState = f // TCP (or SCTP) state, before the tuples
			}
			continue
		}
		var slot *int
		switch k {
		case "src":
			slot = &seen[0]
		case "dst":
			slot = &seen[1]
		case "sport":
			slot = &seen[2]
		case "dport":
			slot = &seen[3]
		default:
			continue
		}
		i := *slot
		if i > 1 {
			continue // a master tuple's, for expectations
		}
		*slot++
		switch k {
		case "src", "dst":
			a, err := netip.ParseAddr(v)
			if err != nil {
				return e, false, fmt.Errorf("%s=%q: not an address", k, clipField(v))
			}
			if k == "src" {
				src[i] = a
			} else {
				dst[i] = a
			}
		default:
			p, err := strconv.ParseUint(v, 10, 16)
			if err != nil {
				return e, false, fmt.Errorf("%s=%q: not a port", k, clipField(v))
			}
			if k == "sport" {
				sport[i] = uint16(p)
			} else {
				dport[i] = uint16(p)
			}
		}
	}
	if seen[0] < 2 || seen[1] < 2 {
		return e, false, fmt.Errorf("not both tuples (original and reply)")
	}
	if proto != 6 && proto != 132 {
		e.TCPState = ""
	}
	e.OrigSrc, e.OrigDst = netip.AddrPortFrom(src[0], sport[0]), netip.AddrPortFrom(dst[0], dport[0])
	e.ReplySrc = netip.AddrPortFrom(src[1], sport[1])
	e.DstNAT = e.ReplySrc != e.OrigDst
	return e, true, nil
}

func clipField(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
