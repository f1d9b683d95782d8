// Package promtool runs Prometheus's own rule checker and rule unit tester
// (promtool, built from Prometheus's Go module by
// deploy/k8s-tools/promtool.sh) for the tests of the chart's alerts and
// dashboard: PromQL is evaluated by Prometheus, not re-implemented here.
package promtool

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Binary builds promtool, or reuses the cached build, and returns its path.
func Binary(repoRoot string) (string, error) {
	out, err := exec.Command(filepath.Join(repoRoot, "deploy/k8s-tools/promtool.sh")).Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return "", fmt.Errorf("building promtool: %v\n%s", err, ee.Stderr)
		}
		return "", fmt.Errorf("building promtool: %v", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// UnitTest is a `promtool test rules` file (JSON is YAML); RuleFiles are
// filled in by TestRules.
type UnitTest struct {
	RuleFiles          []string `json:"rule_files"`
	EvaluationInterval string   `json:"evaluation_interval"`
	Tests              []Test   `json:"tests"`
}

// Test is one test group: input series at an interval and the alerts
// expected at given times.
type Test struct {
	Name        string      `json:"name,omitempty"`
	Interval    string      `json:"interval"`
	InputSeries []Series    `json:"input_series"`
	Alerts      []AlertTest `json:"alert_rule_test,omitempty"`
	Exprs       []ExprTest  `json:"promql_expr_test,omitempty"`
}

// ExprTest evaluates a PromQL expression at EvalTime and expects exactly
// Samples.
type ExprTest struct {
	Expr     string   `json:"expr"`
	EvalTime string   `json:"eval_time"`
	Samples  []Sample `json:"exp_samples"`
}

// Sample is one expected sample: labels in series notation ("{}" for
// none) and its value.
type Sample struct {
	Labels string  `json:"labels"`
	Value  float64 `json:"value"`
}

// Series is one input series in promtool's expanding notation ("0 1x10").
type Series struct {
	Series string `json:"series"`
	Values string `json:"values"`
}

// AlertTest says which alerts with that name fire at EvalTime (none when
// ExpAlerts is empty: pending or resolved).
type AlertTest struct {
	EvalTime  string     `json:"eval_time"`
	AlertName string     `json:"alertname"`
	ExpAlerts []ExpAlert `json:"exp_alerts"`
}

// ExpAlert is one expected alert: all its labels (besides alertname) and
// annotations.
type ExpAlert struct {
	Labels      map[string]string `json:"exp_labels"`
	Annotations map[string]string `json:"exp_annotations"`
}

// TestRules runs `promtool test rules` on the rule groups (YAML or JSON,
// as a PrometheusRule's spec) and the unit test, in dir.
func TestRules(bin, dir string, groups []byte, ut UnitTest) ([]byte, error) {
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), groups, 0o644); err != nil {
		return nil, err
	}
	ut.RuleFiles = []string{"rules.yaml"}
	data, err := json.MarshalIndent(ut, "", " ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "test.yaml"), data, 0o644); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "test", "rules", "test.yaml")
	cmd.Dir = dir
	return cmd.CombinedOutput()
}

// CheckRecorded has promtool parse each expression as a recording rule.
func CheckRecorded(bin, dir string, exprs []string) ([]byte, error) {
	var b strings.Builder
	b.WriteString("groups:\n  - name: checked\n    rules:\n")
	for i, e := range exprs {
		fmt.Fprintf(&b, "      - record: checked:expr_%d\n        expr: %q\n", i+1, e)
	}
	if err := os.WriteFile(filepath.Join(dir, "checked.yaml"), []byte(b.String()), 0o644); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "check", "rules", "checked.yaml")
	cmd.Dir = dir
	return cmd.CombinedOutput()
}

// Rule is an alerting rule as a PrometheusRule holds it.
type Rule struct {
	Alert       string            `json:"alert"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

// Alerts lists the alerting rules of rule groups (a PrometheusRule's spec
// as JSON), by name.
func Alerts(groups []byte) (map[string]Rule, error) {
	var spec struct {
		Groups []struct {
			Rules []Rule `json:"rules"`
		} `json:"groups"`
	}
	if err := json.Unmarshal(groups, &spec); err != nil {
		return nil, err
	}
	out := map[string]Rule{}
	for _, g := range spec.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				out[r.Alert] = r
			}
		}
	}
	return out, nil
}

// Expect is the alert r promises once firing with value (its labels,
// plus extra label pairs, and its annotations with the value in).
func (r Rule) Expect(value string, extra ...string) ExpAlert {
	an := map[string]string{}
	for k, v := range r.Annotations {
		v = strings.ReplaceAll(v, "{{ $value | humanizeDuration }}", value)
		an[k] = strings.ReplaceAll(v, "{{ $value }}", value)
	}
	labels := map[string]string{}
	for k, v := range r.Labels {
		labels[k] = v
	}
	for i := 0; i+1 < len(extra); i += 2 {
		labels[extra[i]] = extra[i+1]
	}
	return ExpAlert{Labels: labels, Annotations: an}
}
