# One image for the three binaries; the chart picks one per container with `command`.
#   docker build -t ghcr.io/proxyaudit/proxyaudit:0.1.0 .
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/ \
      ./cmd/proxyaudit ./cmd/proxyaudit-aggregator ./cmd/proxyaudit-collector

FROM debian:bookworm-slim
# The collector runs the same tools kube-proxy's rules are read with: iptables
# brings both backends (iptables-nft-save and iptables-legacy-save), nftables
# brings nft. The collector detects which one kube-proxy programs on the node
# (a KUBE-SERVICES chain in the nf_tables backend, else in legacy, or the
# nftables table ip kube-proxy), never the image's default alternative.
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && update-alternatives --set iptables /usr/sbin/iptables-nft
COPY --from=build /out/ /usr/local/bin/
# The aggregator and the CLI need no privileges; the chart runs the collector as
# root with NET_ADMIN and NET_RAW only.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/proxyaudit"]
