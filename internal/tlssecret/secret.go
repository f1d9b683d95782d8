// Package tlssecret keeps the aggregator's TLS key pair in a Secret it makes on
// first start and reads back, so that the chart holds no key. It is apart
// from tlsfile so that the collector, which only loads a CA bundle, does
// not link client-go.
package tlssecret

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// SecretPair is a certificate and key kept in a Secret that the aggregator
// makes itself when it is absent: a CA and a certificate it signs for
// Names, both ECDSA P-256, in a kubernetes.io/tls Secret with ca.crt for
// the collectors. Made in the cluster rather than by the chart, the pair
// is the same whoever renders the chart and however often (`helm
// template`, Argo CD), and no private key passes through a Helm release.
// Replicas racing to make it agree on the first one written. The Secret is
// read again every Poll; a replacement (an operator deleted it to rotate,
// or filled it from elsewhere) is served from then on.
type SecretPair struct {
	Client          kubernetes.Interface
	Namespace, Name string
	// Names the certificate is for (the Service names collectors dial).
	Names    []string
	Validity time.Duration
	// Poll is how often the Secret is read again; zero means 30 s.
	Poll time.Duration
	// Reloaded, when not nil, hears of each new pair or failed read.
	Reloaded func(notAfter time.Time, err error)

	mu   sync.Mutex
	cert *tls.Certificate
	ca   *x509.CertPool // the Secret's ca.crt; nil without one
	sum  [32]byte       // of the Secret's pair in use
}

// Ensure reads the Secret, making it first when it does not exist.
func (s *SecretPair) Ensure(ctx context.Context) error {
	secrets := s.Client.CoreV1().Secrets(s.Namespace)
	sec, err := secrets.Get(ctx, s.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		var made *corev1.Secret
		if made, err = s.generate(); err != nil {
			return err
		}
		sec, err = secrets.Create(ctx, made, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) { // another replica was first
			sec, err = secrets.Get(ctx, s.Name, metav1.GetOptions{})
		}
	}
	if err != nil {
		return fmt.Errorf("TLS Secret %s/%s: %w", s.Namespace, s.Name, err)
	}
	return s.use(sec)
}

// use serves the Secret's pair if it changed and loads.
func (s *SecretPair) use(sec *corev1.Secret) error {
	sum := sha256.Sum256(append(append(append([]byte{}, sec.Data[corev1.TLSCertKey]...), sec.Data[corev1.TLSPrivateKeyKey]...), sec.Data["ca.crt"]...))
	s.mu.Lock()
	same := s.cert != nil && sum == s.sum
	s.mu.Unlock()
	if same {
		return nil
	}
	cert, err := tls.X509KeyPair(sec.Data[corev1.TLSCertKey], sec.Data[corev1.TLSPrivateKeyKey])
	if err == nil && cert.Leaf == nil {
		cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0])
	}
	if err != nil {
		// The pair in use stays; Run reports the failure.
		return fmt.Errorf("TLS Secret %s/%s holds no usable tls.crt and tls.key: %w", s.Namespace, s.Name, err)
	}
	var ca *x509.CertPool
	if b := sec.Data["ca.crt"]; len(b) > 0 {
		if ca = x509.NewCertPool(); !ca.AppendCertsFromPEM(b) {
			ca = nil
		}
	}
	s.mu.Lock()
	s.cert, s.ca, s.sum = &cert, ca, sum
	s.mu.Unlock()
	if s.Reloaded != nil {
		s.Reloaded(cert.Leaf.NotAfter, nil)
	}
	return nil
}

// Run reads the Secret every Poll until ctx ends; one that is gone is
// made anew.
func (s *SecretPair) Run(ctx context.Context) {
	poll := s.Poll
	if poll <= 0 {
		poll = 30 * time.Second
	}
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := s.Ensure(ctx); err != nil && s.Reloaded != nil && ctx.Err() == nil {
			s.Reloaded(s.NotAfter(), err)
		}
	}
}

// GetCertificate is for tls.Config.GetCertificate.
func (s *SecretPair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cert == nil {
		return nil, errors.New("no TLS certificate yet")
	}
	return s.cert, nil
}

// CAPool is the Secret's ca.crt as of the last read (nil without one): the
// replicas verify one another's internal API with it.
func (s *SecretPair) CAPool() *x509.CertPool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ca
}

// NotAfter is when the certificate in use expires (zero before the first).
func (s *SecretPair) NotAfter() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cert == nil {
		return time.Time{}
	}
	return s.cert.Leaf.NotAfter
}

// generate makes the CA and the certificate, as a Secret.
func (s *SecretPair) generate() (*corev1.Secret, error) {
	if len(s.Names) == 0 || s.Validity <= 0 {
		return nil, errors.New("a TLS Secret to make needs names and a validity")
	}
	now := time.Now().Add(-time.Hour) // clocks differ a little
	serial := func() *big.Int {
		n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
		return n
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	ca := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: s.Name + " CA"}, NotBefore: now, NotAfter: now.Add(s.Validity),
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	leaf := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: s.Names[0]}, DNSNames: s.Names, NotBefore: now, NotAfter: now.Add(s.Validity),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	enc := func(typ string, der []byte) []byte { return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}) }
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, Labels: map[string]string{"app.kubernetes.io/part-of": "proxyaudit"},
			Annotations: map[string]string{"proxyaudit.io/generated-by": "proxyaudit-aggregator: delete this Secret to rotate the CA and certificate"}},
		Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: enc("CERTIFICATE", leafDER), corev1.TLSPrivateKeyKey: enc("EC PRIVATE KEY", keyDER), "ca.crt": enc("CERTIFICATE", caDER)},
	}, nil
}
