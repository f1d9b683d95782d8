// Package audit is proxyaudit's pure detection core: it turns a node's
// kube-proxy rules and the cluster's Services, EndpointSlices and Nodes into
// typed models and compares them. It performs no I/O and reads no clock.
package audit
