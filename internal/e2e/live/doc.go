// Package live runs the whole system end to end as users run it: the real
// proxyaudit-aggregator (two replicas) and proxyaudit-collector binaries
// with the flags, Secrets and tokens the Helm chart renders, against the
// real local cluster and its genuine kube-proxies, with faults injected
// into both (hung informers, flushes, tampering, partitions, a killed
// leader, control-plane outages) and remediation and Slack paging in the
// loop. Its tests need root; `make test` and `make e2e` run them.
package live
