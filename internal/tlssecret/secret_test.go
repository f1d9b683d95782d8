package tlssecret

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/pem"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// Replicas make one pair between them, ECDSA P-256, for the names, signed
// by the CA in the Secret; a replacement is served, a broken one is not.
func TestSecretPair(t *testing.T) {
	client := fake.NewClientset()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	names := []string{"proxyaudit-aggregator.pa.svc", "proxyaudit-aggregator"}
	pair := func() *SecretPair {
		return &SecretPair{Client: client, Namespace: "pa", Name: "tls", Names: names, Validity: 24 * time.Hour, Poll: 20 * time.Millisecond}
	}
	a, b := pair(), pair()
	for _, p := range []*SecretPair{a, b} {
		if err := p.Ensure(ctx); err != nil {
			t.Fatal(err)
		}
	}
	ca, _ := a.GetCertificate(nil)
	cb, _ := b.GetCertificate(nil)
	if !ca.Leaf.Equal(cb.Leaf) {
		t.Fatal("two replicas serve different certificates")
	}
	if k, ok := ca.Leaf.PublicKey.(*ecdsa.PublicKey); !ok || k.Curve != elliptic.P256() || ca.Leaf.DNSNames[0] != names[0] {
		t.Errorf("certificate: key %T, names %v", ca.Leaf.PublicKey, ca.Leaf.DNSNames)
	}
	sec, err := client.CoreV1().Secrets("pa").Get(ctx, "tls", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(sec.Data["ca.crt"])
	root, err := x509.ParseCertificate(block.Bytes)
	if err != nil || ca.Leaf.CheckSignatureFrom(root) != nil || !root.IsCA {
		t.Errorf("ca.crt does not sign the certificate: %v", err)
	}

	var failures atomic.Int32
	a.Reloaded = func(_ time.Time, err error) {
		if err != nil {
			failures.Add(1)
		}
	}
	go a.Run(ctx)
	// Broken replacement: the pair in use stays, the failure is heard.
	sec.Data["tls.key"] = []byte("not a key")
	if _, err := client.CoreV1().Secrets("pa").Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); failures.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a broken Secret was not reported")
		}
	}
	if c, err := a.GetCertificate(nil); err != nil || !c.Leaf.Equal(ca.Leaf) {
		t.Error("a broken Secret replaced the pair in use")
	}
	// Deleted to rotate: made anew and served.
	if err := client.CoreV1().Secrets("pa").Delete(ctx, "tls", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if c, _ := a.GetCertificate(nil); !c.Leaf.Equal(ca.Leaf) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a deleted Secret was not made anew and served")
		}
	}
}
