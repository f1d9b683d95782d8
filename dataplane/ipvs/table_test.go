package ipvs_test

import (
	"testing"

	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

// FuzzParse: hostile ipvsadm output is refused or read within the
// readers' bounds (the captures of genuine kube-proxy as seeds).
func FuzzParse(f *testing.F) {
	readertest.Seeds(f, "../../audit/testdata/ipvs/*/ipvs-a.save")
	readertest.Seeds(f, "../../audit/testdata/ipvs/*/ipvs-a.list", "-A -t 1.2.3.4:80 -s rr -p 600\n-a -t 1.2.3.4:80 -r 5.6.7.8:80 -m -w 0\n")
	readertest.Fuzz(f, ipvs.Parse)
}
