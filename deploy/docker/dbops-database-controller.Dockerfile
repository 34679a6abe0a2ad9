# syntax=docker/dockerfile:1
# dbops-database-controller: build from the repository root,
#   docker build -f deploy/docker/dbops-database-controller.Dockerfile -t ghcr.io/dbops/dbops-database-controller:0.1.0 .
#
# Builder: the workspace's pinned toolchain floor (rust-version 1.89), a --locked release
# build of this one binary. Runtime: Debian slim with PostgreSQL's client programs of
# every supported server major (13 to 18, PGDG's postgresql-client-<major>)
# for pg_restore, which fills a Database created with spec.restoreFrom, and pg_dump and
# psql, which copy one created with spec.cloneFrom;
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
# Substitutes for a build that reaches no Docker Hub, crates.io or PGDG (e2e/images; see
# docs/development.md, "Images built here"). The defaults are the build described above.
#   BUILDER_IMAGE, RUNTIME_IMAGE: the two stages' base images.
#   BINARY_FROM=context: install the context's bin/<binary> (built outside) instead of
#     running cargo (a context made for it: the ignore file beside this excludes target/).
#   PG_CLIENTS_FROM=context: no PGDG; the client programs are the runtime image's and the
#     context's pg-clients/ (copied to /); PG_MAJORS, PG_NEWEST, PG_BIN_DIRS name them.
ARG BUILDER_IMAGE=rust:${RUST_VERSION}-slim-${DEBIAN_BUILD}
ARG RUNTIME_IMAGE=debian:${DEBIAN_RUNTIME}-slim
ARG BINARY_FROM=cargo
ARG PG_CLIENTS_FROM=pgdg

FROM ${BUILDER_IMAGE} AS builder
ARG BINARY_FROM
ARG PG_CLIENTS_FROM
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    if [ "${BINARY_FROM}" = context ]; then \
      install -D -m 0755 bin/dbops-database-controller /out/dbops-database-controller; \
    else \
      cargo build --release --locked --package dbops-database-controller --bin dbops-database-controller \
      && install -D -m 0755 target/release/dbops-database-controller /out/dbops-database-controller; \
    fi \
    && mkdir -p /out/root \
    && if [ "${PG_CLIENTS_FROM}" = context ]; then cp -a pg-clients/. /out/root/; fi

FROM ${RUNTIME_IMAGE}
ARG PG_MAJORS
ARG PG_NEWEST
ARG PG_BIN_DIRS
ARG PG_CLIENTS_FROM
COPY --from=builder /out/root/ /
RUN if [ "${PG_CLIENTS_FROM}" = pgdg ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends ca-certificates postgresql-common \
      && /usr/share/postgresql-common/pgdg/apt.postgresql.org.sh -y \
      && apt-get install -y --no-install-recommends \
         $(for major in ${PG_MAJORS}; do echo "postgresql-client-${major}"; done); \
    fi \
    && for major in ${PG_MAJORS}; do /usr/lib/postgresql/${major}/bin/pg_dump --version; done \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 65532 dbops \
    && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin dbops
COPY --from=builder /out/dbops-database-controller /usr/local/bin/dbops-database-controller
ENV DBOPS_PG_RESTORE=/usr/lib/postgresql/${PG_NEWEST}/bin/pg_restore \
    DBOPS_PG_DUMP=/usr/lib/postgresql/${PG_NEWEST}/bin/pg_dump \
    DBOPS_PG_BIN_DIRS=${PG_BIN_DIRS}
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/dbops-database-controller"]
