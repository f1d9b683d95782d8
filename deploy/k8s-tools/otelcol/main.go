// Command otelcol is an OpenTelemetry Collector with only the k8sobjects
// receiver and the debug exporter: the hub collector the tests use to
// prove that a consumer proxyaudit did not write reads its OpenReports
// (deploy/k8s-tools/otelcol.sh builds it; internal/chart's tests run it).
package main

import (
	"log"

	"github.com/open-telemetry/opentelemetry-collector-contrib/receiver/k8sobjectsreceiver"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/receiver"
)

func components() (otelcol.Factories, error) {
	var f otelcol.Factories
	var err error
	if f.Receivers, err = receiver.MakeFactoryMap(k8sobjectsreceiver.NewFactory()); err != nil {
		return f, err
	}
	f.Exporters, err = exporter.MakeFactoryMap(debugexporter.NewFactory())
	return f, err
}

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{Command: "otelcol", Description: "OpenTelemetry Collector: k8sobjects receiver, debug exporter", Version: "0.111.0"},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{ResolverSettings: confmap.ResolverSettings{
			ProviderFactories: []confmap.ProviderFactory{fileprovider.NewFactory()}, DefaultScheme: "file"}},
	}
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		log.Fatal(err)
	}
}
