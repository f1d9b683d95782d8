// Command dump writes the raw entries of Cilium's LB maps pinned under a
// BPF filesystem (-bpffs) as JSON: the golden captures of the genuine
// agent's maps in dataplane/cilium/testdata are made with it
// (deploy/cilium/capture.sh).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/proxyaudit/proxyaudit/dataplane/cilium"
)

func main() {
	bpffs := flag.String("bpffs", "/sys/fs/bpf", "the BPF filesystem the agent pins its maps to (cilium-agent --bpf-root)")
	flag.Parse()
	maps, err := cilium.Read(*bpffs)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dump:", err)
		os.Exit(1)
	}
	for i := range maps {
		maps[i] = maps[i].WithEntries()
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(maps); err != nil {
		fmt.Fprintln(os.Stderr, "dump:", err)
		os.Exit(1)
	}
}
