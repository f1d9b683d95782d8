package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// defaultNamespace is where the chart is installed by the README: the
// namespace when neither -n nor the kubeconfig context names one.
const defaultNamespace = "proxyaudit"

// kube is how a command reaches a cluster's API server: kubectl's own
// connection flags (client-go's clientcmd binds them as kubectl does:
// --kubeconfig, --server, --token, --as, --as-group, --user, --cluster,
// --request-timeout, --certificate-authority, …), -n, and --context,
// which report and ui take more than once (one cluster each).
type kube struct {
	loading   *clientcmd.ClientConfigLoadingRules
	overrides clientcmd.ConfigOverrides
	namespace string // -n as given
	contexts  []string
}

func addKubeFlags(fs *pflag.FlagSet, multi bool) *kube {
	k := &kube{loading: clientcmd.NewDefaultClientConfigLoadingRules()}
	fs.StringVar(&k.loading.ExplicitPath, clientcmd.RecommendedConfigPathFlag, "", "path to the kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
	flags := clientcmd.RecommendedConfigOverrideFlags("")
	// Ours: --context repeatable, -n defaulting to the chart's namespace;
	// no --username/--password (kubectl dropped them too).
	flags.CurrentContext.LongName = ""
	flags.ContextOverrideFlags.Namespace.LongName, flags.ContextOverrideFlags.Namespace.ShortName = "", ""
	flags.AuthOverrideFlags.Username.LongName, flags.AuthOverrideFlags.Password.LongName = "", ""
	flags.ClusterOverrideFlags.APIServer.ShortName = "s" // as kubectl
	clientcmd.BindOverrideFlags(&k.overrides, fs, flags)
	fs.StringVarP(&k.namespace, "namespace", "n", "", "namespace of proxyaudit's aggregator (default: the context's namespace, else "+defaultNamespace+")")
	usage := "kubeconfig context (default: the current one)"
	if multi {
		usage += "; more than once: one cluster each, side by side"
	}
	fs.StringArrayVar(&k.contexts, "context", nil, usage)
	return k
}

// context is the one context a single-cluster command reads: the last
// --context, or "" (the kubeconfig's current one).
func (k *kube) context() string {
	if len(k.contexts) == 0 {
		return ""
	}
	return k.contexts[len(k.contexts)-1]
}

// single refuses several --context flags where a command reads one
// cluster.
func (k *kube) single(cmd string) error {
	if len(k.contexts) > 1 {
		return fmt.Errorf("%s reads one cluster: give --context once (report and ui take several)", cmd)
	}
	for _, c := range k.contexts {
		if c == "" {
			return errors.New("--context: an empty context name")
		}
	}
	return nil
}

// config is the REST configuration for context ("": the current one) with
// every connection flag applied, and the namespace proxyaudit is looked
// for in there: -n, else the context's namespace, else the chart's.
func (k *kube) config(context string) (*rest.Config, string, error) {
	o := k.overrides
	o.CurrentContext = context
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(k.loading, &o)
	cfg, err := loader.ClientConfig()
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %v", err)
	}
	ns := k.namespace
	if ns == "" {
		if raw, err := loader.RawConfig(); err == nil {
			name := context
			if name == "" {
				name = raw.CurrentContext
			}
			if c := raw.Contexts[name]; c != nil {
				ns = c.Namespace
			}
		}
	}
	if ns == "" {
		ns = defaultNamespace
	}
	return cfg, ns, nil
}

// client is a client for context that follows no redirect, the REST
// configuration behind it and the namespace (see config).
func (k *kube) client(context string) (kubernetes.Interface, *rest.Config, string, error) {
	cfg, ns, err := k.config(context)
	if err != nil {
		return nil, nil, "", err
	}
	c, err := noRedirectClient(cfg)
	return c, cfg, ns, err
}

// allContexts lists the kubeconfig's contexts, sorted.
func (k *kube) allContexts() ([]string, error) {
	raw, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(k.loading, &k.overrides).RawConfig()
	if err != nil {
		return nil, fmt.Errorf("kubeconfig: %v", err)
	}
	var out []string
	for name := range raw.Contexts {
		out = append(out, name)
	}
	slices.Sort(out)
	if len(out) == 0 {
		return nil, errors.New("kubeconfig: no contexts")
	}
	return out, nil
}

// complete registers the shell completion of --context (the kubeconfig's
// contexts) and -n (the cluster's namespaces).
func (k *kube) complete(cmd *cobra.Command) {
	cmd.RegisterFlagCompletionFunc("context", func(_ *cobra.Command, _ []string, prefix string) ([]string, cobra.ShellCompDirective) {
		names, _ := k.allContexts()
		return prefixed(names, prefix), cobra.ShellCompDirectiveNoFileComp
	})
	cmd.RegisterFlagCompletionFunc("namespace", func(_ *cobra.Command, _ []string, prefix string) ([]string, cobra.ShellCompDirective) {
		return k.names(prefix, func(ctx context.Context, c kubernetes.Interface) ([]string, error) {
			l, err := c.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
			if err != nil {
				return nil, err
			}
			return namesOf(l.Items, func(n corev1.Namespace) string { return n.Name }), nil
		}), cobra.ShellCompDirectiveNoFileComp
	})
}

// names lists what list finds in the current cluster that starts with
// prefix, for shell completion (nothing when the cluster cannot answer
// within 5 s).
func (k *kube) names(prefix string, list func(context.Context, kubernetes.Interface) ([]string, error)) []string {
	c, _, _, err := k.client(k.context())
	if err != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	names, err := list(ctx, c)
	if err != nil {
		return nil
	}
	return prefixed(names, prefix)
}

// namesOf maps items to their names.
func namesOf[T any](items []T, name func(T) string) []string {
	out := make([]string, 0, len(items))
	for _, it := range items {
		out = append(out, name(it))
	}
	return out
}

func prefixed(names []string, prefix string) []string {
	var out []string
	for _, n := range names {
		if strings.HasPrefix(n, prefix) {
			out = append(out, n)
		}
	}
	return out
}
