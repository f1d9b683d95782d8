package iptables

// ruleMirror is one chain's rules by their kernel handles, in order: what
// the reader keeps of the chains it follows from notifications instead of
// dumping (see chainNotes). Applying a notification twice is harmless (a
// rule that is there is not added again, one that is gone not removed),
// so notifications of commits a dump already shows can be applied on top
// of it.
type ruleMirror struct {
	head, tail uint64 // 0: none (the kernel's handles start at 1)
	nodes      map[uint64]*mirrorNode
}

type mirrorNode struct {
	prev, next uint64
	rule       Rule
}

func newRuleMirror() *ruleMirror { return &ruleMirror{nodes: map[uint64]*mirrorNode{}} }

// mirrorOf builds a mirror from a chain's rules and their handles.
func mirrorOf(rules []Rule, handles []uint64) *ruleMirror {
	m := newRuleMirror()
	for i, r := range rules {
		m.insert(handles[i], m.tail, m.tail != 0, r)
	}
	return m
}

// add puts a new rule where a notification says: after the rule with
// handle pos (hasPos), else at the end (appended) or the start. It fails
// when pos is not in the mirror.
func (m *ruleMirror) add(handle, pos uint64, hasPos, appended bool, r Rule) bool {
	if handle == 0 || hasPos && (pos == 0 || pos == handle) {
		// The kernel numbers rules from 1, and a rule goes after another
		// one: a change that says otherwise is not the kernel's. The
		// chain is dumped instead.
		return false
	}
	if _, ok := m.nodes[handle]; ok {
		return true // shown already
	}
	switch {
	case hasPos:
		if _, ok := m.nodes[pos]; !ok {
			return false
		}
		m.insert(handle, pos, true, r)
	case appended:
		m.insert(handle, m.tail, m.tail != 0, r)
	default:
		m.insert(handle, 0, false, r)
	}
	return true
}

// insert puts a rule after the rule with handle after (at the start when
// !afterOK).
func (m *ruleMirror) insert(handle, after uint64, afterOK bool, r Rule) {
	n := &mirrorNode{rule: r}
	if !afterOK {
		n.next = m.head
		if m.head != 0 {
			m.nodes[m.head].prev = handle
		} else {
			m.tail = handle
		}
		m.head = handle
	} else {
		p := m.nodes[after]
		n.prev, n.next = after, p.next
		if p.next != 0 {
			m.nodes[p.next].prev = handle
		} else {
			m.tail = handle
		}
		p.next = handle
	}
	m.nodes[handle] = n
}

// del removes the rule with handle, if there.
func (m *ruleMirror) del(handle uint64) {
	n, ok := m.nodes[handle]
	if !ok {
		return
	}
	if n.prev != 0 {
		m.nodes[n.prev].next = n.next
	} else {
		m.head = n.next
	}
	if n.next != 0 {
		m.nodes[n.next].prev = n.prev
	} else {
		m.tail = n.prev
	}
	delete(m.nodes, handle)
}

// rules lists the chain's rules in order.
func (m *ruleMirror) rules() []Rule {
	out := make([]Rule, 0, len(m.nodes))
	for h := m.head; h != 0 && len(out) < len(m.nodes); {
		n := m.nodes[h]
		if n == nil {
			break // (add keeps the list whole; never walk off it)
		}
		out = append(out, n.rule)
		h = n.next
	}
	return out
}
