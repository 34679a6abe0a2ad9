"""Connects with psycopg 3 as docs/operations.md says: `python connect.py uri` passes the
Secret's `uri` (an environment variable of the same name); `python connect.py env`
passes nothing and lets libpq read the Secret's PG* variables. Prints one line:
`driver=psycopg <version> user=<login> ssl=<on|off>`."""
import os
import sys

import psycopg

conninfo = os.environ[sys.argv[2] if len(sys.argv) > 2 else "uri"] if sys.argv[1] == "uri" else ""
with psycopg.connect(conninfo, connect_timeout=10) as conn:
    user, ssl = conn.execute(
        "SELECT current_user, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
    ).fetchone()
    print(f"driver=psycopg {psycopg.__version__} user={user} ssl={'on' if ssl else 'off'}")
