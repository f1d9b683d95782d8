// Package cost measures what proxyaudit costs the nodes it audits, on the
// real local cluster holding the Kubernetes scalability anchors (10k
// services, 100k endpoints) with genuine kube-proxies: the collector on a
// quiet node, and kube-proxy's own sync times and programming latency
// with and without a collector beside it under churn. Benchmarks only
// (`make bench-cost`); results in docs/benchmarks.md.
package cost
