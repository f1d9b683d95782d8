package collector

// MinReadGap is minReadGap, for the tests of package collector_test.
const MinReadGap = minReadGap

// ReadWait, for the tests of package collector_test.
var ReadWait = readWait
