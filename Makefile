# proxyaudit front door. The two commands a newcomer needs:
#   make demo   - real local cluster (etcd, kube-apiserver, 3 kube-proxies), one drifted node, the findings
#   make test   - unit tests and end-to-end tests on the real local cluster (root, Linux)
GO       ?= go
BIN      ?= bin
TIMEOUT  ?= 45m
# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion): its API server and
# kube-proxy are built for the live suite (localcluster.OldestKubernetes says the same).
OLDEST_K8S = v1.33.5
# Modules the chart's end-to-end tests read CRDs from (the monitoring and OpenReports APIs): downloaded
# by cluster-binaries, since lane 1 has no network (internal/chart's TestCRDModulesFetchedBeforeTheLanes).
CHART_CRD_MODULES = github.com/prometheus-operator/prometheus-operator@v0.85.0 github.com/openreports/reports-api@v0.2.1
# Under CI=true a machine that cannot run the end-to-end tests fails instead of skipping them.
E2E_REQUIRE := $(if $(filter true 1,$(CI)),1,0)

.PHONY: all build image test unit race e2e e2e-cilium e2e-long soak fixtures-cilium demo demo-deps demo-binaries modules screenshots fixtures bench bench-cost bench-flush bench-ipvs fleet-sim fuzz lint vulncheck fmt deps cluster-binaries helm chart-lint manifests release clean

all: build

# The flags of every build of proxyaudit's binaries (images and tests too: localcluster.GoBuildFlags) and
# of the k8s tools': the Go build cache then compiles a package once for all of them.
GOBUILD := env CGO_ENABLED=0 $(GO) build -trimpath -buildvcs=false

build: modules
	@deploy/quiet.sh build "building proxyaudit into $(BIN)/ (~1 min cold)" -- $(GOBUILD) -o $(BIN)/ ./cmd/...
	@cp $(BIN)/proxyaudit $(BIN)/kubectl-proxyaudit  # kubectl plugin: kubectl proxyaudit report

## release: a version's artifacts in dist/, the same bytes on every run of one commit: the CLI's archives
## (linux, darwin x amd64, arm64; the CLI is also the kubectl plugin), the collector's and aggregator's
## binaries (linux amd64, arm64), CycloneDX SBOMs (each binary's Go modules; the image's Debian packages
## and Go modules), the image for linux/amd64 and arm64 as an OCI index in dist/image, the chart package (version and appVersion X.Y.Z), the krew manifest and
## checksums.txt. VERSION=vX.Y.Z must have its section in CHANGELOG.md. PUSH=REGISTRY (e.g. ghcr.io/proxyaudit)
## also pushes the image index to REGISTRY/proxyaudit:X.Y.Z and the chart to oci://REGISTRY/charts, the
## packaged chart naming REGISTRY/proxyaudit; PUSH_CA verifies a registry of your own. SIGN_KEY=cosign.key
## (COSIGN_PASSWORD) or SIGN=keyless signs the pushed index and chart and attests each image's SBOM
release: modules
	@test -n "$(VERSION)" || { echo "make release: say VERSION=vX.Y.Z" >&2; exit 2; }
	rm -rf dist
	$(GO) run ./deploy/release -version $(VERSION) -out dist -sbom-tool $$(deploy/k8s-tools/release-tool.sh cyclonedx-gomod) \
		$(if $(PUSH),-push -registry $(PUSH) -helm $$(deploy/k8s-tools/helm.sh) $(if $(PUSH_CA),-ca-file $(PUSH_CA)) \
		$(if $(or $(SIGN_KEY),$(filter keyless,$(SIGN))),-cosign $$(deploy/k8s-tools/release-tool.sh cosign) $(if $(SIGN_KEY),-sign-key $(SIGN_KEY))))

## image: the project's container image without a container engine (Debian packages by version, the
## binaries built here), as bin/proxyaudit-image.tar for `ctr images import` (path printed last);
## IMAGE_ARGS=-all adds the kube-proxy, pause and CoreDNS images the local cluster's real nodes run
image: deps
	$(GO) run ./deploy/image -out $(BIN) $(IMAGE_ARGS)

## test: the README's test command (.ci/run calls it), in stages that answer fast:
##   1/3 unit tests of every package (-short: no cluster binaries, no cluster): a failing unit test is
##       reported, and ends the run, minutes after the start, before anything slow is built; then make lint;
##   2/3 the cluster binaries, then the packages with end-to-end tests (E2E_PKGS), whole, on the real
##       local cluster, in three lanes side by side: lane 0 (the machine's namespaces) runs E2E_LANE0, the
##       real-node suite; lanes 1 and 2 (deploy/lane.sh: a network and mount namespace
##       each) run E2E_LANE2 and the rest. A lane's packages take its cluster lock one at a time, the lanes
##       overlap (the suites wait on grace periods and leave much of the two cores idle). Beside them, at the lowest CPU priority
##       (nice 19): cosign's build (the real-node suite signs its releases; minutes of CPU cold), the
##       release's tests (BESIDE_PKGS, signed), every fuzz target briefly and the race detector over the
##       unit tests (make race -short); their log is printed at 3/3. Also beside, the genuine Cilium
##       agent's build, whose two suites run last in lanes 0 and 1 (cilium_after);
##   3/3 the results of what ran beside
# The packages with end-to-end tests: their tests import internal/localcluster (a cluster, root) or
# they have *_e2e_test.go files (slow builds: the release).
# The release's tests need no cluster and are not timing-sensitive: they run beside (BESIDE_PKGS).
BESIDE_PKGS = ./internal/release
E2E_PKGS = $$($(GO) list -f '{{.ImportPath}} {{join .TestImports " "}} {{join .XTestImports " "}} {{join .TestGoFiles " "}} {{join .XTestGoFiles " "}}' ./... | awk '/internal\/localcluster|_e2e_test\.go/ && $$1 !~ /internal\/release$$/ {print $$1}')
# Lane 0 holds the real kubelet nodes' suite alone (only lane 0 may run them: their cgroups and the
# host's forwarding are the machine's; it is the longest, ~28 min); lane 2 the collector's, the IPVS
# VM's, dualstack and the harness's own (~14 min); lane 1 every other end-to-end package (~21 min).
# Minutes each lane's packages held its lock: CONTRIBUTING.md.
E2E_LANE0 = internal/e2e/realnodes
E2E_LANE2 = internal/collector internal/e2e internal/e2e/dualstack internal/localcluster
MODULE = github.com/proxyaudit/proxyaudit
BESIDE_LOG = .cache/logs/make-test-beside.log
# gotestsum runs stage 2 (output as `go test` prints it, failures listed again at the end) and lists
# its slowest tests from the JSON it keeps: where CI's time goes, on every run. Installed into
# .cache/bin before stage 2: lanes 1 and 2 have no network to fetch it.
GOTESTSUM ?= gotest.tools/gotestsum@v1.13.0
GOTESTSUM_BIN = $(CURDIR)/.cache/bin/gotestsum
E2E_JSON = .cache/logs/make-test-e2e.json
# The genuine Cilium agent's suites (make e2e-cilium) run in make test after their lane's other
# packages: the agent (~6 min cold) and Debian's clang-19 are built and installed beside stage 2 at
# nice 19 (log: .cache/logs/make-test-cilium-build.log) while the lanes mostly wait, and each suite
# waits for CILIUM_READY (its .failed twin fails it). $(call cilium_after,LANE,PREFIX,RUN) runs RUN
# so (PREFIX: deploy/lane.sh LANE env, or nothing in lane 0) and sets cr to 1 if it failed.
CILIUM_READY = .cache/logs/make-test-cilium.ready
CILIUM_LIVE = -run TestE2ECiliumNode ./internal/e2e/live
CILIUM_REALNODES = -run TestE2ECiliumOnRealNodes ./internal/e2e/realnodes
define cilium_after
cr=0; w=0; while [ ! -e $(CILIUM_READY) ] && [ ! -e $(CILIUM_READY).failed ] && [ $$w -lt 480 ]; do sleep 5; w=$$((w + 1)); done; if [ -e $(CILIUM_READY) ]; then $(2) PROXYAUDIT_CILIUM=1 PROXYAUDIT_E2E_REQUIRE=$(E2E_REQUIRE) $(GOTESTSUM_BIN) --format standard-quiet --jsonfile $(E2E_JSON)-cilium$(1) -- -count=1 -timeout 20m $(3) || cr=1; else echo "lane $(1): the Cilium agent's build failed or took 40 minutes:"; tail -30 .cache/logs/make-test-cilium-build.log; cr=1; fi
endef
# A broken unit test ends make test as soon as its package reports it (CI's signal within minutes).
UNIT_MAX_FAILS ?= 1
test: deps modules
	@mkdir -p .cache/logs && date +%s > .cache/make-test.start
	@GOBIN=$(dir $(GOTESTSUM_BIN)) $(GO) install $(GOTESTSUM)
	@echo "== make test 1/3: unit tests, no cluster (go test -short ./...; the run ends at the first $(UNIT_MAX_FAILS) failing test(s): UNIT_MAX_FAILS=0 runs them all), then make lint"
	$(GOTESTSUM_BIN) --format standard-quiet --max-fails $(UNIT_MAX_FAILS) -- -short -count=1 ./...
	@echo "unit tests: $$(( $$(date +%s) - $$(cat .cache/make-test.start) )) s since the start"
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory cluster-binaries
	@echo "== make test 2/3 ($$(( $$(date +%s) - $$(cat .cache/make-test.start) )) s since the start): end-to-end tests on the real local cluster, lanes 0, 1 and 2 side by side; beside them at nice 19, the release tests, fuzz and race (log: $(BESIDE_LOG))"
	@mkdir -p $(dir $(BESIDE_LOG)); rm -f $(CILIUM_READY) $(CILIUM_READY).failed; \
	( start=$$(date +%s); nice -n 19 deploy/k8s-tools/release-tool.sh cosign >/dev/null; \
	  echo "cosign built after $$(( $$(date +%s) - start )) s"; \
	  PROXYAUDIT_RELEASE_SIGN=1 PROXYAUDIT_E2E_REQUIRE=$(E2E_REQUIRE) nice -n 19 $(GO) test -count=1 -timeout $(TIMEOUT) $(BESIDE_PKGS); p=$$?; \
	  echo "$(BESIDE_PKGS): exit $$p after $$(( $$(date +%s) - start )) s"; \
	  nice -n 19 $(MAKE) --no-print-directory fuzz FUZZTIME=$(TEST_FUZZTIME); f=$$?; \
	  echo "fuzz: exit $$f after $$(( $$(date +%s) - start )) s"; \
	  nice -n 19 $(MAKE) --no-print-directory race RACE_FLAGS=-short; r=$$?; \
	  echo "race: exit $$r after $$(( $$(date +%s) - start )) s"; [ $$p -eq 0 ] && [ $$f -eq 0 ] && [ $$r -eq 0 ] ) > $(BESIDE_LOG) 2>&1 & beside=$$!; \
	( deploy/install-deps.sh cilium && nice -n 19 deploy/quiet.sh cilium-build "building the genuine Cilium agent (v1.20.2; ~6 min cold)" -- deploy/k8s-tools/cilium.sh \
	  && touch $(CILIUM_READY) || touch $(CILIUM_READY).failed ) > .cache/logs/make-test-cilium-build.log 2>&1 & \
	lane0=; lane1=; lane2=; for p in $(E2E_PKGS); do n=" $${p#$(MODULE)/} "; \
	  case " $(E2E_LANE0) " in *"$$n"*) lane0="$$lane0 $$p"; continue ;; esac; \
	  case " $(E2E_LANE2) " in *"$$n"*) lane2="$$lane2 $$p"; continue ;; esac; lane1="$$lane1 $$p"; done; \
	echo "lane 0:$$lane0"; echo "lane 1:$$lane1"; echo "lane 2:$$lane2"; \
	for l in 1 2; do \
	  eval pkgs=\$$lane$$l; \
	  ( deploy/lane.sh $$l env PROXYAUDIT_E2E_REQUIRE=$(E2E_REQUIRE) $(GOTESTSUM_BIN) --format standard-quiet --jsonfile $(E2E_JSON)-lane$$l -- \
		-count=1 -timeout $(TIMEOUT) $$pkgs; r=$$?; \
	    if [ $$l = 1 ]; then $(call cilium_after,1,deploy/lane.sh 1 env,$(CILIUM_LIVE)); r=$$(( r | cr )); fi; \
	    echo "lane $$l: exit $$r after $$(( $$(date +%s) - $$(cat .cache/make-test.start) )) s since the start"; exit $$r ) & eval pid$$l=\$$!; done; \
	PROXYAUDIT_E2E_REQUIRE=$(E2E_REQUIRE) $(GOTESTSUM_BIN) --format standard-quiet --jsonfile $(E2E_JSON) -- \
		-count=1 -timeout $(TIMEOUT) $$lane0; rc=$$?; \
	$(call cilium_after,0,env,$(CILIUM_REALNODES)); rc=$$(( rc | cr )); \
	echo "lane 0: exit $$rc after $$(( $$(date +%s) - $$(cat .cache/make-test.start) )) s since the start"; \
	wait $$pid1; rc1=$$?; wait $$pid2; rc2=$$?; \
	echo "stage 2's slowest tests (30 s or more; a lane's suites wait for each other on its lock, so a package's time is not its own):"; \
	echo "lane 0:"; $(GOTESTSUM_BIN) tool slowest --jsonfile $(E2E_JSON) --threshold 30s; \
	for l in 1 2; do echo "lane $$l:"; $(GOTESTSUM_BIN) tool slowest --jsonfile $(E2E_JSON)-lane$$l --threshold 30s; done; \
	echo "== make test 3/3 ($$(( $$(date +%s) - $$(cat .cache/make-test.start) )) s since the start): what ran beside stage 2: $(BESIDE_PKGS), every fuzz target for $(TEST_FUZZTIME), the race detector"; \
	wait $$beside; brc=$$?; cat $(BESIDE_LOG); \
	echo "make test: $$(( $$(date +%s) - $$(cat .cache/make-test.start) )) s"; \
	[ $$rc -eq 0 ] && [ $$rc1 -eq 0 ] && [ $$rc2 -eq 0 ] && [ $$brc -eq 0 ]

## race: the packages whose goroutines share state (stream pool, collector, aggregator, executor,
## status page, CLI) under the race detector, one package at a time, end-to-end tests included (~8 min);
## RACE_FLAGS=-short (make test) leaves out the tests that need a cluster
RACE_PKGS ?= ./internal/stream ./internal/collector ./internal/aggregator ./remediate/... ./internal/ui ./cmd/proxyaudit ./cmd/proxyaudit-aggregator
race: deps
	$(GO) test -race -p 1 -count=1 -timeout 30m $(RACE_FLAGS) $(RACE_PKGS)

## unit: fast tests only, no local cluster
unit:
	$(GO) test -short -count=1 ./...

## e2e: end-to-end tests only, on the real local cluster
e2e: deps modules cluster-binaries
	PROXYAUDIT_E2E_REQUIRE=$(E2E_REQUIRE) $(GO) test -count=1 -timeout $(TIMEOUT) -run 'E2E' ./...

## e2e-cilium: the genuine Cilium agent (kube-proxy replacement) on a node of the live system, and as its
## DaemonSet's pod on a real kubelet node: in sync, frozen and found, restarted by remediation. make test runs
## both too, each after its lane's other packages, the agent built beside stage 2 (CILIUM_READY).
e2e-cilium: deps modules cluster-binaries
	@deploy/install-deps.sh cilium
	@deploy/quiet.sh cilium-build "building the genuine Cilium agent (v1.20.2; ~6 min cold)" -- deploy/k8s-tools/cilium.sh
	PROXYAUDIT_CILIUM=1 PROXYAUDIT_E2E_REQUIRE=1 $(GO) test -count=1 -timeout 30m -run 'TestE2ECiliumNode' -v ./internal/e2e/live
	PROXYAUDIT_CILIUM=1 PROXYAUDIT_E2E_REQUIRE=1 $(GO) test -count=1 -timeout 40m -run 'TestE2ECiliumOnRealNodes' -v ./internal/e2e/realnodes

## soak: an hour of a real cluster's life on the real kubelet nodes, the chart with remediation on (a
## Deployment scaled every 20 s and rolled out every 60 s, called by name, over kept TCP connections, over
## UDP and through a NodePort; pods killed, Services churned, CoreDNS and kube-proxy rolled, the API server
## restarted, the chart upgraded, a node drained) with faults injected on random nodes: every fault must
## be found and repaired or paged, and nothing else found, restarted or paged.
## make test runs the same for 6 minutes at a 10 s grace; SOAK, SOAK_GRACE and SOAK_FAULTS (a comma-separated
## list of: frozen, watch hung, watch hung for good, flushed, endpoint rewritten, UDP blackhole; empty: all, in turn) change it
SOAK ?= 60m
SOAK_GRACE ?= 30s
SOAK_FAULTS ?=
soak: deps modules cluster-binaries
	PROXYAUDIT_E2E_REQUIRE=1 $(GO) test -count=1 -timeout 120m -v -run '^TestE2ESoakOnRealNodes$$' ./internal/e2e/realnodes \
		-soak $(SOAK) -soak-grace $(SOAK_GRACE) -soak-faults '$(SOAK_FAULTS)'

## e2e-long: the suite kept out of `make test` because CI's budget cannot hold it: the hour's soak (make
## test runs it for six minutes)
e2e-long: soak

## demo: bring up the local cluster, drift one node, show the findings (builds only what it runs;
## each long step prints one line and logs to .cache/logs/, V=1 shows everything)
# The k8s tools first: proxyaudit's build then finds client-go and its kin compiled.
demo: demo-deps demo-binaries build
	@$(BIN)/localcluster demo --out demo-out

## screenshots: the README's pictures (the status page's fleet, a drifted node, incidents; the report in a
## terminal) from the real-node Chromium test, and the clusters page of `proxyaudit ui`, into docs/screenshots/
## (regenerate when the page changes)
screenshots: deps modules cluster-binaries
	PROXYAUDIT_SCREENSHOTS=$(CURDIR)/docs/screenshots PROXYAUDIT_E2E_REQUIRE=1 $(GO) test -count=1 -timeout 30m \
		-run '^TestE2EStatusPageOnRealNodes$$' ./internal/e2e/realnodes
	PROXYAUDIT_SCREENSHOTS=$(CURDIR)/docs/screenshots PROXYAUDIT_E2E_REQUIRE=1 $(GO) test -count=1 \
		-run '^TestUIAcrossClusters$$' ./cmd/proxyaudit

## fixtures: recapture audit/testdata/capture, audit/testdata/ipvs and audit/testdata/dualstack from genuine
## kube-proxies (review the diff); K8S_VERSION=vX.Y.Z captures the service matrix (clean, drift, large) and
## the IPVS VM's tables (clean, drift, weight0) from that release's kube-proxy (built from its own module:
## deploy/k8s-tools/tool-at.sh) into audit/testdata/k8s/vX.Y/{capture,ipvs,dualstack}, which the audit's
## conformance tests then judge too (1.37's IPVS mode is behind its KubeProxyIPVS gate, on by default)
fixtures: deps cluster-binaries
ifeq ($(K8S_VERSION),)
	$(GO) test -count=1 -timeout 30m -run 'TestE2ECaptureFixtures|TestE2EIPVS' ./internal/e2e -capture
	$(GO) test -count=1 -timeout 10m -run 'TestE2EDualStack' ./internal/e2e/dualstack -capture
else
	PROXYAUDIT_KUBE_PROXY=$$(deploy/k8s-tools/tool-at.sh $(K8S_VERSION)) \
		$(GO) test -count=1 -timeout 40m -run 'TestE2ECaptureFixtures|TestE2EIPVS' ./internal/e2e -capture \
		-capture-dir audit/testdata/k8s/$(basename $(K8S_VERSION))/capture
	PROXYAUDIT_KUBE_PROXY=$$(deploy/k8s-tools/tool-at.sh $(K8S_VERSION)) \
		$(GO) test -count=1 -timeout 10m -run 'TestE2EDualStack' ./internal/e2e/dualstack -capture \
		-capture-dir audit/testdata/k8s/$(basename $(K8S_VERSION))/dualstack
endif
	$(GO) test -count=1 ./audit -update

## fixtures-cilium: recapture dataplane/cilium/testdata from the genuine Cilium agent (in sync, frozen, dual-stack;
## review the diff). Builds the agent (~6 min cold) and installs clang-19.
fixtures-cilium: deps cluster-binaries
	@deploy/install-deps.sh cilium
	deploy/cilium/capture.sh dataplane/cilium/testdata
	deploy/cilium/capture.sh --dual-stack dataplane/cilium/testdata
	$(GO) test -count=1 -run Cilium ./audit -update

## bench: parse benchmarks and, as root, the side-by-side reads from a real kernel (docs/benchmarks.md);
## the long cost measurements are bench-cost
bench:
	$(GO) test -run '^$$' -bench . -benchmem -timeout 60m $$($(GO) list ./... | grep -v -e /internal/e2e/cost -e /internal/e2e/flush)

## bench-cost: what the collector costs a node at the anchors (10k services, 100k endpoints), beside
## genuine kube-proxies: a quiet node over 10 minutes, and kube-proxy's sync and programming
## latency with and without a collector under 100 changes/s (about 40 minutes; docs/benchmarks.md)
COST_BENCH ?= QuietNodeCollector|KubeProxyPerturbation
bench-cost: deps cluster-binaries
	$(GO) test -run '^$$' -bench '$(COST_BENCH)' -benchtime 1x -timeout 120m -v ./internal/e2e/cost

## bench-flush: how soon the real aggregator dates a flush and an endpoint's rule deleted by hand, at 10k
## services on every backend (IPVS in the VM), right after a whole rewrite and under partial syncs (~1 h)
bench-flush: deps cluster-binaries
	$(GO) test -run '^$$' -bench 'BenchmarkFlushToReport' -benchtime 1x -timeout 150m -v ./internal/e2e/flush

## bench-ipvs: the IPVS read (netlink vs ipvsadm -Sn, 10k services x 10 real servers) in the IPVS VM
IPVS_BENCH ?= -test.count 3 -test.benchtime 5x
bench-ipvs: deps
	$(GO) test -v -count=1 -timeout 45m -run '^TestIPVSBenchmarkInVM$$' ./internal/e2e -ipvs-bench '$(IPVS_BENCH)'

## fleet-sim: the real aggregator (FLEET_REPLICAS replicas, 2 by default) against the real API server at
## the anchors (10k services, 100k endpoints, 100 changes/s) with FLEET_SIZES simulated collectors, each
## reviewed by a real TokenReview; the leader is SIGKILLed mid-run, then nodes are replaced. With
## FLEET_SHARDS (e.g. FLEET_REPLICAS=4 FLEET_SHARDS=16) the replicas share the nodes by shard and a
## replica that does not lead is killed instead; results in docs/benchmarks.md
FLEET_SIZES ?= 250 500 1000
FLEET_REPLICAS ?= 2
FLEET_SHARDS ?= 0
FLEET_ARGS ?= -fleet-services 10000 -fleet-interval 10s -fleet-steady 60s -fleet-rounds 2
fleet-sim: deps cluster-binaries
	@for n in $(FLEET_SIZES); do \
		log=$$(mktemp); \
		$(GO) test -count=1 -timeout 60m -v -run '^TestE2EFleetSimulation$$' ./internal/fleetsim \
			-fleet-nodes $$n -fleet-replicas $(FLEET_REPLICAS) -fleet-shards $(FLEET_SHARDS) $(FLEET_ARGS) -fleet-report $(CURDIR)/fleet-sim.jsonl > $$log 2>&1; rc=$$?; \
		grep -E 'RESULT|fleet_e2e|FAIL|^ok' $$log; \
		if [ $$rc -ne 0 ]; then echo "fleet-sim: $$n nodes failed; full log in $$log"; exit $$rc; fi; rm -f $$log; \
	done

## fuzz: every Fuzz target in the repository (readers, stream decoder) for FUZZTIME (default 30s)
FUZZTIME ?= 30s
TEST_FUZZTIME ?= 5s
fuzz:
	@GO=$(GO) deploy/fuzz.sh $(FUZZTIME)

## manifests: re-render deploy/manifests/proxyaudit.yaml and the chart README values table (tests fail when stale)
manifests:
	$(GO) test -count=1 -run '^(TestManifestsInSync|TestChartReadmeValuesInSync)$$' ./internal/chart -update

## chart-lint: helm lint --strict on the chart with its default and ci/ values
chart-lint:
	$(GO) test -count=1 -run '^TestLintStrict$$' -v ./internal/chart

## helm: build (or reuse) the pinned Helm CLI; prints its path
helm:
	@deploy/k8s-tools/helm.sh

## lint: gofmt, go vet, staticcheck and actionlint (the workflows in .github; both pinned, built from their
## modules) and the chart's strict lint
GOVULNCHECK ?= golang.org/x/vuln/cmd/govulncheck@v1.9.0
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
ACTIONLINT  ?= github.com/rhysd/actionlint/cmd/actionlint@v1.7.12
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	$(GO) run $(ACTIONLINT) -shellcheck= -pyflakes=
	$(MAKE) --no-print-directory chart-lint

## vulncheck: govulncheck (pinned, built from its module) against vuln.go.dev; not in `make lint`
## because the database is not reachable from the machines CI runs on (no internet there)
vulncheck:
	$(GO) run $(GOVULNCHECK) ./...

fmt:
	gofmt -w $$(git ls-files '*.go')

## deps: Debian packages the local cluster and the tests need (root; no-op when present)
deps:
	@deploy/install-deps.sh

demo-deps:
	@deploy/install-deps.sh demo

## modules: download proxyaudit's Go modules (one line; the list is in .cache/logs/go-modules.log)
modules:
	@deploy/quiet.sh go-modules "downloading proxyaudit's Go modules" -- $(GO) mod download

## demo-binaries: build (or reuse) what the demo runs from Go modules: kube-apiserver, kube-proxy, etcd, kubectl,
## kubelet, kube-controller-manager, kube-scheduler, CoreDNS and Helm
demo-binaries:
	@deploy/k8s-tools/build.sh >/dev/null
	@deploy/k8s-tools/coredns.sh >/dev/null
	@deploy/k8s-tools/helm.sh >/dev/null

## cluster-binaries: the demo's, and the tests' own: Alertmanager, promtool, an OpenTelemetry Collector, and
## the release's tools (an OCI registry, krew, cyclonedx-gomod), built here so that no test builds one beside
## a timing-sensitive suite (cosign, minutes of both cores cold, is built by make test beside its suites), and
## the IPVS VM's image (apt-get download), the oldest supported release's API server and kube-proxy (the live
## suite installs the chart on them), the modules whose CRDs the chart's tests apply: lanes 1 and 2
## (deploy/lane.sh) have no network to fetch anything
cluster-binaries: demo-binaries
	@deploy/quiet.sh chart-crd-modules "downloading the modules whose CRDs the chart's tests apply" -- env GOFLAGS=-mod=mod $(GO) mod download $(CHART_CRD_MODULES)
	@deploy/k8s-tools/tool-at.sh $(OLDEST_K8S) kube-apiserver >/dev/null
	@deploy/k8s-tools/tool-at.sh $(OLDEST_K8S) kube-proxy >/dev/null
	@deploy/k8s-tools/alertmanager.sh >/dev/null
	@deploy/k8s-tools/promtool.sh >/dev/null
	@deploy/k8s-tools/otelcol.sh >/dev/null
	@deploy/k8s-tools/release-tool.sh registry >/dev/null
	@deploy/k8s-tools/release-tool.sh krew >/dev/null
	@deploy/k8s-tools/release-tool.sh cyclonedx-gomod >/dev/null
	@deploy/vm/build.sh >/dev/null

clean:
	rm -rf $(BIN) demo-out
