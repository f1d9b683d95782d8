// Command pause holds a pod's namespaces as its sandbox, like the pause
// image a cluster pulls (registry.k8s.io/pause), which cannot be pulled
// here: it sleeps until it is told to stop.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
}
