# syntax=docker/dockerfile:1
# dbops-backup-controller: build from the repository root,
#   docker build -f deploy/docker/dbops-backup-controller.Dockerfile -t ghcr.io/dbops/dbops-backup-controller:0.1.0 .
#
# Builder: the workspace's pinned toolchain floor (rust-version 1.89), a --locked release
# build of this one binary. Runtime: Debian slim with PostgreSQL's client programs of
# every supported server major (13 to 18, PGDG's postgresql-client-<major>)
# for pg_dump, which streams each Backup into the store;
# run as the unprivileged uid 65532 that the Deployment names too.
ARG RUST_VERSION=1.89
ARG DEBIAN_BUILD=bookworm
# Built on bookworm's older glibc, the binary runs on trixie.
ARG DEBIAN_RUNTIME=trixie
# The client programs of every supported server major, from PGDG's apt repository
# (Debian's trixie has 17 only): pg_dump refuses servers newer than itself, pg_restore
# reads no archive of a newer pg_dump, and pg_restore 17 and newer cannot restore into a
# server older than 17 (SET transaction_timeout), so the controllers take the major that
# suits each operation's servers (--pg-dump/--pg-restore: the newest; --pg-bin-dir: the
# others; see the README's supported range). Keep the newest here >= the newest server.
ARG PG_MAJORS="13 14 15 16 17 18"
ARG PG_NEWEST=18
ARG PG_BIN_DIRS=/usr/lib/postgresql/13/bin,/usr/lib/postgresql/14/bin,/usr/lib/postgresql/15/bin,/usr/lib/postgresql/16/bin,/usr/lib/postgresql/17/bin,/usr/lib/postgresql/18/bin
# Substitutes for a build that reaches no Docker Hub, crates.io or PGDG (e2e/images, see
# docs/development.md "Images built here"); the defaults are the build above, unchanged.
#   RUNTIME_IMAGE: the runtime's base image.
#   BINARY_FROM=prebuilt: take bin/<binary> from the build context instead of the
#     builder stage (a context made for it: the repository's ignore file excludes target/).
#   PG_CLIENTS_FROM=context: take the client programs from the context's pg-clients/
#     (copied to /) or the base image instead of PGDG; PG_MAJORS, PG_NEWEST and
#     PG_BIN_DIRS then name the majors it holds.
ARG RUNTIME_IMAGE=debian:${DEBIAN_RUNTIME}-slim
ARG BINARY_FROM=builder
ARG PG_CLIENTS_FROM=pgdg

FROM rust:${RUST_VERSION}-slim-${DEBIAN_BUILD} AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --package dbops-backup-controller --bin dbops-backup-controller \
    && install -D -m 0755 target/release/dbops-backup-controller /out/dbops-backup-controller

FROM scratch AS prebuilt
COPY bin/dbops-backup-controller /out/dbops-backup-controller

FROM ${BINARY_FROM} AS binary

FROM ${RUNTIME_IMAGE} AS runtime-pgdg
ARG PG_MAJORS
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates postgresql-common \
    && /usr/share/postgresql-common/pgdg/apt.postgresql.org.sh -y \
    && apt-get install -y --no-install-recommends \
       $(for major in ${PG_MAJORS}; do echo "postgresql-client-${major}"; done) \
    && rm -rf /var/lib/apt/lists/*

FROM ${RUNTIME_IMAGE} AS runtime-context
COPY pg-clients/ /

FROM runtime-${PG_CLIENTS_FROM}
ARG PG_MAJORS
ARG PG_NEWEST
ARG PG_BIN_DIRS
RUN for major in ${PG_MAJORS}; do /usr/lib/postgresql/${major}/bin/pg_dump --version; done \
    && groupadd --system --gid 65532 dbops \
    && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin dbops
COPY --from=binary /out/dbops-backup-controller /usr/local/bin/dbops-backup-controller
ENV DBOPS_PG_DUMP=/usr/lib/postgresql/${PG_NEWEST}/bin/pg_dump \
    DBOPS_PG_BIN_DIRS=${PG_BIN_DIRS}
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/dbops-backup-controller"]
