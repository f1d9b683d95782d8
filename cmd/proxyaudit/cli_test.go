package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The command line behaves as kubectl's (issue #57): help is status 0 on
// every verb, a usage error is one line and a pointer to --help (status 2),
// -ojson and --output json are -o json, --version and version say the
// same, version --help is help.
func TestExitCodesAndUsageErrors(t *testing.T) {
	fr, nr := fleet()
	url := serve(t, fr, nr)
	for _, tc := range []struct {
		args []string
		code int
		out  string // in stdout
		err  string // in stderr
	}{
		{[]string{"--help"}, exitClean, "Available Commands:", ""},
		{nil, exitClean, "Available Commands:", ""},
		{[]string{"report", "--help"}, exitClean, "--kubeconfig", ""},
		{[]string{"explain", "--help"}, exitClean, "explain node NAME", ""},
		{[]string{"ui", "--help"}, exitClean, "--listen", ""},
		{[]string{"diff", "--help"}, exitClean, "--rules", ""},
		{[]string{"pause", "--help"}, exitClean, "--reason", ""},
		{[]string{"resume", "--help"}, exitClean, "--pause-configmap", ""},
		{[]string{"version", "--help"}, exitClean, "Print the version", ""},
		{[]string{"help", "report"}, exitClean, "--aggregator", ""},
		{[]string{"--version"}, exitClean, "proxyaudit (devel)", ""},
		{[]string{"report", "--aggregator", url, "-ojson"}, exitFindings, `"findings": [`, ""},
		{[]string{"report", "--aggregator", url, "--output", "json"}, exitFindings, `"findings": [`, ""},
		{[]string{"report", "--aggregator", url, "--output=name"}, exitFindings, "node/node-b\n", ""},
		{[]string{"report", "--aggreagtor", url}, exitUsage, "", "proxyaudit report: unknown flag: --aggreagtor\nSee 'proxyaudit report --help'.\n"},
		{[]string{"repotr"}, exitUsage, "", "proxyaudit: unknown command \"repotr\" for \"proxyaudit\"\nSee 'proxyaudit --help'.\n"},
		{[]string{"report", "extra"}, exitUsage, "", "proxyaudit report: unexpected argument \"extra\""},
		{[]string{"report", "--aggregator", url, "-o", "xml"}, exitUsage, "", "choose table, wide, markdown, json, yaml, name, jsonpath, custom-columns"},
		{[]string{"report", "--aggregator", url, "-o", "jsonpath"}, exitUsage, "", "needs a template"},
		{[]string{"report", "--aggregator", url, "-o", "jsonpath={.a"}, exitUsage, "", "jsonpath"},
		{[]string{"report", "--aggregator", url, "-o", "custom-columns=NODE"}, exitUsage, "", "want HEADER:.json.path"},
		{[]string{"explain"}, exitUsage, "", "want `explain node NAME`"},
		{[]string{"explain", "pod", "x"}, exitUsage, "", "want `explain node NAME`"},
		{[]string{"version", "x"}, exitUsage, "", "unexpected argument"},
	} {
		var out, errb bytes.Buffer
		code := run(tc.args, &out, &errb)
		if code != tc.code || !strings.Contains(out.String(), tc.out) || !strings.Contains(errb.String(), tc.err) {
			t.Errorf("%q: exit %d (want %d)\nstdout: %.300q\nstderr: %q", tc.args, code, tc.code, out.String(), errb.String())
		}
		if tc.code == exitUsage && strings.Count(errb.String(), "\n") > 2 {
			t.Errorf("%q: a usage error of %d lines, want one and the pointer to --help:\n%s", tc.args, strings.Count(errb.String(), "\n"), errb.String())
		}
	}
}

// Run as kubectl's plugin (kubectl runs kubectl-proxyaudit), help and
// errors name the command as the user typed it.
func TestPluginNaming(t *testing.T) {
	was := os.Args[0]
	defer func() { os.Args[0] = was }()
	os.Args[0] = "/usr/local/bin/kubectl-proxyaudit"
	var out, errb bytes.Buffer
	if code := run([]string{"report", "--help"}, &out, &errb); code != exitClean || !strings.Contains(out.String(), "kubectl proxyaudit report [flags]") {
		t.Errorf("help as a plugin: exit %d:\n%s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"report", "--nope"}, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), "See 'kubectl proxyaudit report --help'.") {
		t.Errorf("usage error as a plugin: exit %d: %q", code, errb.String())
	}
}

// kubectl's connection flags reach the API server without a kubeconfig
// (--server, --token), and the namespace is -n, else the context's, else
// proxyaudit.
func TestKubectlConnectionFlags(t *testing.T) {
	fr, nr := fleet()
	srv := apiServer(t, fr, nr) // serves the aggregator in namespace proxyaudit
	var out, errb bytes.Buffer
	// An explicit kubeconfig that does not exist is an error, as kubectl's.
	if code := run([]string{"report", "--kubeconfig", filepath.Join(t.TempDir(), "none"), "--server", srv, "--token", "t", "-o", "name"}, &out, &errb); code != exitUsage ||
		!strings.Contains(errb.String(), "kubeconfig") {
		t.Errorf("a missing --kubeconfig: exit %d, %q", code, errb.String())
	}
	empty := filepath.Join(t.TempDir(), "empty")
	os.WriteFile(empty, []byte("apiVersion: v1\nkind: Config\n"), 0o600)
	out.Reset()
	errb.Reset()
	if code := run([]string{"report", "--kubeconfig", empty, "--server", srv, "--token", "t", "-o", "name"}, &out, &errb); code != exitFindings || out.String() != "node/node-b\nnode/node-d\n" {
		t.Errorf("--server and --token: exit %d: %q %q", code, out.String(), errb.String())
	}

	cfg := kubeconfig(t, map[string]string{"c": srv})
	withNS := filepath.Join(t.TempDir(), "ns")
	b, _ := os.ReadFile(cfg)
	os.WriteFile(withNS, []byte(strings.Replace(string(b), "    cluster: c\n", "    cluster: c\n    namespace: ops\n", 1)+"current-context: c\n"), 0o600)
	errb.Reset()
	if code := run([]string{"report", "--kubeconfig", withNS}, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), "ops/proxyaudit-aggregator") {
		t.Errorf("the context's namespace: exit %d: %q", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"report", "--kubeconfig", withNS, "-n", "proxyaudit", "-o", "name"}, &out, &errb); code != exitFindings || out.String() != "node/node-b\nnode/node-d\n" {
		t.Errorf("-n over the context's namespace: exit %d: %q", code, out.String())
	}
	out.Reset()
	if code := run([]string{"report", "--kubeconfig", cfg, "--context", "c", "-o", "name"}, &out, &errb); code != exitFindings {
		t.Errorf("no namespace anywhere (proxyaudit): exit %d: %q", code, out.String())
	}
}

// Shell completion: scripts for bash, zsh and fish; the kubeconfig's
// contexts for --context and the cluster's nodes for explain node, asked
// of the CLI as the scripts ask it, and in a real bash.
func TestCompletion(t *testing.T) {
	for shell, says := range map[string]string{"bash": "__start_proxyaudit", "zsh": "#compdef proxyaudit", "fish": "complete -c proxyaudit",
		"kubectl": "exec kubectl-proxyaudit __complete \"$@\""} {
		var out, errb bytes.Buffer
		if code := run([]string{"completion", shell}, &out, &errb); code != exitClean || !strings.Contains(out.String(), says) {
			t.Errorf("completion %s: exit %d, %.200q", shell, code, out.String())
		}
	}
	nodes := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/v1/nodes" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"kind":"NodeList","apiVersion":"v1","items":[{"metadata":{"name":"worker-1"}},{"metadata":{"name":"worker-2"}},{"metadata":{"name":"infra-1"}}]}`)
	}))
	defer nodes.Close()
	cfg := kubeconfig(t, map[string]string{"prod-eu": nodes.URL, "prod-us": nodes.URL, "staging": nodes.URL})
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"__complete", "report", "--kubeconfig", cfg, "--context", "prod"}, "prod-eu\nprod-us\n:4\n"},
		{[]string{"__complete", "explain", "--kubeconfig", cfg, "--context", "prod-eu", "node", "work"}, "worker-1\nworker-2\n:4\n"},
		{[]string{"__complete", "explain", ""}, "node\n:4\n"},
		{[]string{"__complete", "rep"}, "report\tThe fleet at a glance"},
	} {
		var out, errb bytes.Buffer
		run(tc.args, &out, &errb)
		if !strings.Contains(out.String(), tc.want) {
			t.Errorf("%q: %q, want %q", tc.args[1:], out.String(), tc.want)
		}
	}

	bash, err := exec.LookPath("bash")
	const completions = "/usr/share/bash-completion/bash_completion"
	if _, serr := os.Stat(completions); err != nil || serr != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("bash and %s are needed (deploy/install-deps.sh installs them): %v %v", completions, err, serr)
		}
		t.Skipf("no bash or no %s (deploy/install-deps.sh installs bash-completion)", completions)
	}
	bin := filepath.Join(t.TempDir(), "proxyaudit")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	script := `source ` + completions + `
source <(proxyaudit completion bash)
COMP_LINE="proxyaudit report --context prod"; COMP_WORDS=(proxyaudit report --context prod); COMP_CWORD=3; COMP_POINT=${#COMP_LINE}
__start_proxyaudit
printf '%s\n' "${COMPREPLY[@]}"`
	cmd := exec.Command(bash, "--norc", "-c", script)
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(bin)+":"+os.Getenv("PATH"), "KUBECONFIG="+cfg)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr // compopt says it runs outside a completion
	got, err := cmd.Output()
	if err != nil || string(got) != "prod-eu\nprod-us\n" {
		t.Errorf("bash completion of report --context prod: %v\n%s%s", err, got, stderr.String())
	}
}

// -o yaml is -o json's document; -o custom-columns of a diff has one row
// per finding.
func TestDiffOutputs(t *testing.T) {
	args := []string{"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules", "--rules", "nft-b=" + drift + "nft-b.rules"}
	var j, y, cc bytes.Buffer
	if code := run(append(args, "-o", "json"), &j, os.Stderr); code != exitFindings {
		t.Fatalf("json: exit %d", code)
	}
	if code := run(append(args, "-o", "yaml"), &y, os.Stderr); code != exitFindings {
		t.Fatalf("yaml: exit %d", code)
	}
	var fromJSON, fromYAML Report
	if err := json.Unmarshal(j.Bytes(), &fromJSON); err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(y.Bytes(), &fromYAML); err != nil {
		t.Fatal(err)
	}
	if len(fromJSON.Findings) == 0 || fmt.Sprint(fromJSON.Findings) != fmt.Sprint(fromYAML.Findings) {
		t.Errorf("yaml and json differ:\n%v\n%v", fromJSON.Findings, fromYAML.Findings)
	}
	if code := run(append(args, "-o", "custom-columns=KIND:.kind,ENDPOINT:.endpoint"), &cc, os.Stderr); code != exitFindings ||
		strings.Count(cc.String(), "\n") != len(fromJSON.Findings)+1 || !strings.HasPrefix(cc.String(), "KIND ") {
		t.Errorf("custom-columns: exit %d:\n%s", code, cc.String())
	}
}

// A development build checks with the chart's image; the constant follows
// the chart.
func TestCheckImageIsTheChartsAppVersion(t *testing.T) {
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	b, err := os.ReadFile("../../charts/proxyaudit/Chart.yaml")
	if err != nil || yaml.Unmarshal(b, &chart) != nil {
		t.Fatal(err)
	}
	if chart.AppVersion != chartAppVersion || defaultCheckImage() != "ghcr.io/proxyaudit/proxyaudit:"+chart.AppVersion {
		t.Errorf("chartAppVersion %s, the chart's appVersion %s, the default image %s", chartAppVersion, chart.AppVersion, defaultCheckImage())
	}
	for _, tc := range []struct {
		args []string
		says string
	}{
		{[]string{"check"}, "want `check node NAME`"},
		{[]string{"check", "node/x", "--mode", "bogus", "--server", "http://127.0.0.1:1"}, `--mode "bogus"`},
		{[]string{"check", "node/x", "-o", "wide"}, "choose table, markdown"},
	} {
		var out, errb bytes.Buffer
		if code := run(tc.args, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), tc.says) {
			t.Errorf("%q: exit %d, %q", tc.args, code, errb.String())
		}
	}
}
