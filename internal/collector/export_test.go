package collector

// MinReadGap is minReadGap, for the tests of package collector_test.
const MinReadGap = minReadGap

// ReadGap and CPUTime, for the tests of package collector_test.
var (
	ReadGap = readGap
	CPUTime = cpuTime
)
