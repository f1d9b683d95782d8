package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// kubectlElsewhere are the README's commands of kubectl itself (and its
// krew plugin manager), each with the test that runs it or what it does.
var kubectlElsewhere = map[string]string{
	"kubectl create namespace":                                              "internal/chart TestE2EPodSecurityAdmission makes namespaces through the API",
	"kubectl label namespace":                                               "internal/chart TestE2EPodSecurityAdmission: the collector admitted under that label alone",
	"kubectl krew install":                                                  "internal/e2e/realnodes TestE2EChartOnRealNodes (krewReport), word for word",
	"kubectl -n proxyaudit create rolebinding":                              "internal/chart TestE2EHelmInstallUpgrade, word for word",
	"kubectl -n proxyaudit create secret":                                   "internal/chart TestE2EHelmInstallUpgrade, word for word",
	"kubectl get services,endpointslices,nodes -A -o json":                  "internal/e2e TestE2ELiveDiff, word for word (audit.CaptureCommand)",
	"kubectl get clusterreports -l app.kubernetes.io/managed-by=proxyaudit": "internal/e2e/realnodes TestE2EChartOnRealNodes watches ClusterReports with this selector",
}

// Every command in the fenced blocks of the README and the user docs
// exists with the flags it shows: the CLI's verbs and flags (their
// --help), the Makefile's targets, the chart's reference, version and
// values; kubectl's own commands are named above with the test that runs
// them.
func TestREADMECommands(t *testing.T) {
	for _, doc := range []string{"README.md", "docs/usage.md", "docs/install.md"} {
		t.Run(doc, func(t *testing.T) { checkDocCommands(t, doc) })
	}
}

func checkDocCommands(t *testing.T, doc string) {
	root := "../.."
	readme, err := os.ReadFile(filepath.Join(root, doc))
	if err != nil {
		t.Fatal(err)
	}
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	var values map[string]any
	if b, err := os.ReadFile(filepath.Join(root, "charts/proxyaudit/values.yaml")); err != nil || yaml.Unmarshal(b, &values) != nil {
		t.Fatalf("values.yaml: %v", err)
	}
	var chartMeta struct{ Version string }
	if b, err := os.ReadFile(filepath.Join(root, "charts/proxyaudit/Chart.yaml")); err != nil || yaml.Unmarshal(b, &chartMeta) != nil {
		t.Fatalf("Chart.yaml: %v", err)
	}
	cmds := fencedCommands(string(readme))
	if len(cmds) < 5 {
		t.Fatalf("only %d commands found in %s's fenced blocks: the extraction is broken", len(cmds), doc)
	}
	seen := map[string]bool{}
	for _, words := range cmds {
		line := strings.Join(words, " ")
		switch {
		case len(words) > 2 && words[0] == "kubectl" && words[1] == "proxyaudit", words[0] == "proxyaudit":
			args := words[1:]
			if words[0] == "kubectl" {
				args = words[2:]
			}
			verb := args[0]
			var out, errb bytes.Buffer
			code := run([]string{verb, "--help"}, &out, &errb)
			help := out.String() + errb.String()
			if code != exitClean && code != exitUsage || !strings.Contains(help, "-") {
				t.Errorf("%s: `%s --help` exits %d: %s", line, verb, code, help)
				continue
			}
			for _, a := range args[1:] {
				if !strings.HasPrefix(a, "-") {
					continue
				}
				name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
				if !regexp.MustCompile(`(^|\s)--?` + regexp.QuoteMeta(name) + `\b`).MatchString(help) {
					t.Errorf("%s: proxyaudit %s has no flag %q", line, verb, name)
				}
			}
			seen["proxyaudit "+verb] = true
		case words[0] == "kubectl":
			known := false
			for prefix, by := range kubectlElsewhere {
				if strings.HasPrefix(line, prefix) {
					known, seen[prefix] = true, by != ""
				}
			}
			if !known {
				t.Errorf("%s: a kubectl command no test is named for (kubectlElsewhere)", line)
			}
		case words[0] == "make":
			if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(words[1]) + `:`).Match(makefile) {
				t.Errorf("%s: the Makefile has no target %q", line, words[1])
			}
		case words[0] == "helm" && (words[1] == "install" || words[1] == "upgrade"):
			ref := words[3]
			if ref != "oci://ghcr.io/proxyaudit/charts/proxyaudit" && ref != "charts/proxyaudit" {
				t.Errorf("%s: chart %q is neither the OCI chart nor the checkout's", line, ref)
			}
			for i, w := range words {
				if i+1 >= len(words) {
					break
				}
				switch w {
				case "--version":
					if v := words[i+1]; v != chartMeta.Version {
						t.Errorf("%s: --version %s, but the chart is %s", line, v, chartMeta.Version)
					}
				case "--set", "--set-string":
					key, _, _ := strings.Cut(words[i+1], "=")
					if !hasValue(values, strings.Split(key, ".")) {
						t.Errorf("%s: values.yaml has no %s", line, key)
					}
				}
			}
		}
	}
	for _, verb := range []string{"proxyaudit report", "proxyaudit explain"} {
		if doc == "README.md" && !seen[verb] {
			t.Errorf("the README shows no `kubectl %s`", verb)
		}
	}
}

// fencedCommands returns the commands of the ```sh blocks of md, a
// command's continued lines joined and comments cut, as words.
func fencedCommands(md string) [][]string {
	var out [][]string
	in := false
	var cur string
	for _, l := range strings.Split(md, "\n") {
		if strings.HasPrefix(l, "```") {
			in = !in && strings.TrimPrefix(l, "```") == "sh"
			continue
		}
		if !in {
			continue
		}
		if i := strings.Index(l, " #"); i >= 0 {
			l = l[:i]
		}
		if strings.HasPrefix(strings.TrimSpace(l), "#") {
			continue
		}
		cur += " " + strings.TrimSuffix(strings.TrimSpace(l), "\\")
		if strings.HasSuffix(strings.TrimSpace(l), "\\") {
			continue
		}
		if w := strings.Fields(cur); len(w) > 0 {
			out = append(out, w)
		}
		cur = ""
	}
	return out
}

// hasValue says whether values holds the key path (a map at each step
// but the last).
func hasValue(values map[string]any, path []string) bool {
	v, ok := values[path[0]]
	if !ok {
		return false
	}
	if len(path) == 1 {
		return true
	}
	m, ok := v.(map[string]any)
	return ok && hasValue(m, path[1:])
}

// The map at the top of docs/design.md ("to change X, go to Y") names
// only paths that exist: a file moved or renamed must move in the map.
// A bare file name is in the directory of the path named before it in
// the same cell.
func TestDesignMapNamesRealPaths(t *testing.T) {
	root := "../.."
	b, err := os.ReadFile(filepath.Join(root, "docs/design.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## To change X, go to Y\n")
	if !ok {
		t.Fatal("docs/design.md has no map (## To change X, go to Y)")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	tick := regexp.MustCompile("`([^`]+)`")
	checked := 0
	for _, row := range strings.Split(section, "\n") {
		cells := strings.Split(row, "|")
		if len(cells) < 4 || strings.HasPrefix(strings.TrimSpace(cells[1]), "---") || strings.TrimSpace(cells[1]) == "to change …" {
			continue
		}
		base := ""
		for _, m := range tick.FindAllStringSubmatch(cells[2], -1) {
			tok := m[1]
			if strings.ContainsAny(tok, " ()") || !(strings.Contains(tok, "/") || strings.HasSuffix(tok, ".go")) {
				continue // a command, a function or a flag
			}
			p := strings.TrimSuffix(tok, "/")
			bare := !strings.Contains(p, "/")
			if bare { // beside the path named before it
				p = filepath.Join(base, p)
			}
			found, _ := filepath.Glob(filepath.Join(root, p)) // conntrack*.go: one or more
			if len(found) == 0 {
				t.Errorf("docs/design.md's map names %s (%q), which does not exist", p, tok)
				continue
			}
			checked++
			if st, err := os.Stat(found[0]); err == nil && !bare {
				if st.IsDir() {
					base = p
				} else {
					base = filepath.Dir(p)
				}
			}
		}
	}
	if checked < 40 {
		t.Errorf("only %d paths checked in docs/design.md's map", checked)
	}
}
