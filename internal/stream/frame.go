package stream

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"slices"
)

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
// decoding it; n counts the frame with its header. Memory follows the
// bytes that arrive, not the length the header claims: a peer that claims
// 16 MiB and sends four bytes costs a few KiB.
func ReadFrame(r io.Reader, max int) ([]byte, int, error) {
	n, err := ReadHeader(r, max)
	if err != nil {
		return nil, n, err
	}
	body, err := ReadBody(r, n)
	return body, n + 4, err
}

// ReadHeader reads a frame's length: the body's bytes, at most max.
func ReadHeader(r io.Reader, max int) (int, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, err
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n > max {
		return n, fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, n, max)
	}
	return n, nil
}

// ReadBody reads a frame's body of n bytes (its header read), growing
// the buffer as the bytes arrive.
func ReadBody(r io.Reader, n int) ([]byte, error) {
	body := make([]byte, 0, min(n, firstChunk))
	for len(body) < n {
		if len(body) == cap(body) {
			// Four times what came so far: all the copies of a 3 MB
			// snapshot add up to a third of it, and memory stays within
			// four times the bytes received.
			body = slices.Grow(body, min(n-len(body), 3*cap(body)))
		}
		m, err := r.Read(body[len(body):min(n, cap(body))])
		body = body[:len(body)+m]
		if err != nil && len(body) < n {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, fmt.Errorf("truncated message: %w", err)
		}
	}
	return body, nil
}

// firstChunk is what a frame's body gets before its bytes arrive.
const firstChunk = 4 << 10

// Decode decodes a message body.
func Decode(body []byte) (*Message, error) {
	// Every frontend is one JSON object: a small message of empty ones
	// ("{},{},…", 3 bytes each, 112 once decoded) would make the decoder
	// allocate ~40 times the message. Count before decoding.
	// A conntrack pair is up to two (itself, its TCP states).
	if objs := bytes.Count(body, []byte("{")); objs > MaxFrontends+2*MaxConntrackPairs+maxOtherObjects {
		return nil, fmt.Errorf("malformed message: %d JSON objects, more than the %d frontends and %d conntrack pairs a node can have", objs, MaxFrontends, MaxConntrackPairs)
	}
	var m Message
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("malformed message: %v", err)
	}
	return &m, nil
}
