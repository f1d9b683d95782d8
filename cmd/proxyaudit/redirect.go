package main

import (
	"errors"
	"fmt"
	"net/http"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// errRedirect: the CLI never follows a redirect. Whatever answers behind
// the aggregator's Service (an aggregator pod, any pod its selector
// matches, an EndpointSlice of that Service) can answer 3xx to a host of
// its choosing, and the API server's service proxy passes that through;
// followed, client-go's bearer round-tripper would hand the user's own
// credentials (and the reader token) to that host.
var errRedirect = errors.New("the aggregator answered with a redirect; proxyaudit never follows one (it would send your credentials to wherever it points): check what answers behind the aggregator's Service")

// refuseRedirects is an http.Client's CheckRedirect that follows none.
func refuseRedirects(req *http.Request, _ []*http.Request) error {
	return fmt.Errorf("%w (to %s)", errRedirect, req.URL.Redacted())
}

// noRedirectClient is the kubeconfig's client, over an HTTP client that
// refuses every redirect.
func noRedirectClient(cfg *rest.Config) (kubernetes.Interface, error) {
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	// A copy: for a config without TLS or auth settings client-go hands
	// back http.DefaultClient itself, which must not change (it did, for
	// every other user of it, and racily across contexts read at once).
	own := *hc
	own.CheckRedirect = refuseRedirects
	return kubernetes.NewForConfigAndClient(cfg, &own)
}

// directClient is the client of --aggregator URL: no redirects either.
var directClient = &http.Client{Transport: http.DefaultTransport, CheckRedirect: refuseRedirects}
