package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestFlagsAndHelp(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out, &out); code != 0 || !strings.Contains(out.String(), "[NODE_NAME]") {
		t.Errorf("--help: exit %d\n%s", code, out.String())
	}
	t.Setenv("NODE_NAME", "")
	junk := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(junk, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, args := range map[string][]string{
		"no node":                          {"--aggregator", "a:1"},
		"no aggregator":                    {"--node-name", "n"},
		"bad mode":                         {"--node-name", "n", "--aggregator", "a:1", "--mode", "userspace"},
		"short":                            {"--node-name", "n", "--aggregator", "a:1", "--interval", "10ms"},
		"delete without reading conntrack": {"--node-name", "n", "--aggregator", "a:1", "--conntrack-delete", "--conntrack-interval", "0"},
		// A CA not there yet is waited for (the aggregator makes it on its
		// first start); one that is there must be a CA.
		"junk CA": {"--node-name", "n", "--aggregator", "a:1", "--ca-file", junk},
	} {
		var errb bytes.Buffer
		if code := run(args, &errb, &errb); code != 2 || !strings.Contains(errb.String(), "proxyaudit-collector:") {
			t.Errorf("%s: exit %d: %q", name, code, errb.String())
		}
	}
}

// The host kernel here has no IPVS (the VM e2e in internal/e2e reads a
// real table): --mode ipvs must say so, not hang or print an empty table.
func TestOnceIPVSWithoutKernelSupport(t *testing.T) {
	if _, err := os.Stat("/proc/net/ip_vs"); err == nil {
		t.Skip("this kernel has IPVS")
	}
	var out, errb bytes.Buffer
	code := run([]string{"--once", "--mode", "ipvs"}, &out, &errb)
	if code != 2 || !strings.Contains(errb.String(), "read ipvs rules: open IPVS netlink") || !strings.Contains(errb.String(), "ip_vs module") {
		t.Errorf("exit %d: %q", code, errb.String())
	}
}

func TestTLSServerName(t *testing.T) {
	for in, want := range map[string]string{
		"proxyaudit-aggregator-headless.proxyaudit.svc:9443": "proxyaudit-aggregator-headless.proxyaudit.svc",
		"198.18.1.1:9443,agg.example:9443":                   "agg.example",
		"198.18.1.1:9443,[2001:db8::1]:9443":                 "",
	} {
		if got := dnsHost(in); got != want {
			t.Errorf("dnsHost(%q) = %q, want %q", in, got, want)
		}
	}
	// A CA with replicas named only by IP cannot verify anything: say so.
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ca"}, IsCA: true, BasicConstraintsValid: true,
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ca := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	var errb bytes.Buffer
	if code := run([]string{"--node-name", "n", "--aggregator", "198.18.1.1:9443", "--ca-file", ca}, &errb, &errb); code != 2 || !strings.Contains(errb.String(), "--tls-server-name") {
		t.Errorf("IP-only aggregator with a CA: exit %d: %q", code, errb.String())
	}
}

// Every flag's help is a sentence or two, and docs/collector.md says how it
// works: a flag added without its account there fails here.
func TestEveryFlagIsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/collector.md")
	if err != nil {
		t.Fatal(err)
	}
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	o := defaultOptions()
	o.addFlags(fs)
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		n++
		if !strings.Contains(string(doc), "`--"+f.Name) {
			t.Errorf("--%s is not in docs/collector.md", f.Name)
		}
		if len(f.Usage) > 220 || strings.Count(f.Usage, ". ") > 1 {
			t.Errorf("--%s: help of %d bytes; say it in a sentence or two and the rest in docs/collector.md", f.Name, len(f.Usage))
		}
	})
	if n < 15 {
		t.Errorf("only %d flags registered", n)
	}
}

// What the collector cannot run with is refused before it starts, saying
// which flag and why.
func TestOptionsValidate(t *testing.T) {
	base := func() options {
		o := defaultOptions()
		o.node, o.aggregator = "n", "agg.example:9443"
		return o
	}
	if o := base(); o.validate() != nil {
		t.Fatalf("the defaults with a node and an aggregator: %v", o.validate())
	}
	for name, c := range map[string]struct {
		change func(*options)
		want   string
	}{
		"buffer":           {func(o *options) { o.notifyMiB = 2048 }, "--notification-buffer-mib"},
		"nft reader":       {func(o *options) { o.nftReader = "nft" }, "--nft-reader"},
		"iptables reader":  {func(o *options) { o.iptReader = "xtables" }, "--iptables-reader"},
		"full read":        {func(o *options) { o.fullRead = time.Second }, "--full-read-interval"},
		"budget":           {func(o *options) { o.readBudget = 2 }, "--read-budget"},
		"conntrack":        {func(o *options) { o.ctInterval = time.Second }, "--conntrack-interval"},
		"tiny messages":    {func(o *options) { o.maxMessageBytes = 10 }, "--max-message-bytes"},
		"snapshot running": {func(o *options) { o.snapshot = "x.json" }, "--snapshot"},
		"mode":             {func(o *options) { o.mode = "userspace" }, "userspace"},
	} {
		o := base()
		c.change(&o)
		if err := o.validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error naming %s", name, err, c.want)
		}
	}
	// --once needs neither a node nor an aggregator.
	o := defaultOptions()
	o.node, o.aggregator, o.once, o.snapshot = "", "", true, "x.json"
	if err := o.validate(); err != nil {
		t.Errorf("--once --snapshot: %v", err)
	}
}

// --version prints the build and exits, whatever else is missing.
func TestVersionFlag(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"--version"}, &out, &errb); code != 0 || !strings.HasPrefix(out.String(), "proxyaudit-collector (devel) (") {
		t.Errorf("exit %d, printed %q %q", code, out.String(), errb.String())
	}
}
