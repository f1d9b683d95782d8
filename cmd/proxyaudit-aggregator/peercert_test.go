package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"strings"
	"testing"
	"time"
)

type fixedPair struct{ c *tls.Certificate }

func (p fixedPair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) { return p.c, nil }
func (p fixedPair) NotAfter() time.Time                                           { return p.c.Leaf.NotAfter }

// A CA and a leaf it signs for names.
func caAndLeaf(t *testing.T, names ...string) (*x509.CertPool, *tls.Certificate) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	return pool, &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

// Sharded replicas refuse to start with a serving certificate the others
// would refuse at every partial read (cert-manager's made for the
// collectors' name only, or signed by another CA than ca.crt).
func TestPeerCertificateFits(t *testing.T) {
	const peers = "pa-aggregator-headless.proxyaudit.svc"
	roots, good := caAndLeaf(t, "pa-aggregator.proxyaudit.svc", peers)
	if err := peerCertificateFits(fixedPair{good}, roots, peers); err != nil {
		t.Errorf("a certificate naming the peers Service: %v", err)
	}
	_, narrow := caAndLeaf(t, "pa-aggregator.proxyaudit.svc")
	otherRoots, _ := caAndLeaf(t, peers)
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
