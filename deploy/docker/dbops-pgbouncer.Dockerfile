# syntax=docker/dockerfile:1
# dbops-pgbouncer: the pooler Pods of DatabaseServers with spec.pooler. Build from the
# repository root,
#   docker build -f deploy/docker/dbops-pgbouncer.Dockerfile -t ghcr.io/dbops/dbops-pgbouncer:0.1.0 .
#
# Debian's PgBouncer and CA roots (the system roots a pooler uses for a server with
# tls.mode verify-* and no caSecretRef), and dbops-pgbouncer-run, which reloads PgBouncer
# when the mounted configuration changes. Runs as the unprivileged uid 65532 that the
# pooler's Deployment names too, on a read-only root: PgBouncer writes no file (no Unix
# socket, no log file, no pid file).
ARG DEBIAN_RUNTIME=trixie
ARG RUNTIME_IMAGE=debian:${DEBIAN_RUNTIME}-slim

FROM ${RUNTIME_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends pgbouncer ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && pgbouncer --version \
    && (getent group 65532 >/dev/null || groupadd --system --gid 65532 dbops) \
    && (getent passwd 65532 >/dev/null || useradd --system --uid 65532 --gid 65532 \
        --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin dbops)
COPY deploy/docker/pgbouncer/dbops-pgbouncer-run /usr/local/bin/dbops-pgbouncer-run
USER 65532:65532
EXPOSE 6432
ENTRYPOINT ["/usr/local/bin/dbops-pgbouncer-run"]
