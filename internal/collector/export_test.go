package collector

// MinReadGap is minReadGap, for the tests of package collector_test.
const MinReadGap = minReadGap

// ReadWait and CPUTime, for the tests of package collector_test.
var (
	ReadWait = readWait
	CPUTime  = cpuTime
)

// caughtUp says whether a sink has heard everything up to the commit of
// generation tok, or has lost a notification on the way (then the next
// read is whole and need not wait: under load, -race above all, the
// socket's buffer can overflow and the NEWGEN itself be among the lost).
func (b *notesBase) caughtUp(tok uint64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lost || uint64(b.gen) == tok
}
