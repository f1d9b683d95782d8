package aggregator

// RejectReason is why a stream is refused or cut: the value of
// proxyaudit_stream_rejected_total's reason label.
type RejectReason string

// Reasons a stream is refused or cut.
const (
	ReasonAuth      RejectReason = "auth"
	ReasonTooLarge  RejectReason = "too_large"
	ReasonMalformed RejectReason = "malformed"
	ReasonProtocol  RejectReason = "protocol"
	ReasonInvalid   RejectReason = "invalid_report"
	ReasonReplay    RejectReason = "replay"
	ReasonRate      RejectReason = "rate"
	ReasonTimeout   RejectReason = "timeout"
	// ReasonBusy: the budget of token reviews is spent; the collector
	// retries with its backoff.
	ReasonBusy RejectReason = "busy"
	// ReasonUnauthenticatedLimit: too many connections not yet past their
	// hello, overall or from the source address; closed unread.
	ReasonUnauthenticatedLimit RejectReason = "unauthenticated_limit"
)
