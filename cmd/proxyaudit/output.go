package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/pflag"
	"k8s.io/client-go/util/jsonpath"
	"sigs.k8s.io/yaml"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

// Output formats every verb shares with kubectl (-o): the JSON document,
// the same in YAML, a JSONPath template over it, and columns of JSONPath
// over the rows (a report's or a diff's findings). JSON and YAML are the
// command's own document, its public contract, not a Kubernetes object.
const (
	formatJSON          = "json"
	formatYAML          = "yaml"
	formatName          = "name"
	formatJSONPath      = "jsonpath"
	formatCustomColumns = "custom-columns"
)

// addOutput registers -o/--output with the command's own formats first.
func addOutput(fs *pflag.FlagSet, own []string, shared ...string) *string {
	all := append(slices.Clone(own), shared...)
	for i, f := range all {
		if f == formatJSONPath || f == formatCustomColumns {
			all[i] = f + "=…"
		}
	}
	return fs.StringP("output", "o", own[0], "output format: "+strings.Join(all, ", "))
}

// checkOutput says what is wrong with an -o value, or nil.
func checkOutput(format string, own []string, shared ...string) error {
	name, spec, hasSpec := strings.Cut(format, "=")
	allowed := append(slices.Clone(own), shared...)
	if !slices.Contains(allowed, name) {
		return fmt.Errorf("-o %q: choose %s", format, strings.Join(allowed, ", "))
	}
	switch name {
	case formatJSONPath:
		if !hasSpec || spec == "" {
			return fmt.Errorf("-o jsonpath needs a template, e.g. -o jsonpath='{.summary}'")
		}
		if _, err := parseJSONPath(spec); err != nil {
			return fmt.Errorf("-o %s: %v", format, err)
		}
	case formatCustomColumns:
		if _, err := parseColumns(spec); err != nil {
			return fmt.Errorf("-o %s: %v", format, err)
		}
	default:
		if hasSpec {
			return fmt.Errorf("-o %q: %s takes no template", format, name)
		}
	}
	return nil
}

// printShared writes v in one of the shared formats; rows are the items
// custom-columns prints one line each, names what -o name prints. It
// reports false for the command's own formats.
func printShared(w io.Writer, format string, v any, rows func() []any, names func() []string) (bool, error) {
	name, spec, _ := strings.Cut(format, "=")
	switch name {
	case formatJSON:
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return true, enc.Encode(v)
	case formatYAML:
		b, err := json.Marshal(v)
		if err == nil {
			b, err = yaml.JSONToYAML(b)
		}
		if err == nil {
			_, err = w.Write(b)
		}
		return true, err
	case formatName:
		var b strings.Builder
		for _, n := range names() {
			fmt.Fprintln(&b, n)
		}
		_, err := io.WriteString(w, safetext.Terminal(b.String()))
		return true, err
	case formatJSONPath:
		j, _ := parseJSONPath(spec)
		doc, err := generic(v)
		if err != nil {
			return true, err
		}
		var b bytes.Buffer
		if err := j.Execute(&b, doc); err != nil {
			return true, fmt.Errorf("-o jsonpath: %v", err)
		}
		_, err = io.WriteString(w, safetext.Terminal(b.String()))
		return true, err
	case formatCustomColumns:
		cols, _ := parseColumns(spec)
		return true, printColumns(w, cols, rows())
	}
	return false, nil
}

// parseJSONPath parses a kubectl JSONPath template ("{.a.b}" or, as
// kubectl takes it, ".a.b"); missing keys print nothing, as kubectl's do.
func parseJSONPath(tmpl string) (*jsonpath.JSONPath, error) {
	if !strings.Contains(tmpl, "{") {
		tmpl = "{" + tmpl + "}"
	}
	j := jsonpath.New("out").AllowMissingKeys(true)
	if err := j.Parse(tmpl); err != nil {
		return nil, err
	}
	return j, nil
}

type column struct {
	header string
	path   *jsonpath.JSONPath
}

// parseColumns parses kubectl's custom-columns spec,
// HEADER:.json.path[,HEADER:.path…].
func parseColumns(spec string) ([]column, error) {
	if spec == "" {
		return nil, fmt.Errorf("want HEADER:.json.path[,HEADER:.path...], e.g. -o custom-columns=NODE:.node,KIND:.kind")
	}
	var out []column
	for _, part := range strings.Split(spec, ",") {
		header, path, ok := strings.Cut(part, ":")
		if !ok || header == "" || path == "" {
			return nil, fmt.Errorf("column %q: want HEADER:.json.path", part)
		}
		j, err := parseJSONPath(path)
		if err != nil {
			return nil, fmt.Errorf("column %s: %v", header, err)
		}
		out = append(out, column{header, j})
	}
	return out, nil
}

func printColumns(w io.Writer, cols []column, rows []any) error {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 3, ' ', 0)
	for i, c := range cols {
		if i > 0 {
			fmt.Fprint(tw, "\t")
		}
		fmt.Fprint(tw, c.header)
	}
	fmt.Fprintln(tw)
	for _, r := range rows {
		doc, err := generic(r)
		if err != nil {
			return err
		}
		for i, c := range cols {
			var cell bytes.Buffer
			if err := c.path.Execute(&cell, doc); err != nil {
				return fmt.Errorf("-o custom-columns: column %s: %v", c.header, err)
			}
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			s := cell.String()
			if s == "" {
				s = "<none>"
			}
			fmt.Fprint(tw, strings.ReplaceAll(s, "\t", " "))
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	_, err := io.WriteString(w, safetext.Terminal(b.String()))
	return err
}

// generic is v as JSONPath sees it: its JSON document decoded.
func generic(v any) (any, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var doc any
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	return doc, d.Decode(&doc)
}

// rowsOf is a slice as custom-columns' rows.
func rowsOf[T any](s []T) []any {
	out := make([]any, len(s))
	for i := range s {
		out[i] = s[i]
	}
	return out
}
