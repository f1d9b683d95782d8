// Command kube-proxy is the genuine kube-proxy, built from the pinned
// k8s.io/kubernetes module for proxyaudit's local test cluster.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-proxy/app"
)

func main() { os.Exit(cli.Run(app.NewProxyCommand())) }
