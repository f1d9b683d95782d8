package localcluster

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Registry is a genuine OCI registry (distribution, built from its Go
// module by deploy/k8s-tools/release-tool.sh) serving TLS with a CA of its
// own: where a release is pushed and real nodes pull from.
type Registry struct {
	// Addr is host:port; CAFile the CA that verifies it (PEM).
	Addr, CAFile string
	// Transport trusts the CA.
	Transport http.RoundTripper
	proc      *process
	log       string
}

// StartRegistry runs a registry on host (an address of this machine: the
// loopback, or APIServerIP where real nodes pull from it), its storage,
// certificates and log under dir.
func StartRegistry(ctx context.Context, dir, host string) (*Registry, error) {
	bin, err := ReleaseTool(ctx, "registry")
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	r := &Registry{CAFile: filepath.Join(dir, "ca.crt"), log: filepath.Join(dir, "registry.log")}
	cert, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	pool, err := servingPKI(host, r.CAFile, cert, key)
	if err != nil {
		return nil, err
	}
	// distribution cannot say which port it took: pick a free one.
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, err
	}
	r.Addr = l.Addr().String()
	l.Close()
	cfg := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: %s
http:
  addr: %s
  tls:
    certificate: %s
    key: %s
`, filepath.Join(dir, "data"), r.Addr, cert, key)), 0o644); err != nil {
		return nil, err
	}
	r.proc, err = startProcess("registry", r.log, []string{bin, "serve", cfg}, "OTEL_TRACES_EXPORTER=none")
	if err != nil {
		return nil, err
	}
	r.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	hc := &http.Client{Transport: r.Transport, Timeout: time.Second}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		resp, err := hc.Get("https://" + r.Addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return r, nil
			}
		}
		if r.proc.exited() || time.Now().After(deadline) {
			r.Stop()
			return nil, fmt.Errorf("the registry at %s did not answer (%v):\n%s", r.Addr, err, tailFile(r.log, 20))
		}
	}
}

// ReleaseTool builds (or finds cached) one of the release's tools —
// registry, krew, cyclonedx-gomod, cosign — with
// deploy/k8s-tools/release-tool.sh, and returns its path.
func ReleaseTool(ctx context.Context, name string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, filepath.Join(root, "deploy/k8s-tools/release-tool.sh"), name).Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return "", fmt.Errorf("build %s: %w\n%s", name, err, ee.Stderr)
		}
		return "", fmt.Errorf("build %s: %w", name, err)
	}
	return strings.TrimSpace(string(out)), nil
}

// Stop ends the registry.
func (r *Registry) Stop() { r.proc.stop(5 * time.Second) }

// Log is the registry's last log lines.
func (r *Registry) Log() string { return tailFile(r.log, 40) }

// servingPKI writes a CA of its own (caFile) and a serving certificate
// for host signed by it (certFile, keyFile), and returns a pool trusting
// the CA.
func servingPKI(host, caFile, certFile, keyFile string) (*x509.CertPool, error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "proxyaudit-localcluster registry CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(48 * time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: host}, NotBefore: now.Add(-time.Hour),
		NotAfter: now.Add(48 * time.Hour), IPAddresses: []net.IP{net.ParseIP(host)}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	for _, f := range []struct {
		path, typ string
		der       []byte
	}{{caFile, "CERTIFICATE", caDER}, {certFile, "CERTIFICATE", der}, {keyFile, "EC PRIVATE KEY", kb}} {
		if err := os.WriteFile(f.path, pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: f.der}), 0o600); err != nil {
			return nil, err
		}
	}
	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	return pool, nil
}

// TrustRegistry makes every real node's containerd (and every one added
// later) pull from r, verifying it with r's CA: a hosts.toml in the
// node's certs.d, as an operator configures a private registry.
func (c *Cluster) TrustRegistry(r *Registry) error {
	ca, err := os.ReadFile(r.CAFile)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.registries = append(c.registries, trustedRegistry{addr: r.Addr, ca: ca})
	nodes := make([]*Node, 0, len(c.nodes))
	for _, n := range c.nodes {
		if n.real != nil {
			nodes = append(nodes, n)
		}
	}
	c.mu.Unlock()
	for _, n := range nodes {
		if err := writeHostsTOML(n.real.dir, trustedRegistry{addr: r.Addr, ca: ca}); err != nil {
			return err
		}
	}
	return nil
}

type trustedRegistry struct {
	addr string
	ca   []byte
}

// writeHostsTOML writes containerd's hosts.toml for one registry under a
// real node's certs.d (containerd reads it at each pull).
func writeHostsTOML(nodeDir string, r trustedRegistry) error {
	dir := filepath.Join(nodeDir, "certs.d", r.addr)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, r.ca, 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte(fmt.Sprintf(`server = "https://%s"

[host."https://%s"]
  capabilities = ["pull", "resolve"]
  ca = %q
`, r.addr, r.addr, ca)), 0o644)
}
