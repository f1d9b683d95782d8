package main

import (
	"crypto/tls"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

type fixedPair struct{ c *tls.Certificate }

func (p fixedPair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) { return p.c, nil }
func (p fixedPair) NotAfter() time.Time                                           { return p.c.Leaf.NotAfter }

// Sharded replicas refuse to start with a serving certificate the others
// would refuse at every partial read (cert-manager's made for the
// collectors' name only, or signed by another CA than ca.crt).
func TestPeerCertificateFits(t *testing.T) {
	const peers = "pa-aggregator-headless.proxyaudit.svc"
	roots, good := pair(t, "pa-aggregator.proxyaudit.svc", peers)
	if err := peerCertificateFits(fixedPair{good}, roots, peers); err != nil {
		t.Errorf("a certificate naming the peers Service: %v", err)
	}
	_, narrow := pair(t, "pa-aggregator.proxyaudit.svc")
	otherRoots, _ := pair(t, peers)
	for name, c := range map[string]struct {
		pair  servingPair
		roots *x509.CertPool
		want  string
	}{
		"collectors' name only": {fixedPair{narrow}, roots, "add it to the certificate"},
		"another CA":            {fixedPair{good}, otherRoots, "does not verify"},
		"no CA":                 {fixedPair{good}, nil, "ca.crt"},
		"no pair":               {nil, roots, "serving pair"},
	} {
		err := peerCertificateFits(c.pair, c.roots, peers)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, c.want)
		}
	}
}

// pair is testkit.ServingPair with the certificate by reference.
func pair(t *testing.T, names ...string) (*x509.CertPool, *tls.Certificate) {
	pool, cert := testkit.ServingPair(t, names...)
	return pool, &cert
}
