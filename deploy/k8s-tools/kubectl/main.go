// Command kubectl is the genuine kubectl, built from the pinned modules so
// the tests can run the README's kubectl commands (and `kubectl
// proxyaudit`, found as a plugin on PATH) the way a user does.
package main

import (
	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
)

func main() {
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err)
	}
}
