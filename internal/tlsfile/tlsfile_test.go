package tlsfile

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// writePair writes a self-signed ECDSA P-256 certificate with serial and
// validity days, and its key.
func writePair(t *testing.T, dir string, serial int64, days int) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "proxyaudit-aggregator"},
		DNSNames: []string{"proxyaudit-aggregator"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Duration(days) * 24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	// As a Secret volume does: new files, then one rename.
	for name, block := range map[string]*pem.Block{"tls.crt": {Type: "CERTIFICATE", Bytes: der}, "tls.key": {Type: "EC PRIVATE KEY", Bytes: kder}} {
		tmp := filepath.Join(dir, name+".tmp")
		if err := os.WriteFile(tmp, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
}

// served is the serial of the certificate a handshake gets.
func served(t *testing.T, k *KeyPair) int64 {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: k.GetCertificate, MinVersion: tls.VersionTLS12})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
}

// A renewed pair is served from the next check on, without a restart; a
// replacement that does not load keeps the old pair and says so.
func TestKeyPairFollowsItsFiles(t *testing.T) {
	dir := t.TempDir()
	writePair(t, dir, 1, 30)
	k, err := LoadKeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	k.now = func() time.Time { return now }
	var reloads []error
	k.Reloaded = func(_ time.Time, err error) { reloads = append(reloads, err) }
	if s := served(t, k); s != 1 {
		t.Fatalf("serial %d served, want 1", s)
	}
	writePair(t, dir, 2, 90)
	if s := served(t, k); s != 1 {
		t.Errorf("serial %d served before the next check, want 1 (files are looked at every %s)", s, checkEvery)
	}
	now = now.Add(checkEvery)
	if s := served(t, k); s != 2 {
		t.Errorf("serial %d served after the renewal, want 2", s)
	}
	if d := time.Until(k.NotAfter()); d < 89*24*time.Hour {
		t.Errorf("expiry %s away, want the renewed 90 days", d.Round(time.Hour))
	}
	if err := os.WriteFile(filepath.Join(dir, "tls.crt"), []byte("half a Secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	now = now.Add(checkEvery)
	if s := served(t, k); s != 2 {
		t.Errorf("serial %d served after a broken replacement, want the last good 2", s)
	}
	if len(reloads) != 2 || reloads[0] != nil || reloads[1] == nil {
		t.Errorf("reloads reported: %v, want one success and one failure", reloads)
	}
}

func TestLoadCA(t *testing.T) {
	dir := t.TempDir()
	writePair(t, dir, 1, 1)
	if _, err := LoadCA(filepath.Join(dir, "tls.crt")); err != nil {
		t.Error(err)
	}
	if _, err := LoadCA(filepath.Join(dir, "tls.key")); err == nil {
		t.Error("a key file read as a CA bundle")
	}
}
