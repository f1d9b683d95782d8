// Package tlsfile serves TLS material from files that are replaced while
// the process runs: cert-manager renews a Secret, the kubelet updates the
// mounted files (an atomic symlink swap), and the next handshake uses the
// new ones without a restart.
package tlsfile

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"sync"
	"time"
)

// checkEvery bounds how often the files are looked at: a handshake costs
// at most one stat of each per period.
const checkEvery = 10 * time.Second

// KeyPair is a certificate and key read from files, re-read when either
// changes. A replacement that does not load (a half-written Secret) keeps
// the pair in use and is tried again at the next check.
type KeyPair struct {
	certFile, keyFile string
	now               func() time.Time
	// Reloaded, when not nil, hears of each reload or failed one.
	Reloaded func(notAfter time.Time, err error)

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   string // what the files looked like when read
	checked time.Time
}

// LoadKeyPair reads the pair once; it fails as tls.LoadX509KeyPair does.
func LoadKeyPair(certFile, keyFile string) (*KeyPair, error) {
	k := &KeyPair{certFile: certFile, keyFile: keyFile, now: time.Now}
	cert, stamp, err := k.load()
	if err != nil {
		return nil, err
	}
	k.cert, k.stamp, k.checked = cert, stamp, k.now()
	return k, nil
}

func (k *KeyPair) load() (*tls.Certificate, string, error) {
	stamp := k.fileStamp()
	cert, err := tls.LoadX509KeyPair(k.certFile, k.keyFile)
	if err != nil {
		return nil, "", err
	}
	if cert.Leaf == nil && len(cert.Certificate) > 0 {
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, "", err
		}
	}
	return &cert, stamp, nil
}

// fileStamp is the files' modification times and sizes, following
// symlinks (a Secret volume swaps a symlink).
func (k *KeyPair) fileStamp() string {
	var s string
	for _, f := range []string{k.certFile, k.keyFile} {
		if fi, err := os.Stat(f); err == nil {
			s += fmt.Sprintf("%d/%d;", fi.ModTime().UnixNano(), fi.Size())
		} else {
			s += "missing;"
		}
	}
	return s
}

// GetCertificate is for tls.Config.GetCertificate.
func (k *KeyPair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return k.current(), nil
}

// NotAfter is when the certificate in use expires (the files are looked
// at first, so a renewal shows without a handshake).
func (k *KeyPair) NotAfter() time.Time {
	return k.current().Leaf.NotAfter
}

func (k *KeyPair) current() *tls.Certificate {
	k.mu.Lock()
	defer k.mu.Unlock()
	if now := k.now(); now.Sub(k.checked) >= checkEvery {
		k.checked = now
		if k.fileStamp() != k.stamp {
			cert, stamp, err := k.load()
			if err == nil {
				k.cert, k.stamp = cert, stamp
			}
			if k.Reloaded != nil {
				k.Reloaded(k.cert.Leaf.NotAfter, err)
			}
		}
	}
	return k.cert
}

// LoadCA reads a PEM bundle of CA certificates.
func LoadCA(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificates in it", path)
	}
	return pool, nil
}
