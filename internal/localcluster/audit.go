package localcluster

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// auditPolicyYAML has the API server log, at the Metadata level, every
// write made by a service account of the proxyaudit namespace (where the
// chart goes in the suites): what proxyaudit changes in a cluster, as the
// cluster itself recorded it.
const auditPolicyYAML = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts:proxyaudit"]
  verbs: ["create", "update", "patch", "delete", "deletecollection"]
- level: None
`

// AuditedWrites counts the writes the API server recorded for proxyaudit's
// service accounts since a time, by "account verb resource[/subresource]"
// ("proxyaudit-aggregator update leases"), the refused ones apart (an HTTP
// status of 400 or more).
func (c *Cluster) AuditedWrites(since time.Time) (ok, refused map[string]int, err error) {
	f, err := os.Open(filepath.Join(c.Dir, "audit.log"))
	if err != nil {
		return nil, nil, fmt.Errorf("the API server's audit log: %w", err)
	}
	defer f.Close()
	ok, refused = map[string]int{}, map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e struct {
			Stage     string    `json:"stage"`
			Verb      string    `json:"verb"`
			Completed time.Time `json:"stageTimestamp"`
			User      struct {
				Username string `json:"username"`
			} `json:"user"`
			ObjectRef struct {
				Resource    string `json:"resource"`
				Subresource string `json:"subresource"`
			} `json:"objectRef"`
			ResponseStatus struct {
				Code int `json:"code"`
			} `json:"responseStatus"`
		}
		if json.Unmarshal(sc.Bytes(), &e) != nil || e.Stage != "ResponseComplete" || e.Completed.Before(since) {
			continue
		}
		what := e.ObjectRef.Resource
		if e.ObjectRef.Subresource != "" {
			what += "/" + e.ObjectRef.Subresource
		}
		key := strings.TrimPrefix(e.User.Username, "system:serviceaccount:proxyaudit:") + " " + e.Verb + " " + what
		if e.ResponseStatus.Code >= 400 {
			refused[key]++
		} else {
			ok[key]++
		}
	}
	return ok, refused, sc.Err()
}
