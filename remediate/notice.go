package remediate

import "time"

// Notice is what people are told about an action.
type Notice struct {
	Action
	// Evidence is the node's findings, one line each, worst first.
	Evidence []string
	// Since is when the drift began.
	Since time.Time
}

// Notifier tells people (Slack). It must not block: the executor calls it
// inline and detection and repair never wait for a chat service.
type Notifier interface {
	Notify(Notice)
}
