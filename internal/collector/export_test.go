package collector

// MinReadGap is minReadGap, for the tests of package collector_test.
const MinReadGap = minReadGap

// ReadWait and CPUTime, for the tests of package collector_test.
var (
	ReadWait = readWait
	CPUTime  = cpuTime
)
