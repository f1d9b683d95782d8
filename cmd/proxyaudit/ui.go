package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/proxyaudit/proxyaudit/internal/api"
)

const uiUsage = `Serves the aggregator's read-only status page on this machine: the fleet's
heatmap, each node's rules and kube-proxy's own account, the incidents. It
reaches the aggregator as report does, through the API server's service proxy
with your kubeconfig and kubectl's connection flags (and a short-lived reader
token it mints and renews), or at --aggregator. Open the address it prints;
Ctrl-C stops it.

With several contexts (or --all-contexts) it serves a page of the clusters
side by side (each one's nodes by state and the nodes to look at, read
through its own API server; one that cannot be read says why) linking into
each cluster's own pages.`

func (c *cli) uiCmd() *cobra.Command {
	var a *access
	var all bool
	var listen string
	var accept []string
	cmd := &cobra.Command{
		Use:   "ui",
		Short: "Serve the aggregator's status page on this machine",
		Long:  uiUsage,
		Example: `  kubectl proxyaudit ui
  kubectl proxyaudit ui --listen 127.0.0.1:9000 --context prod-eu --context prod-us`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c.code = c.ui(cmd, a, all, listen, accept)
			return nil
		},
	}
	a = accessFlags(cmd.Flags(), true)
	cmd.Flags().BoolVar(&all, "all-contexts", false, "every context of the kubeconfig, side by side (see --context)")
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:8484", "address to serve the page on; keep it on loopback: whoever reaches it reads what your credentials may")
	cmd.Flags().StringArrayVar(&accept, "accept-host", nil, "a host name the page may be asked for besides localhost and IP addresses (repeatable); others are refused, against DNS rebinding")
	a.complete(cmd)
	return cmd
}

func (c *cli) ui(cmd *cobra.Command, access *access, all bool, listen string, accept []string) int {
	for i, h := range accept {
		if err := checkHost(h); err != nil {
			return c.fail(cmd, "--accept-host: %v", err)
		}
		accept[i] = strings.ToLower(h)
	}
	var h http.Handler
	page := "/ui/"
	if all || len(access.contexts) > 1 {
		contexts, err := access.clusters(all)
		if err != nil {
			return c.fail(cmd, "%v", err)
		}
		h, page = access.clustersUI(contexts, c.stderr), "/clusters/"
	} else {
		if err := access.single("ui"); err != nil {
			return c.fail(cmd, "%v", err)
		}
		var err error
		if h, err = access.uiProxy(c.stderr); err != nil {
			return c.fail(cmd, "%v", err)
		}
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return c.fail(cmd, "--listen: %v", err)
	}
	if host, _, _ := net.SplitHostPort(ln.Addr().String()); !net.ParseIP(host).IsLoopback() {
		fmt.Fprintf(c.stderr, "%s: warning: serving on %s, not loopback: whoever reaches it reads the findings with your credentials\n", cmd.CommandPath(), ln.Addr())
	}
	fmt.Fprintf(c.stdout, "proxyaudit status page: http://%s%s (Ctrl-C to stop)\n", ln.Addr(), page)
	srv := &http.Server{Handler: hostGuard(accept, h), ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(shut)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return c.fail(cmd, "%v", err)
	}
	return exitClean
}

// checkHost refuses an --accept-host that is not a bare host name.
func checkHost(v string) error {
	if v == "" || strings.ContainsAny(v, ":/ ") {
		return fmt.Errorf("%q: want a host name without port or scheme", v)
	}
	return nil
}

// hostGuard serves only requests that name this machine: a Host (and an
// Origin, when a browser sends one) that is an IP address, localhost, or
// a name in accept. A web page the SRE opens can point a name of its own
// at 127.0.0.1 (DNS rebinding) and then read the page as same-origin; the
// browser still sends that name as Host, and it is refused here, before
// the reader token is attached. An IP address cannot be rebound.
func hostGuard(accept []string, next http.Handler) http.Handler {
	ok := func(hostport string) bool {
		host := hostport
		if h, _, err := net.SplitHostPort(hostport); err == nil {
			host = h
		}
		host = strings.ToLower(strings.TrimSuffix(strings.Trim(host, "[]"), "."))
		if host == "localhost" || strings.HasSuffix(host, ".localhost") {
			return true
		}
		if _, err := netip.ParseAddr(host); err == nil {
			return true
		}
		return slices.Contains(accept, host)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !ok(r.Host) {
			http.Error(w, fmt.Sprintf("proxyaudit ui: refused: the request names host %q, which is not this machine's address or localhost (a web page may be trying to read the findings through DNS rebinding); open the address proxyaudit ui printed, or pass --accept-host %s", r.Host, hostOnly(r.Host)), http.StatusForbidden)
			return
		}
		if o := r.Header.Get("Origin"); o != "" {
			u, err := url.Parse(o)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || !ok(u.Host) || u.Host != r.Host {
				http.Error(w, fmt.Sprintf("proxyaudit ui: refused: a request from another origin (%q)", o), http.StatusForbidden)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func hostOnly(hostport string) string {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		return h
	}
	return hostport
}

// uiProxy forwards GETs of /ui/ to the aggregator: at --aggregator, or
// through the API server's service proxy with the kubeconfig's
// credentials and a reader token, minted for ten minutes and renewed
// before it runs out.
func (a *access) uiProxy(stderr io.Writer) (http.Handler, error) {
	var target *url.URL
	var transport http.RoundTripper = http.DefaultTransport
	token := func() string { return "" }
	header := "Authorization"
	if *a.url != "" {
		u, err := url.Parse(strings.TrimSuffix(*a.url, "/"))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
			return nil, fmt.Errorf("--aggregator %q: want an http(s) URL", *a.url)
		}
		target = u
		if *a.tokenFile != "" {
			b, err := os.ReadFile(*a.tokenFile)
			if err != nil {
				return nil, fmt.Errorf("--token-file: %v", err)
			}
			t := "Bearer " + strings.TrimSpace(string(b))
			token = func() string { return t }
		}
	} else {
		cfg, ns, err := a.config(a.context())
		if err != nil {
			return nil, fmt.Errorf("%v (or pass --aggregator URL)", err)
		}
		if transport, err = rest.TransportFor(cfg); err != nil {
			return nil, fmt.Errorf("kubeconfig: %v", err)
		}
		host, err := url.Parse(cfg.Host)
		if err != nil {
			return nil, fmt.Errorf("kubeconfig server %q: %v", cfg.Host, err)
		}
		target = host.JoinPath("api/v1/namespaces", ns, "services", "http:"+*a.service+":"+*a.port, "proxy")
		target.Path = "/" + strings.TrimPrefix(target.Path, "/") // JoinPath on a bare host leaves it relative
		client, err := noRedirectClient(cfg)
		if err != nil {
			return nil, err
		}
		if *a.reader != "" {
			header = api.TokenHeader
			token = a.readerTokens(client, ns, stderr)
		}
	}
	p := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Host = target.Host
			r.Out.Header.Del("Cookie")
			if t := token(); t != "" {
				r.Out.Header.Set(header, t)
			}
		},
		Transport: transport,
		// A redirect is passed to no one: the browser would follow it to
		// wherever whatever answers behind the Service chose.
		ModifyResponse: func(resp *http.Response) error {
			if resp.StatusCode >= 300 && resp.StatusCode < 400 {
				return fmt.Errorf("%w (%s to %q)", errRedirect, resp.Status, resp.Header.Get("Location"))
			}
			// Whatever the aggregator sent: its pages are framed by no one,
			// and read by no other origin.
			h := resp.Header
			h.Set("X-Frame-Options", "DENY")
			h.Set("Cross-Origin-Resource-Policy", "same-origin")
			h.Set("X-Content-Type-Options", "nosniff")
			h.Set("Referrer-Policy", "no-referrer")
			h.Add("Content-Security-Policy", "frame-ancestors 'none'")
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			http.Error(w, "proxyaudit ui: reaching the aggregator at "+target.Redacted()+": "+err.Error(), http.StatusBadGateway)
		},
	}
	mux := http.NewServeMux()
	mux.Handle("GET /ui/", p)
	mux.Handle("GET /{$}", http.RedirectHandler("/ui/", http.StatusFound))
	return mux, nil
}

// readerTokens returns the current reader token, minting one for ten
// minutes when there is none or it has under five left (the last one, or
// "", when minting fails: the aggregator then says who may read).
func (a *access) readerTokens(client kubernetes.Interface, ns string, stderr io.Writer) func() string {
	var mu sync.Mutex
	var tok string
	var renew time.Time
	return func() string {
		mu.Lock()
		defer mu.Unlock()
		if tok != "" && time.Now().Before(renew) {
			return tok
		}
		ctx, cancel := context.WithTimeout(context.Background(), *a.timeout)
		defer cancel()
		exp := int64(600)
		tr, err := client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, *a.reader, &authnv1.TokenRequest{
			Spec: authnv1.TokenRequestSpec{Audiences: []string{*a.audience}, ExpirationSeconds: &exp}}, metav1.CreateOptions{})
		if err != nil {
			fmt.Fprintf(stderr, "proxyaudit ui: minting a reader token for ServiceAccount %s/%s: %v (the chart's report-reader Role lets its bound subjects create it; --reader-service-account names another)\n", ns, *a.reader, err)
			return tok
		}
		tok, renew = tr.Status.Token, time.Now().Add(5*time.Minute)
		return tok
	}
}
