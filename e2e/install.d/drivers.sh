# shellcheck shell=bash
# Sourced by e2e/install (which sets $here, $cache and log()): the PostgreSQL drivers
# applications use, each from its own registry at the version pinned in e2e/drivers/versions
# (pgx in e2e/drivers/pgx/go.mod), for e2e/tests/e2e/drivers.rs:
#   $cache/psycopg-<version>/venv           psycopg 3 with its binary wheel (PyPI)
#   $cache/node-postgres-<version>/node_modules/pg   (npm)
#   $cache/pgjdbc-<version>/postgresql-<version>.jar (Maven Central)
#   $cache/pgx-connect-<version>/pgx-connect         (Go modules; e2e/drivers/pgx)
# An install only when that directory is missing; ~30 s cold, nothing warm.

dbops_driver_version() { # <name>
  awk -v n="$1" '$1==n {print $2; exit}' "$here/drivers/versions"
}

dbops_driver_install() { # <name> <version> <command...>: runs the command in a fresh dir
  local name=$1 version=$2 out tmp start
  shift 2
  out="$cache/$name-$version"
  [ -d "$out" ] && return 0
  log "installing $name $version into $out (first time only)"
  start=$(date +%s)
  tmp="$out.partial.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && "$@") >&2
  rm -rf "$out"; mv "$tmp" "$out"; trap - EXIT
  log "installed $name in $(( $(date +%s) - start ))s"
}

psycopg_version=$(dbops_driver_version psycopg)
# A venv's scripts name its directory, so it is made where it stays; the marker says the
# install finished.
if [ ! -e "$cache/psycopg-$psycopg_version/installed" ]; then
  rm -rf "$cache/psycopg-$psycopg_version"
  log "installing psycopg $psycopg_version into $cache/psycopg-$psycopg_version (first time only)"
  python3 -m venv "$cache/psycopg-$psycopg_version/venv" >&2
  "$cache/psycopg-$psycopg_version/venv/bin/pip" install -q --disable-pip-version-check \
    "psycopg[binary]==$psycopg_version" >&2 \
    || { rm -rf "$cache/psycopg-$psycopg_version"; log "pip install psycopg failed"; exit 1; }
  touch "$cache/psycopg-$psycopg_version/installed"
fi

node_pg_version=$(dbops_driver_version node-postgres)
dbops_driver_install node-postgres "$node_pg_version" \
  npm install --prefix . --no-audit --no-fund --silent "pg@$node_pg_version"

pgjdbc_version=$(dbops_driver_version pgjdbc)
dbops_driver_install pgjdbc "$pgjdbc_version" \
  mvn -q -B -Dstyle.color=never dependency:copy "-Dartifact=org.postgresql:postgresql:$pgjdbc_version" \
  -DoutputDirectory=.

dbops_go_tool pgx-connect drivers/pgx github.com/jackc/pgx/v5 .
