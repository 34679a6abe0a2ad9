//! Traps a tenant sets for the admin (issue 21): code a database owner can plant in its own
//! database (or, on PostgreSQL 13 and 14, in the `public` schema of the `postgres`
//! database) that does nothing as the owner and takes over the server when anything runs
//! it with the admin's privileges. [`Traps::plant_in_own_database`] plants them as the
//! owner; [`Traps::escalations`] then says, server by server, whether any of them fired.
//!
//! Every trap calls `public.dbops_trap(origin)`, which makes three attempts, each in an
//! EXCEPTION block of its own (as the owner each fails silently):
//! - `CREATE ROLE dbops_trap_<origin> SUPERUSER`;
//! - `GRANT pg_write_server_files TO <owner>`;
//! - `COPY (SELECT 1) TO '<dir>/<origin>-<port>'`, a file made with the server's privileges.
//!
//! It logs `dbops-trap <origin> reached as <current_user>` (a WARNING: in the server log)
//! before, and `dbops-trap <origin> fired as <user>: <what>` after each attempt that
//! succeeded. The origins:
//! - `always_trigger`, `replica_trigger`: AFTER INSERT row triggers of `public.trapped`,
//!   `ENABLE ALWAYS` and `ENABLE REPLICA` (the second fires only where
//!   `session_replication_role = replica`: logical replication's workers);
//! - `index`, `check`, `generated`, `default`: an index expression, a CHECK constraint and
//!   a stored generated column of `public.trapped` calling an IMMUTABLE wrapper, and a
//!   column DEFAULT calling the trap itself;
//! - `shadow_*`: functions and operators in `public` that the default `search_path`
//!   (`"$user", public`, `pg_catalog` implicitly first) picks over `pg_catalog`'s because
//!   they match the call better: `format(text, name, name)` and
//!   `format(text, name, name, name, text)` over `format(text, VARIADIC "any")` for a call
//!   on name columns, `shobj_description(oid, text)` over `(oid, name)` for an unknown
//!   literal (text is the preferred string type), `pg_terminate_backend(integer,
//!   integer)` over `(integer, bigint)` for an integer constant, and the operators
//!   `~~`/`!~~` on `(name, name)` for `name [NOT] LIKE '<literal>'` (an unknown operand
//!   is taken as the other side's type, and `pg_catalog` has no such exact pair);
//! - `admin_schema`: `format(text, name, name, name, text)` in a schema named like the
//!   admin user, which `"$user"` puts first (and where an unpinned `CREATE EXTENSION`
//!   without `SCHEMA` lands);
//! - `path_*`: with the database's own `search_path` set to `"$user", public, pg_catalog`
//!   (`ALTER DATABASE ... SET`, which its owner may do), even a same-signature
//!   `public.current_setting(text)` and a view `public.pg_extension` come before the
//!   catalog's for every session that does not pin its own.
//!
//! Every trap returns what the built-in would, so nothing else changes.

use anyhow::{Context, Result};
use tokio_postgres::Client;

use crate::postgres::PgServer;
use crate::postgres::admin::AdminKind;
use crate::postgres::{SUPERUSER, quote_ident, quote_literal};

/// The roles an admin Secret of the tests may name: the harness's superuser and the
/// emulated managed admins ([`AdminKind`]).
fn admins() -> Vec<&'static str> {
    AdminKind::ALL.iter().map(|k| k.role()).collect()
}

/// The first words of each line a trap logs.
const TAG: &str = "dbops-trap";

/// What every trap calls, and the wrappers the table's expressions call. `{OWNER}` and
/// `{DIR}` are SQL literals.
const MACHINERY: &str = r#"
CREATE FUNCTION public.dbops_trap(origin text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $trap$
BEGIN
  RAISE WARNING 'dbops-trap % reached as %', origin, current_user;
  BEGIN
    EXECUTE format('CREATE ROLE %I SUPERUSER', 'dbops_trap_' || origin);
    RAISE WARNING 'dbops-trap % fired as %: CREATE ROLE SUPERUSER', origin, current_user;
  EXCEPTION WHEN OTHERS THEN NULL;
  END;
  BEGIN
    EXECUTE format('GRANT pg_write_server_files TO %I', {OWNER});
    RAISE WARNING 'dbops-trap % fired as %: GRANT pg_write_server_files', origin, current_user;
  EXCEPTION WHEN OTHERS THEN NULL;
  END;
  BEGIN
    EXECUTE format('COPY (SELECT 1) TO %L',
                   {DIR} || '/' || origin || '-' || current_setting('port'));
    RAISE WARNING 'dbops-trap % fired as %: COPY TO a file', origin, current_user;
  EXCEPTION WHEN OTHERS THEN NULL;
  END;
  RETURN true;
END $trap$;
-- IMMUTABLE, as index expressions and generated columns demand; its own statements run
-- read-only, the volatile trap's do not.
CREATE FUNCTION public.dbops_trap_value(origin text, v integer) RETURNS integer
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM public.dbops_trap(origin); RETURN v; END $$;
"#;

/// The shadows of built-ins in `public` (see the module's documentation).
const SHADOWS: &str = r#"
CREATE FUNCTION public.format(text, name, name) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('shadow_format'); RETURN pg_catalog.format($1, $2, $3); END $$;
CREATE FUNCTION public.format(text, name, name, name, text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('shadow_format5'); RETURN pg_catalog.format($1, $2, $3, $4, $5); END $$;
CREATE FUNCTION public.shobj_description(oid, text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('shadow_shobj_description');
      RETURN pg_catalog.shobj_description($1, $2::name); END $$;
CREATE FUNCTION public.pg_terminate_backend(integer, integer) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('shadow_pg_terminate_backend');
      RETURN pg_catalog.pg_terminate_backend($1); END $$;
CREATE FUNCTION public.dbops_like(name, name) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('shadow_like'); RETURN $1::text LIKE $2::text; END $$;
CREATE OPERATOR public.~~ (LEFTARG = name, RIGHTARG = name, FUNCTION = public.dbops_like);
CREATE FUNCTION public.dbops_not_like(name, name) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('shadow_not_like'); RETURN $1::text NOT LIKE $2::text; END $$;
CREATE OPERATOR public.!~~ (LEFTARG = name, RIGHTARG = name, FUNCTION = public.dbops_not_like);
CREATE FUNCTION public.current_setting(text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('path_current_setting'); RETURN pg_catalog.current_setting($1); END $$;
CREATE VIEW public.pg_extension AS
  SELECT e.* FROM pg_catalog.pg_extension e WHERE public.dbops_trap('path_pg_extension');
"#;

/// What only the database's owner can plant: the schema named like the admin, the
/// trapped table (3 rows, inserted as the owner) and the database's `search_path`.
/// `{ADMIN}` is an identifier.
const OWN_DATABASE: &str = r#"
CREATE SCHEMA {ADMIN};
CREATE FUNCTION {ADMIN}.format(text, name, name, name, text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM public.dbops_trap('admin_schema'); RETURN pg_catalog.format($1, $2, $3, $4, $5); END $$;
CREATE FUNCTION public.dbops_trap_trigger() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM public.dbops_trap(TG_ARGV[0]); RETURN NULL; END $$;
CREATE TABLE public.trapped (
  id integer PRIMARY KEY,
  v integer NOT NULL CHECK (public.dbops_trap_value('check', v) IS NOT NULL),
  d integer DEFAULT (CASE WHEN public.dbops_trap('default') THEN 0 END),
  g integer GENERATED ALWAYS AS (public.dbops_trap_value('generated', v)) STORED
);
CREATE INDEX trapped_expression ON public.trapped (public.dbops_trap_value('index', v));
CREATE TRIGGER trapped_always AFTER INSERT ON public.trapped
  FOR EACH ROW EXECUTE FUNCTION public.dbops_trap_trigger('always_trigger');
CREATE TRIGGER trapped_replica AFTER INSERT ON public.trapped
  FOR EACH ROW EXECUTE FUNCTION public.dbops_trap_trigger('replica_trigger');
ALTER TABLE public.trapped ENABLE ALWAYS TRIGGER trapped_always;
ALTER TABLE public.trapped ENABLE REPLICA TRIGGER trapped_replica;
INSERT INTO public.trapped (id, v) VALUES (1, 1), (2, 2), (3, 3);
DO $$ BEGIN
  EXECUTE pg_catalog.format('ALTER DATABASE %I SET search_path = "$user", public, pg_catalog',
                            pg_catalog.current_database());
END $$;
"#;

/// The traps of one test, and the directory their files would land in.
pub struct Traps {
    dir: tempfile::TempDir,
}

impl Traps {
    /// A new directory the servers' own user may write into (it stays empty unless a
    /// trap fired with the server's privileges).
    pub fn new() -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new().prefix("dbops-traps-").tempdir()?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))?;
        Ok(Self { dir })
    }

    fn machinery(&self, owner: &str) -> String {
        MACHINERY.replace("{OWNER}", &quote_literal(owner)).replace(
            "{DIR}",
            &quote_literal(&self.dir.path().display().to_string()),
        )
    }

    /// Plants every trap, as the owner `owner` connected (by `client`) to its own
    /// database: the machinery, the shadows, the admin-named schema, `public.trapped`
    /// with 3 rows, and the database's `search_path`.
    pub async fn plant_in_own_database(&self, client: &Client, owner: &str) -> Result<()> {
        let sql = format!(
            "{}{SHADOWS}{}",
            self.machinery(owner),
            OWN_DATABASE.replace("{ADMIN}", &quote_ident(AdminKind::for_tests().role()))
        );
        client
            .batch_execute(&sql)
            .await
            .with_context(|| format!("planting the traps as {owner}"))
    }

    /// Plants the machinery and the shadows in `public` of a database the owner `owner`
    /// does not own but may create in (`postgres` on PostgreSQL 13 and 14).
    pub async fn plant_shadows(&self, client: &Client, owner: &str) -> Result<()> {
        client
            .batch_execute(&format!("{}{SHADOWS}", self.machinery(owner)))
            .await
            .with_context(|| format!("planting the shadows as {owner}"))
    }

    /// What shows a trap fired with more than its owner's privileges, on each of
    /// `servers` (named for the report): a trap that ran as an admin (`postgres` or an
    /// emulated managed admin, [`AdminKind`]), even where it could not escalate; a role
    /// `dbops_trap_*` or any superuser but the harness's; a role other than the admins (not
    /// predefined) holding CREATEROLE, CREATEDB, REPLICATION or BYPASSRLS, or a member of
    /// another role; an admin that gained SUPERUSER or BYPASSRLS, or that some role became
    /// a member of; a file in the traps' directory. The admins' own memberships (a managed
    /// admin is a member of the roles it made, so it may act for them) are what they
    /// should be: they give the member roles nothing. When there is anything, the report
    /// ends with every `fired` line of the servers' logs, which says which trap and as
    /// whom. Empty: nothing escalated.
    pub async fn escalations(&self, servers: &[(&str, &PgServer)]) -> Result<Vec<String>> {
        let mut found = Vec::new();
        let admins = admins();
        for (name, pg) in servers {
            let admin = pinned_superuser(pg, "postgres").await?;
            let roles = admin
                .query(
                    "SELECT rolname::text, rolsuper, rolcreaterole, rolcreatedb, \
                            rolreplication, rolbypassrls \
                       FROM pg_roles \
                      WHERE rolname <> $1 AND NOT starts_with(rolname::text, 'pg_') \
                        AND (starts_with(rolname::text, 'dbops_trap_') OR rolsuper OR rolbypassrls \
                             OR (rolname <> ALL ($2::text[]) \
                                 AND (rolcreaterole OR rolcreatedb OR rolreplication)))",
                    &[&SUPERUSER, &admins],
                )
                .await?;
            let attributes = [
                "SUPERUSER",
                "CREATEROLE",
                "CREATEDB",
                "REPLICATION",
                "BYPASSRLS",
            ];
            for r in roles {
                let has: Vec<&str> = attributes
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| r.get::<_, bool>(i + 1))
                    .map(|(_, a)| *a)
                    .collect();
                found.push(format!("{name}: role {} {has:?}", r.get::<_, String>(0)));
            }
            let memberships = admin
                .query(
                    "SELECT m.member::regrole::text, m.roleid::regrole::text \
                       FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member \
                       JOIN pg_roles g ON g.oid = m.roleid \
                      WHERE NOT starts_with(r.rolname::text, 'pg_') \
                        AND (r.rolname <> ALL ($1::text[]) OR g.rolname = ANY ($1::text[]))",
                    &[&admins],
                )
                .await?;
            for m in memberships {
                found.push(format!(
                    "{name}: role {} is a member of {}",
                    m.get::<_, String>(0),
                    m.get::<_, String>(1)
                ));
            }
        }
        for (name, pg) in servers {
            for (origin, user, line) in runs(pg)? {
                if admins.contains(&user.as_str()) {
                    found.push(format!(
                        "{name}: trap {origin} ran as the admin {user}: {line}"
                    ));
                }
            }
        }
        for entry in std::fs::read_dir(self.dir.path())? {
            found.push(format!(
                "file {} made by a server",
                entry?.file_name().to_string_lossy()
            ));
        }
        if !found.is_empty() {
            for (name, pg) in servers {
                for line in log_lines(pg)?.iter().filter(|l| l.contains(" fired as ")) {
                    found.push(format!("{name} log: {line}"));
                }
            }
        }
        Ok(found)
    }
}

/// The users (`current_user`) the trap `origin` ran as on `pg`, per its log, in order.
pub fn reached(pg: &PgServer, origin: &str) -> Result<Vec<String>> {
    Ok(runs(pg)?
        .into_iter()
        .filter(|(o, _, _)| o == origin)
        .map(|(_, user, _)| user)
        .collect())
}

/// Every run of a trap on `pg`, per its log: (origin, `current_user`, the log line).
fn runs(pg: &PgServer) -> Result<Vec<(String, String, String)>> {
    let needle = format!("{TAG} ");
    Ok(log_lines(pg)?
        .into_iter()
        .filter_map(|line| {
            let (_, rest) = line.split_once(&needle)?;
            let (origin, user) = rest.split_once(" reached as ")?;
            let user = user.split_whitespace().next()?.to_string();
            Some((origin.to_string(), user, line))
        })
        .collect())
}

/// The lines of `pg`'s log a trap wrote.
fn log_lines(pg: &PgServer) -> Result<Vec<String>> {
    let path = pg.log_path();
    let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(String::from_utf8_lossy(&text)
        .lines()
        .filter(|l| l.contains(TAG) && l.contains("WARNING:"))
        .map(str::to_string)
        .collect())
}

/// A superuser session on `pg`'s `dbname` with `search_path` pinned to `pg_catalog`
/// (overriding the database's own setting), so that nothing a tenant planted is found
/// by name: how the harness reads a trapped server without springing the traps itself.
pub async fn pinned_superuser(pg: &PgServer, dbname: &str) -> Result<Client> {
    let client = pg.connect_as_superuser_to(dbname).await?;
    client
        .batch_execute("SET search_path = pg_catalog, pg_temp")
        .await?;
    Ok(client)
}
