package stream

import (
	"strings"
	"testing"
)

// The stream's compatibility rule (docs/design.md, "Versions on the
// wire"): a collector and an aggregator one minor apart understand each
// other. A newer peer's fields that this version does not know are
// ignored, at every level of a message; an older peer's message, without
// the fields this version added, decodes and validates, the missing
// fields meaning "not said".
func TestNewerAndOlderPeersDecode(t *testing.T) {
	newer := `{"type":"report","futureTop":{"x":1},"report":{"seq":2,"full":false,"futureField":[1,2],
		"reads":{"reads":{"change":3,"future-reason":1},"lastSeconds":0.1,"lastCPUSeconds":0.05,"lastBytes":10,"futureCost":7}}}`
	m, err := Decode([]byte(strings.ReplaceAll(newer, "\n", "")))
	if err != nil {
		t.Fatalf("a newer collector's report: %v", err)
	}
	if m.Report == nil || m.Report.Seq != 2 || m.Report.Reads == nil || m.Report.Reads.Reads["change"] != 3 {
		t.Fatalf("decoded %+v", m.Report)
	}
	if err := m.Report.Reads.Validate(); err != nil {
		t.Errorf("a newer collector's read stats (an unknown reason among them): %v", err)
	}
	// An older collector sends no last-whole-read figures: zero, not an
	// error, and the aggregator shows the last read alone.
	older := `{"type":"report","report":{"seq":1,"full":true,"reads":{"reads":{"resync":1},"lastSeconds":0.2,"lastCPUSeconds":0.1,"lastBytes":100}}}`
	if m, err = Decode([]byte(older)); err != nil {
		t.Fatalf("an older collector's report: %v", err)
	}
	if rs := m.Report.Reads; rs.WholeBytes != 0 || rs.WholeSeconds != 0 || rs.Validate() != nil {
		t.Errorf("an older collector's read stats: %+v, %v", rs, rs.Validate())
	}
	hello := `{"type":"hello","hello":{"node":"n1","token":"t","version":"v0.1.0","intervalSeconds":10,"futureHello":true}}`
	if m, err = Decode([]byte(hello)); err != nil || m.Hello == nil || m.Hello.Version != "v0.1.0" {
		t.Errorf("a newer collector's hello: %+v, %v", m, err)
	}
}
