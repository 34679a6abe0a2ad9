# syntax=docker/dockerfile:1
# dbops-database-controller: build from the repository root,
#   docker build -f deploy/docker/dbops-database-controller.Dockerfile -t ghcr.io/dbops/dbops-database-controller:0.1.0 .
#
# Builder: the workspace's pinned toolchain floor (rust-version 1.89), a --locked release
# build of this one binary. Runtime: Debian slim with postgresql-client
# for pg_restore, which fills a Database created with spec.restoreFrom;
# run as the unprivileged uid 65532 that the Deployment names too.
ARG RUST_VERSION=1.89
ARG DEBIAN_BUILD=bookworm
# The runtime's Debian release decides the pg_dump/pg_restore major version (trixie: 17).
# pg_dump must be at least the major version of the servers it dumps, and pg_restore at
# least the pg_dump that wrote an artifact; use a newer release (or PGDG's packages) for
# newer servers. Built on bookworm's older glibc, the binary runs on trixie.
ARG DEBIAN_RUNTIME=trixie

FROM rust:${RUST_VERSION}-slim-${DEBIAN_BUILD} AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --package dbops-database-controller --bin dbops-database-controller \
    && install -D -m 0755 target/release/dbops-database-controller /out/dbops-database-controller

FROM debian:${DEBIAN_RUNTIME}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates postgresql-client \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 65532 dbops \
    && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin dbops
COPY --from=builder /out/dbops-database-controller /usr/local/bin/dbops-database-controller
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/dbops-database-controller"]
