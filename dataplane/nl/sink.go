package nl

// Sink takes the nf_tables notifications a GenSignal receives anyway
// (NFNLGRP_NFTABLES): message type, netlink flags (NLM_F_APPEND marks an
// appended rule) and body, in the order the kernel sent them; Lost says
// some were dropped (ENOBUFS).
//
// A sink that also has Subscribed(bool) is told when notifications start
// to flow to it and when the subscription breaks (none will come any
// more).
type Sink interface {
	Note(typ, flags uint16, data []byte)
	Lost()
}
