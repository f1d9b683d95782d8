package nftables

import (
	"bytes"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// jscan is a small cursor over a JSON document for the nft reader: it walks
// objects and arrays with callbacks, returns strings and numbers without
// building a tree, and skips what the audit does not read. encoding/json
// decoding of kube-proxy's table into generic values ran at ~15 MB/s and
// held 200 MB for 100k endpoints; this reads the same in one pass over the
// bytes. Errors carry the byte offset.
type jscan struct {
	b     []byte
	i     int
	depth int
}

// maxJSONDepth bounds nesting (kube-proxy's tables nest about 10 deep), so
// a hostile document cannot exhaust the stack.
const maxJSONDepth = 64

func (s *jscan) enter() error {
	s.depth++
	if s.depth > maxJSONDepth {
		return s.errf("nested deeper than %d levels", maxJSONDepth)
	}
	return nil
}

func (s *jscan) errf(format string, args ...any) error {
	return fmt.Errorf("nft JSON at byte %d: %s", s.i, fmt.Sprintf(format, args...))
}

func (s *jscan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\n', '\t', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the next non-space byte, or 0 at the end.
func (s *jscan) peek() byte {
	s.ws()
	if s.i >= len(s.b) {
		return 0
	}
	return s.b[s.i]
}

func (s *jscan) expect(c byte) error {
	if s.peek() != c {
		if s.i >= len(s.b) {
			return s.errf("unexpected end of input, expected %q", c)
		}
		return s.errf("expected %q, found %q", c, s.b[s.i])
	}
	s.i++
	return nil
}

// object calls fn for each member; fn must consume the value.
func (s *jscan) object(fn func(key []byte) error) error {
	if err := s.expect('{'); err != nil {
		return err
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer func() { s.depth-- }()
	if s.peek() == '}' {
		s.i++
		return nil
	}
	for {
		key, err := s.str()
		if err != nil {
			return err
		}
		if err := s.expect(':'); err != nil {
			return err
		}
		if err := fn(key); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return s.errf("expected ',' or '}' in an object")
		}
	}
}

// array calls fn for each element; fn must consume it.
func (s *jscan) array(fn func(i int) error) error {
	if err := s.expect('['); err != nil {
		return err
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer func() { s.depth-- }()
	if s.peek() == ']' {
		s.i++
		return nil
	}
	for n := 0; ; n++ {
		if err := fn(n); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case ']':
			s.i++
			return nil
		default:
			return s.errf("expected ',' or ']' in an array")
		}
	}
}

// str returns a string's content. It aliases the input unless the string
// has escapes.
func (s *jscan) str() ([]byte, error) {
	if err := s.expect('"'); err != nil {
		return nil, err
	}
	start := s.i
	j := bytes.IndexByte(s.b[start:], '"')
	if j < 0 {
		return nil, s.errf("unterminated string")
	}
	if bytes.IndexByte(s.b[start:start+j], '\\') < 0 {
		s.i = start + j + 1
		return s.b[start : start+j], nil
	}
	// Escapes: find the real end, then let strconv unquote it.
	k := start
	for ; k < len(s.b); k++ {
		if s.b[k] == '\\' {
			k++
			continue
		}
		if s.b[k] == '"' {
			break
		}
	}
	if k >= len(s.b) {
		return nil, s.errf("unterminated string")
	}
	u, err := strconv.Unquote(string(s.b[start-1 : k+1]))
	if err != nil {
		return nil, s.errf("bad string escape")
	}
	s.i = k + 1
	return []byte(u), nil
}

// int reads an integer.
func (s *jscan) int() (int64, error) {
	s.ws()
	start := s.i
	if s.i < len(s.b) && s.b[s.i] == '-' {
		s.i++
	}
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		s.i++
	}
	n, err := strconv.ParseInt(string(s.b[start:s.i]), 10, 64)
	if err != nil {
		return 0, s.errf("expected an integer")
	}
	return n, nil
}

// skip passes over one value of any kind, checking its structure.
func (s *jscan) skip() error {
	switch c := s.peek(); {
	case c == '{':
		return s.object(func([]byte) error { return s.skip() })
	case c == '[':
		return s.array(func(int) error { return s.skip() })
	case c == '"':
		_, err := s.str()
		return err
	case c == '-' || (c >= '0' && c <= '9'):
		digits := 0
	num:
		for ; s.i < len(s.b); s.i++ {
			switch c := s.b[s.i]; {
			case c >= '0' && c <= '9':
				digits++
			case c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E':
			default:
				break num
			}
		}
		if digits == 0 {
			return s.errf("bad number")
		}
		return nil
	default:
		for _, lit := range []string{"true", "false", "null"} {
			if bytes.HasPrefix(s.b[s.i:], []byte(lit)) {
				s.i += len(lit)
				return nil
			}
		}
		if s.i >= len(s.b) {
			return s.errf("unexpected end of input")
		}
		r, _ := utf8.DecodeRune(s.b[s.i:])
		return s.errf("unexpected %q", r)
	}
}

// span skips one value and returns its bytes, for reading later.
func (s *jscan) span() ([]byte, error) {
	s.ws()
	start := s.i
	if err := s.skip(); err != nil {
		return nil, err
	}
	return s.b[start:s.i], nil
}

// at returns a scanner over a span.
func at(b []byte) *jscan { return &jscan{b: b} }
