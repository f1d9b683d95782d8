package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
)

// cli is one run of the command line: where its output goes, and the exit
// status the command chose (the verbs' own: 0 clean, 1 findings, 2 usage
// or unreadable input, 3 not audited).
type cli struct {
	stdout, stderr io.Writer
	code           int
}

// run runs the command line args and returns its exit status. A usage
// error (an unknown verb or flag, a missing argument) is one line and a
// pointer to --help, status 2; --help is status 0.
func run(args []string, stdout, stderr io.Writer) int {
	c := &cli{stdout: stdout, stderr: stderr}
	root := c.root()
	root.SetArgs(args)
	cmd, err := root.ExecuteC()
	if err != nil {
		path := cmd.CommandPath()
		msg := err.Error()
		if strings.HasPrefix(msg, "unknown command") {
			// cobra's own suggestions follow on the next lines.
			msg, _, _ = strings.Cut(msg, "\n")
		}
		fmt.Fprintf(stderr, "%s: %s\nSee '%s --help'.\n", path, msg, path)
		return exitUsage
	}
	return c.code
}

// name is how the user ran the CLI: "kubectl proxyaudit" as a kubectl
// plugin (kubectl runs kubectl-proxyaudit), else "proxyaudit".
func name() string {
	if strings.HasPrefix(filepath.Base(os.Args[0]), "kubectl-") {
		return "kubectl proxyaudit"
	}
	return "proxyaudit"
}

// usageError marks an error of the command line itself.
type usageError struct{ error }

// noArgs refuses arguments to a verb that takes flags only, saying which.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("unexpected argument %q (flags only)", args[0])}
	}
	return nil
}

func (c *cli) root() *cobra.Command {
	root := &cobra.Command{
		Use:   "proxyaudit",
		Short: "Finds the nodes whose service dataplane has drifted from the cluster's Services and EndpointSlices",
		Long: `proxyaudit finds nodes whose kube-proxy rules (or Cilium's service maps, where
Cilium replaces kube-proxy) have drifted from the cluster: it names the node,
the service and the endpoint.

report, explain, ui, pause and resume talk to the aggregator the chart
installs, through the API server with kubectl's connection flags; diff judges
dumps offline, installing nothing.

Exit status: 0 nothing found, 1 findings, 2 usage error or input that cannot
be read or judged, 3 nothing found but some part not audited.`,
		Version:           versionString(),
		SilenceErrors:     true,
		SilenceUsage:      true,
		Annotations:       map[string]string{cobra.CommandDisplayNameAnnotation: name()},
		CompletionOptions: cobra.CompletionOptions{HiddenDefaultCmd: false},
	}
	root.SetVersionTemplate("{{.Version}}\n")
	root.SetOut(c.stdout)
	root.SetErr(c.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(c.reportCmd(), c.explainCmd(), c.checkCmd(), c.uiCmd(), c.diffCmd(), c.pauseCmd(false), c.pauseCmd(true), &cobra.Command{
		Use:   "version",
		Short: "Print the version, the commit and the build date",
		Args:  noArgs,
		Run:   func(*cobra.Command, []string) { fmt.Fprintln(c.stdout, versionString()) },
	})
	root.InitDefaultCompletionCmd()
	for _, cmd := range root.Commands() {
		if cmd.Name() == "completion" {
			cmd.AddCommand(c.kubectlCompletionCmd())
		}
	}
	return root
}

// kubectlCompletion is the script kubectl (1.26+) runs to complete
// `kubectl proxyaudit …` when it is on PATH as kubectl_complete-proxyaudit:
// kubectl hands it the words after the plugin's name and shows what it
// prints, cobra's __complete answer.
const kubectlCompletion = `#!/bin/sh
# kubectl (1.26+) completes "kubectl proxyaudit ..." with this script when it
# is on PATH as kubectl_complete-proxyaudit (written by: proxyaudit completion kubectl).
exec kubectl-proxyaudit __complete "$@"
`

func (c *cli) kubectlCompletionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "kubectl",
		Short: "Generate the script that completes kubectl proxyaudit inside kubectl's own completion",
		Long: `Generate the script kubectl (1.26 and later) runs to complete "kubectl proxyaudit ...":
kubectl's own completion (kubectl completion bash|zsh|fish) then completes the
plugin's verbs, flags, contexts and node names too. Install it on PATH, next to
the plugin, as kubectl_complete-proxyaudit; for a krew install:

	proxyaudit completion kubectl > "${KREW_ROOT:-$HOME/.krew}/bin/kubectl_complete-proxyaudit"
	chmod +x "${KREW_ROOT:-$HOME/.krew}/bin/kubectl_complete-proxyaudit"

(krew links only the plugin itself: kubernetes-sigs/krew#812.)`,
		Args:              noArgs,
		ValidArgsFunction: cobra.NoFileCompletions,
		Run:               func(*cobra.Command, []string) { fmt.Fprint(c.stdout, kubectlCompletion) },
	}
}

// fail prints a command's own error, "proxyaudit VERB: …", and returns
// the usage status.
func (c *cli) fail(cmd *cobra.Command, format string, a ...any) int {
	fmt.Fprintf(c.stderr, "%s: %s\n", cmd.CommandPath(), fmt.Sprintf(format, a...))
	return exitUsage
}
