// The replicas' own API: what the leader asks of another replica (a
// shard holder's partial verdict, a node's explain, a conntrack flush on
// the holder of its stream), and the handler that answers it.

package aggregator

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// peerURL is a replica's internal API address.
func (a *Aggregator) peerURL(replica, path string) (string, error) {
	host, _, err := net.SplitHostPort(replica)
	if err != nil {
		return "", fmt.Errorf("replica identity %q is not host:port", replica)
	}
	scheme := "http"
	if a.cfg.Shards.TLS {
		scheme = "https"
	}
	return (&url.URL{Scheme: scheme, Host: net.JoinHostPort(host, a.cfg.Shards.Port), Path: path}).String(), nil
}

func (a *Aggregator) peerClient() *http.Client {
	if c := a.cfg.Shards.Client; c != nil {
		return c
	}
	return http.DefaultClient
}

// maxPartialNodes bounds the node entries a holder's answer may carry:
// the nodes the cluster lists in the shards the Leases say it holds, and
// room for those whose collectors report before their Node is seen or
// after it left.
func (a *Aggregator) maxPartialNodes(replica string) int {
	held := map[int]bool{}
	for k, h := range a.cfg.Shards.Holders() {
		if h == replica {
			held[k] = true
		}
	}
	n := 0
	if a.view != nil {
		for _, name := range a.view.ExpectedNodes() {
			if held[a.shardOf(name)] {
				n++
			}
		}
	}
	return n + n/10 + 64
}

// fetchPartial reads one replica's partial (query: the changes after
// what the leader holds), within 2 s and 64 MiB; n is its size.
func (a *Aggregator) fetchPartial(ctx context.Context, replica, query string) (_ *PartialResponse, n int, _ error) {
	u, err := a.peerURL(replica, "/internal/v1/partial")
	if err != nil {
		return nil, 0, err
	}
	u += query
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	resp, err := a.peerClient().Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxPartialBytes+1))
	if err != nil {
		return nil, 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, 0, fmt.Errorf("%s: %s: %s", u, resp.Status, clip(string(body)))
	}
	if len(body) > maxPartialBytes {
		return nil, 0, fmt.Errorf("%s: partial larger than %d MiB", u, maxPartialBytes>>20)
	}
	out, err := decodePartial(body, a.maxPartialNodes(replica))
	if err != nil {
		return nil, 0, fmt.Errorf("%s: not a partial verdict: %v", u, err)
	}
	if out.Replica != replica {
		return nil, 0, fmt.Errorf("%s answered as %q, not %q", u, clip(out.Replica), replica)
	}
	return out, len(body), nil
}

// InternalHandler serves the replicas' own API on its own listener
// (Shards.Port, TLS in the chart): a replica's partial, and what the
// leader asks of the holder of a node's stream (its explain, a conntrack
// flush).
func (a *Aggregator) InternalHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /internal/v1/partial", func(w http.ResponseWriter, r *http.Request) {
		var since uint64
		if q := r.URL.Query().Get("since"); q != "" {
			v, err := strconv.ParseUint(q, 10, 64)
			if err != nil {
				writeError(w, http.StatusBadRequest, "since is the version of this replica's partial the caller holds, a whole number: "+err.Error())
				return
			}
			since = v
		}
		p, ok := a.partials.since(r.URL.Query().Get("epoch"), since)
		if !ok {
			writeError(w, http.StatusServiceUnavailable, "this replica has judged no shard yet")
			return
		}
		p.Replica = a.cfg.Self
		writeJSON(w, http.StatusOK, p)
	})
	mux.HandleFunc("GET /internal/v1/nodes/{name}/explain", func(w http.ResponseWriter, r *http.Request) {
		resp, ok := a.Explain(r.PathValue("name"), r.URL.Query().Get("service"))
		if !ok {
			writeError(w, http.StatusNotFound, "no rules from node "+r.PathValue("name")+" on this replica: its collector has not sent a full snapshot to its shard's holder")
			return
		}
		writeJSON(w, http.StatusOK, resp)
	})
	mux.HandleFunc("POST /internal/v1/nodes/{name}/flush", func(w http.ResponseWriter, r *http.Request) {
		var pairs []remediate.StalePair
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&pairs); err != nil {
			writeError(w, http.StatusBadRequest, "a flush is a JSON list of stale pairs: "+err.Error())
			return
		}
		res, err := a.flushVia(r.Context(), r.PathValue("name"), pairs, false)
		if err != nil {
			writeError(w, http.StatusBadGateway, err.Error())
			return
		}
		writeJSON(w, http.StatusOK, res)
	})
	if a.cfg.Shards.Auth != nil {
		return a.cfg.Shards.Auth.Wrap(mux)
	}
	return mux
}

// explain is Explain, asked of the replica holding the node's stream
// when that is another one (with this replica's credentials: the caller
// was admitted here). ok is false when nobody has the node's rules; err
// says why the holder could not be asked.
func (a *Aggregator) explain(ctx context.Context, node, service string) (api.ExplainResponse, bool, error) {
	if resp, ok := a.Explain(node, service); ok || !a.sharded() {
		return resp, ok, nil
	}
	holder := a.holderOf(node)
	if holder == "" || holder == a.cfg.Self {
		return api.ExplainResponse{}, false, nil
	}
	u, err := a.peerURL(holder, "/internal/v1/nodes/"+url.PathEscape(node)+"/explain")
	if err != nil {
		return api.ExplainResponse{}, false, err
	}
	if service != "" {
		u += "?" + url.Values{"service": {service}}.Encode()
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	resp, err := a.peerClient().Do(req)
	if err != nil {
		return api.ExplainResponse{}, false, fmt.Errorf("node %s streams to replica %s, which did not answer: %v", node, holder, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxPartialBytes))
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		return api.ExplainResponse{}, false, nil
	default:
		return api.ExplainResponse{}, false, fmt.Errorf("node %s streams to replica %s, which answered %s: %s", node, holder, resp.Status, clip(string(body)))
	}
	var out api.ExplainResponse
	if err := json.Unmarshal(body, &out); err != nil {
		return api.ExplainResponse{}, false, fmt.Errorf("replica %s: not an explanation: %v", holder, err)
	}
	return out, true, nil
}

// flushOnHolder asks the replica holding node's stream to flush.
func (a *Aggregator) flushOnHolder(ctx context.Context, node string, pairs []remediate.StalePair) ([]remediate.FlushResult, error) {
	holder := a.holderOf(node)
	if holder == "" {
		return nil, fmt.Errorf("no replica holds node %s's shard yet (a handover): the flush is tried again when the node's cooldown ends", node)
	}
	u, err := a.peerURL(holder, "/internal/v1/nodes/"+url.PathEscape(node)+"/flush")
	if err != nil {
		return nil, err
	}
	body, _ := json.Marshal(pairs)
	ctx, cancel := context.WithTimeout(ctx, flushWait+5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.peerClient().Do(req)
	if err != nil {
		return nil, fmt.Errorf("node %s streams to replica %s, which did not answer the flush: %v", node, holder, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		var e struct{ Error string }
		json.Unmarshal(b, &e)
		return nil, fmt.Errorf("replica %s: %s", holder, clip(e.Error))
	}
	var out []remediate.FlushResult
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("replica %s answered the flush with no results: %v", holder, err)
	}
	return out, nil
}
