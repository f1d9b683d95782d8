package collector

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// DefaultKubeProxyMetrics is where kube-proxy serves its metrics by default.
const DefaultKubeProxyMetrics = "http://127.0.0.1:10249/metrics"

// maxMetricsBytes bounds a scrape: kube-proxy's page is about 100 KB.
const maxMetricsBytes = 4 << 20

// ScrapeKubeProxy reads kube-proxy's sync metrics from url. A failure is
// reported in the result, not as an error: the rules are the primary
// signal and a missing metrics endpoint must not stop the collector.
func ScrapeKubeProxy(ctx context.Context, client *http.Client, url string) *stream.KubeProxy {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return &stream.KubeProxy{Error: err.Error()}
	}
	resp, err := client.Do(req)
	if err != nil {
		return &stream.KubeProxy{Error: fmt.Sprintf("scrape kube-proxy metrics: %v", err)}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &stream.KubeProxy{Error: "scrape kube-proxy metrics: " + resp.Status}
	}
	kp, err := parseKubeProxyMetrics(io.LimitReader(resp.Body, maxMetricsBytes))
	if err != nil {
		return &stream.KubeProxy{Error: fmt.Sprintf("parse kube-proxy metrics: %v", err)}
	}
	return kp
}

// parseKubeProxyMetrics picks the sync gauges out of the Prometheus text
// format, taking the newest value across IP families.
func parseKubeProxyMetrics(r io.Reader) (*stream.KubeProxy, error) {
	kp := &stream.KubeProxy{}
	fields := map[string]*float64{
		"kubeproxy_sync_proxy_rules_last_timestamp_seconds":        &kp.LastSync,
		"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": &kp.LastQueued,
		"kubeproxy_sync_proxy_rules_endpoint_changes_pending":      &kp.EndpointChangesPending,
		"kubeproxy_sync_proxy_rules_service_changes_pending":       &kp.ServiceChangesPending,
		"kubeproxy_sync_proxy_rules_endpoint_changes_total":        &kp.EndpointChangesTotal,
	}
	found := 0
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 64<<10)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "kubernetes_build_info{") {
			kp.Version = label(line, "git_version")
			continue
		}
		if !strings.HasPrefix(line, "kubeproxy_sync_proxy_rules_") {
			continue
		}
		name, rest, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(name, '{'); i >= 0 {
			name = name[:i]
			_, rest, _ = strings.Cut(line, "} ")
		}
		dst, ok := fields[name]
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.Fields(rest + " ")[0], 64)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", name, err)
		}
		*dst = max(*dst, v)
		found++
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if found == 0 {
		return nil, fmt.Errorf("no kubeproxy_sync_proxy_rules_* metrics (is this kube-proxy's metrics endpoint?)")
	}
	return kp, nil
}

// label returns a label's value in one exposition-format sample line.
func label(line, name string) string {
	_, rest, ok := strings.Cut(line, name+`="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	if len(v) > 64 {
		return v[:64]
	}
	return v
}

// Listening returns a check of whether kube-proxy runs, by its metrics
// URL's address: false only when the connection is refused (nothing
// listens there). A hung (stopped) kube-proxy still holds its socket and
// the kernel accepts for it; a timeout or any other error cannot tell, and
// counts as running (kube-proxy's rules stay audited).
func Listening(metricsURL string) func(ctx context.Context) bool {
	return func(ctx context.Context) bool {
		u, err := url.Parse(metricsURL)
		if err != nil || u.Hostname() == "" {
			return true
		}
		port := u.Port()
		if port == "" {
			port = "80"
			if u.Scheme == "https" {
				port = "443"
			}
		}
		d := net.Dialer{Timeout: 2 * time.Second}
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort(u.Hostname(), port))
		if err != nil {
			return !errors.Is(err, syscall.ECONNREFUSED)
		}
		conn.Close()
		return true
	}
}

// scrape reads kube-proxy's metrics (the second signal, and on the legacy
// backend part of the change signal).
func (c *client) scrape(ctx context.Context) {
	if c.cfg.KubeProxyMetrics != "" && !c.noKubeProxy {
		c.kp = ScrapeKubeProxy(ctx, &c.http, c.cfg.KubeProxyMetrics)
	}
}

// StartScrape starts a scrape whose result arrives on c.scraped, unless
// one is still running (a frozen kube-proxy: one scrape at a time).
func (c *client) StartScrape(ctx context.Context) {
	if c.cfg.KubeProxyMetrics == "" || c.noKubeProxy || c.scraping {
		return
	}
	if c.scraped == nil {
		c.scraped = make(chan *stream.KubeProxy, 1)
	}
	c.scraping = true
	go func() { c.scraped <- ScrapeKubeProxy(ctx, &c.http, c.cfg.KubeProxyMetrics) }()
}

// Scraped takes a heartbeat's scrape of kube-proxy's metrics. On the
// legacy backend kube-proxy's sync time is part of the change signal (a
// pod swap keeps the table's size): a read may be due.
func (c *client) Scraped(kp *stream.KubeProxy) bool {
	c.kp, c.scraping = kp, false
	return c.legacy
}
