# One image for every ARL service: `arl serve <service> [+ <service>…]`.
#
#   docker build -t arl .                      # compiles in rust:…-slim-trixie, runs on debian:trixie-slim
#   docker run arl serve controller --nats-url nats://nats:4222
#
# Build arguments:
#   ARTIFACTS=compiled (default) builds `arl` and `arl-sandbox-init` from this repository in
#     the official Rust image; ARTIFACTS=prebuilt takes them from the build context instead,
#     which is then a folder holding bin/arl and bin/arl-sandbox-init (stripped, built against
#     a glibc no newer than RUNTIME_BASE's) — for machines that cannot pull the Rust image.
#   RUNTIME_BASE: the final stage's base (default debian:trixie-slim); any Debian root with
#     /bin/sh, useradd and, when INSTALL_RUNTIME_PACKAGES=false, the runtime packages below.
#     Its glibc must be at least the one the binaries were linked against: keep RUST_IMAGE
#     (default rust:1.95-slim-trixie) and RUNTIME_BASE on the same Debian release.
#   INSTALL_RUNTIME_PACKAGES=true apt-get installs them into RUNTIME_BASE; false installs
#     nothing (no network needed) and only checks that RUNTIME_BASE already has them.
#
# scripts/image-check.sh (`make image-check`) builds it the second way on a machine without
# a Docker daemon or any pullable image (buildah, a debootstrap root), pushes it to a local
# registry and starts it.
#
# At run time: the ops endpoints (/health, /ready, /metrics) listen on 0.0.0.0:9090; two
# services colocated in one container need their own `--http-addr` each.

ARG ARTIFACTS=compiled
ARG RUST_IMAGE=rust:1.95-slim-trixie
ARG RUNTIME_BASE=debian:trixie-slim

# ---- compiled: the release binaries, from source --------------------------------------
FROM ${RUST_IMAGE} AS compiled
# librdkafka (the exporter's Kafka client) is built from source with cmake against OpenSSL.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        cmake make g++ pkg-config libssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# `target` is a cache mount (kept between builds, not in any layer): the binaries are copied
# out of it within the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p arl-cli --bin arl -p arl-sandbox --bin arl-sandbox-init \
    && mkdir -p /out \
    && cp target/release/arl target/release/arl-sandbox-init /out/ \
    && strip /out/arl /out/arl-sandbox-init

# ---- prebuilt: the same two binaries, from the build context ---------------------------
FROM scratch AS prebuilt
COPY bin/arl bin/arl-sandbox-init /out/

FROM ${ARTIFACTS} AS artifacts

# ---- runtime ---------------------------------------------------------------------------
FROM ${RUNTIME_BASE}
ARG INSTALL_RUNTIME_PACKAGES=true
# The sandbox service's bubblewrap backend runs bwrap, setpriv (util-linux), git, tar and
# kill (procps); TLS to NATS, registries and OTLP collectors needs the CA bundle; the
# exporter's librdkafka links OpenSSL's libssl (the `openssl` package pulls the suite's own).
# scripts/image-check.sh reads this line for its debootstrap root: keep it on one line.
ARG RUNTIME_PACKAGES="ca-certificates bubblewrap git openssl procps tar util-linux"
RUN set -eu; \
    if [ "$INSTALL_RUNTIME_PACKAGES" = true ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            $RUNTIME_PACKAGES; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    for tool in bwrap setpriv git tar kill; do \
        command -v "$tool" >/dev/null \
            || { echo "RUNTIME_BASE has no $tool: use INSTALL_RUNTIME_PACKAGES=true or a base with it" >&2; exit 1; }; \
    done; \
    [ -s /etc/ssl/certs/ca-certificates.crt ] \
        || { echo "RUNTIME_BASE has no CA bundle (ca-certificates)" >&2; exit 1; }; \
    groupadd --system --gid 10001 arl; \
    useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/arl --create-home \
        --shell /usr/sbin/nologin arl
# arl-sandbox-init ships beside the executable: the sandbox service finds it there.
COPY --from=artifacts /out/arl /out/arl-sandbox-init /usr/local/bin/
ENV HOME=/var/lib/arl \
    ARL_HTTP_ADDR=0.0.0.0:9090
WORKDIR /var/lib/arl
USER 10001:10001
EXPOSE 9090
LABEL org.opencontainers.image.title="arl" \
      org.opencontainers.image.description="ARL: RL training for LLM agents; every service as arl serve <service>"
ENTRYPOINT ["/usr/local/bin/arl"]
CMD ["serve", "--help"]
