//! The SQL of a DatabaseUser. Roles, all marked `dbops.dev/uid=<DatabaseUser uid>`:
//! - the group `<base>` (NOLOGIN) holds the privileges in the Database's database;
//! - the logins `<base>_1` and `<base>_2` (LOGIN, INHERIT, members of the group) take
//!   turns: the connection Secret names one; after a rotation the other keeps working
//!   until its `VALID UNTIL` (`keepPrevious`), then loses LOGIN and its sessions end.
//!
//! Privileges are granted by the Database's owner (`SET LOCAL ROLE <owner>` in the
//! admin's transaction: nothing runs with the admin's rights but the role changes), on
//! what the owner owns now and, through `ALTER DEFAULT PRIVILEGES FOR ROLE <owner>`, on
//! what it creates later (schemas included when the user covers every schema). Every
//! identifier and literal is quoted; passwords travel only as SCRAM verifiers, unlogged.

use dbops_api::Access;
use dbops_shared::postgres::ddl::{self, Unlogged};
use dbops_shared::postgres::{PgError, Session, quote_ident, quote_literal};

/// Runs `statements` in one transaction (a failure rolls it back: the pooled session is
/// never left inside an aborted transaction).
async fn in_transaction(
    s: &mut Session,
    statements: &[String],
    doing: String,
) -> Result<(), PgError> {
    let tx = s
        .transaction()
        .await
        .map_err(PgError::sql(format!("{doing}: BEGIN")))?;
    tx.batch_execute(&statements.join("; "))
        .await
        .map_err(PgError::sql(doing.clone()))?;
    tx.commit()
        .await
        .map_err(PgError::sql(format!("{doing}: COMMIT")))
}

/// The group role of a DatabaseUser: `<database>_<name>` (non-identifier characters of
/// the name read as `_`), shortened with a hash to leave room for the logins' `_1`/`_2`.
pub fn group_role(database: &str, name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '_' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '_',
        })
        .collect();
    let full = format!("{database}_{name}");
    if full.len() <= 61 {
        return full;
    }
    let hash = dbops_shared::checksum::sha256_hex(full.as_bytes());
    format!("{}_{}", &full[..54], &hash[..6])
}

/// The two logins of a group, in turn order.
pub fn logins(group: &str) -> [String; 2] {
    [format!("{group}_1"), format!("{group}_2")]
}

/// One role as observed.
#[derive(Debug, Clone, PartialEq)]
pub struct RoleState {
    pub name: String,
    pub comment: Option<String>,
    pub can_login: bool,
    pub connection_limit: i32,
    /// `VALID UNTIL`, in seconds since the epoch (`None`: none, or infinity).
    pub valid_until: Option<f64>,
    /// Settings set with `ALTER ROLE ... SET` for every database, `name=value`.
    pub settings: Vec<String>,
    /// A member of the group.
    pub in_group: bool,
}

/// Reads the group and the logins (roles are the server's, not one database's).
pub async fn observe_roles(
    s: &Session,
    group: &str,
    names: &[String],
) -> Result<Vec<RoleState>, PgError> {
    let rows = s
        .query(
            "SELECT r.rolname::text, pg_catalog.shobj_description(r.oid, 'pg_authid'), \
                    r.rolcanlogin, r.rolconnlimit, \
                    CASE WHEN r.rolvaliduntil IS NULL OR r.rolvaliduntil = 'infinity' THEN NULL \
                         ELSE pg_catalog.date_part('epoch', r.rolvaliduntil)::float8 END, \
                    ARRAY(SELECT c FROM pg_catalog.pg_db_role_setting x, \
                                 pg_catalog.unnest(x.setconfig) AS c \
                           WHERE x.setrole = r.oid AND x.setdatabase = 0 ORDER BY c), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_auth_members m \
                              JOIN pg_catalog.pg_roles g ON g.oid = m.roleid \
                             WHERE m.member = r.oid AND g.rolname = $2) \
               FROM pg_catalog.pg_roles r WHERE r.rolname = ANY($1::text[])",
            &[&names, &group],
        )
        .await
        .map_err(PgError::sql("reading the user's roles"))?;
    Ok(rows
        .iter()
        .map(|r| RoleState {
            name: r.get(0),
            comment: r.get(1),
            can_login: r.get(2),
            connection_limit: r.get(3),
            valid_until: r.get(4),
            settings: r.get(5),
            in_group: r.get(6),
        })
        .collect())
}

/// Creates the group role, marked (NOLOGIN).
pub async fn create_group(s: &mut Session, group: &str, mark: &str) -> Result<(), PgError> {
    let g = quote_ident(group);
    in_transaction(
        s,
        &[
            format!("CREATE ROLE {g} NOLOGIN"),
            format!("COMMENT ON ROLE {g} IS {}", quote_literal(mark)),
        ],
        format!("creating role {group}"),
    )
    .await
}

/// What a login must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginSpec<'a> {
    pub name: &'a str,
    pub group: &'a str,
    pub mark: &'a str,
    pub connection_limit: i32,
    /// `name=value` of [`crate::limits::MANAGED_SETTINGS`] wanted, sorted.
    pub settings: &'a [(&'static str, String)],
}

/// The statements that bring an existing (or just created) login to `want` (everything
/// but its password and its LOGIN/VALID UNTIL, which [`activate`] and [`expire`] set).
fn login_statements(want: &LoginSpec<'_>, have: Option<&RoleState>) -> Vec<String> {
    let r = quote_ident(want.name);
    let mut out = Vec::new();
    if have.is_none_or(|h| h.connection_limit != want.connection_limit) {
        out.push(format!(
            "ALTER ROLE {r} CONNECTION LIMIT {}",
            want.connection_limit
        ));
    }
    if have.is_none_or(|h| !h.in_group) {
        out.push(format!("GRANT {} TO {r}", quote_ident(want.group)));
    }
    let current: Vec<String> = have.map_or(Vec::new(), |h| h.settings.clone());
    out.extend(settings_statements(want.name, want.settings, &current));
    out
}

/// The statements that bring the settings of `role` (`current`: `name=value` set for every
/// database) to `want`; settings other than [`crate::limits::MANAGED_SETTINGS`] are left
/// alone.
pub fn settings_statements(
    role: &str,
    want: &[(&'static str, String)],
    current: &[String],
) -> Vec<String> {
    let r = quote_ident(role);
    let mut out = Vec::new();
    for (name, value) in want {
        let line = format!("{name}={value}");
        if !current.contains(&line) {
            out.push(format!(
                "ALTER ROLE {r} SET {name} = {}",
                quote_literal(value)
            ));
        }
    }
    for name in crate::limits::MANAGED_SETTINGS {
        let wanted = want.iter().any(|(n, _)| *n == name);
        let set = current
            .iter()
            .any(|c| c.split_once('=').is_some_and(|(n, _)| n == name));
        if set && !wanted {
            out.push(format!("ALTER ROLE {r} RESET {name}"));
        }
    }
    out
}

/// The settings of `role` set for every database (`name=value`, sorted).
pub async fn role_settings(s: &Session, role: &str) -> Result<Vec<String>, PgError> {
    let row = s
        .query_one(
            "SELECT ARRAY(SELECT c FROM pg_catalog.pg_db_role_setting x \
                            JOIN pg_catalog.pg_roles r ON r.oid = x.setrole, \
                            pg_catalog.unnest(x.setconfig) AS c \
                           WHERE r.rolname = $1 AND x.setdatabase = 0 ORDER BY c)",
            &[&role],
        )
        .await
        .map_err(PgError::sql(format!("reading the settings of {role}")))?;
    Ok(row.get(0))
}

/// Sets the settings of `role` as `statements` ([`settings_statements`]) say.
pub async fn apply_settings(
    s: &mut Session,
    role: &str,
    statements: &[String],
) -> Result<(), PgError> {
    if statements.is_empty() {
        return Ok(());
    }
    in_transaction(
        s,
        statements,
        format!("setting the session settings of {role}"),
    )
    .await
}

/// Whether `have` is a login as `want` says, able to log in without expiry.
#[cfg(test)]
pub fn login_converged(want: &LoginSpec<'_>, have: &RoleState) -> bool {
    have.can_login && have.valid_until.is_none() && login_statements(want, Some(have)).is_empty()
}

/// Whether `have` needs more than its password and LOGIN to be as `want` says.
pub fn login_drifted(want: &LoginSpec<'_>, have: &RoleState) -> bool {
    !login_statements(want, Some(have)).is_empty()
}

/// Makes `want` the login in use: created when missing (marked), LOGIN without expiry,
/// its limit, settings and group, and `password` (its verifier, unlogged), in one
/// transaction.
pub async fn activate(
    s: &mut Session,
    want: &LoginSpec<'_>,
    have: Option<&RoleState>,
    password: &str,
) -> Result<(), PgError> {
    let r = quote_ident(want.name);
    let mut statements = Vec::new();
    if have.is_none() {
        statements.push(format!("CREATE ROLE {r} LOGIN INHERIT"));
        statements.push(format!(
            "COMMENT ON ROLE {r} IS {}",
            quote_literal(want.mark)
        ));
    }
    statements.push(format!("ALTER ROLE {r} LOGIN VALID UNTIL 'infinity'"));
    statements.extend(login_statements(want, have));
    ddl::execute_unlogged(
        s,
        Unlogged::InTransactionAfter(&statements.join("; ")),
        &ddl::password_statement(want.name, password),
        format!("setting up login {}", want.name),
    )
    .await
}

/// Brings a login's limit, settings and group to `want`, password and LOGIN untouched.
pub async fn repair(
    s: &mut Session,
    want: &LoginSpec<'_>,
    have: &RoleState,
) -> Result<(), PgError> {
    let statements = login_statements(want, Some(have));
    if statements.is_empty() {
        return Ok(());
    }
    in_transaction(s, &statements, format!("repairing login {}", want.name)).await
}

/// The previous login keeps working until `until` (RFC 3339): its password expires then.
pub async fn keep_until(s: &Session, login: &str, until: &str) -> Result<(), PgError> {
    ddl::execute(
        s,
        &format!(
            "ALTER ROLE {} VALID UNTIL {}",
            quote_ident(login),
            quote_literal(until)
        ),
        format!("keeping login {login} until {until}"),
    )
    .await
}

/// The previous login's time is up: it can no longer log in, and its sessions end.
pub async fn retire(s: &Session, login: &str) -> Result<(), PgError> {
    ddl::execute(
        s,
        &format!("ALTER ROLE {} NOLOGIN", quote_ident(login)),
        format!("retiring login {login}"),
    )
    .await?;
    end_sessions(s, &[login.to_string()]).await
}

/// Ends every session of `roles` on the server.
pub async fn end_sessions(s: &Session, roles: &[String]) -> Result<(), PgError> {
    s.execute(
        "SELECT pg_catalog.pg_terminate_backend(pid) FROM pg_catalog.pg_stat_activity \
          WHERE usename = ANY($1::text[]) AND pid <> pg_catalog.pg_backend_pid()",
        &[&roles],
    )
    .await
    .map_err(PgError::sql("ending the user's sessions"))?;
    Ok(())
}

/// The privileges of `access` on tables (and views) and on sequences, sorted as
/// `aclexplode` names them.
pub fn privileges(access: Access) -> (&'static [&'static str], &'static [&'static str]) {
    match access {
        Access::ReadOnly => (&["SELECT"], &["SELECT"]),
        Access::ReadWrite => (
            &["DELETE", "INSERT", "SELECT", "UPDATE"],
            &["SELECT", "UPDATE", "USAGE"],
        ),
    }
}

/// The schemas a user covers: the listed ones (those that exist), or every schema but
/// PostgreSQL's own; of them, only those the owner owns (or `public`) get grants, since
/// only those are the owner's to give.
const SCOPE: &str = "\
    WITH o AS (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $1), \
         g AS (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $2), \
         s AS (SELECT n.oid, n.nspname::text AS name FROM pg_catalog.pg_namespace n, o \
                WHERE n.nspname !~ '^pg_' AND n.nspname <> 'information_schema' \
                  AND (pg_catalog.cardinality($3::text[]) = 0 OR n.nspname = ANY($3::text[])) \
                  AND (n.nspowner = o.oid OR n.nspname = 'public'))";

/// Whether the user's privileges in the database are exactly those of `access` over its
/// schemas, now and by default; `missing` lists schemas the spec names that do not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grants {
    pub converged: bool,
    pub missing_schemas: Vec<String>,
    /// The schemas in scope (for the grants).
    pub schemas: Vec<String>,
    /// Default ACL entries for the group: `(schema or "", object type)`.
    pub defaults: Vec<(String, String)>,
    /// Everyone may create in schema `public` (PostgreSQL before 15): a ReadWrite user
    /// could make tables there, so CREATE goes to the owner alone.
    pub public_create: bool,
}

/// Observes the group's privileges (a session on the Database's own database).
pub async fn observe_grants(
    s: &Session,
    owner: &str,
    group: &str,
    database: &str,
    schemas: &[String],
    access: Access,
) -> Result<Grants, PgError> {
    let (tables, sequences) = privileges(access);
    let tables: Vec<&str> = tables.to_vec();
    let sequences: Vec<&str> = sequences.to_vec();
    let everywhere = schemas.is_empty();
    let row = s
        .query_one(
            &format!(
                "{SCOPE}, \
                 rel AS (SELECT c.relkind, COALESCE((SELECT pg_catalog.array_agg(a.privilege_type::text ORDER BY a.privilege_type) \
                                 FROM pg_catalog.aclexplode(c.relacl) a, g WHERE a.grantee = g.oid), '{{}}') AS privs \
                           FROM pg_catalog.pg_class c JOIN s ON c.relnamespace = s.oid, o \
                          WHERE c.relowner = o.oid AND c.relkind IN ('r','p','v','m','f','S')), \
                 def AS (SELECT COALESCE(n.nspname::text, '') AS schema, d.defaclobjtype::text AS kind, \
                                (SELECT pg_catalog.array_agg(a.privilege_type::text ORDER BY a.privilege_type) \
                                   FROM pg_catalog.aclexplode(d.defaclacl) a, g WHERE a.grantee = g.oid) AS privs \
                           FROM pg_catalog.pg_default_acl d JOIN o ON d.defaclrole = o.oid \
                           LEFT JOIN pg_catalog.pg_namespace n ON n.oid = d.defaclnamespace) \
                 SELECT \
                   (SELECT count(*) FROM rel WHERE relkind <> 'S' AND privs <> $4::text[])::int, \
                   (SELECT count(*) FROM rel WHERE relkind = 'S' AND privs <> $5::text[])::int, \
                   (SELECT count(*) FROM s, g WHERE NOT pg_catalog.has_schema_privilege(g.oid, s.oid, 'USAGE'))::int, \
                   (SELECT pg_catalog.has_database_privilege(g.oid, $6, 'CONNECT') FROM g), \
                   ARRAY(SELECT name FROM s ORDER BY name), \
                   ARRAY(SELECT u FROM pg_catalog.unnest($3::text[]) u \
                          WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace n WHERE n.nspname = u) ORDER BY u), \
                   ARRAY(SELECT schema || ':' || kind || ':' || pg_catalog.array_to_string(privs, ',') \
                           FROM def WHERE privs IS NOT NULL ORDER BY 1), \
                   EXISTS (SELECT 1 FROM pg_catalog.pg_namespace n, pg_catalog.aclexplode(n.nspacl) a \
                            WHERE n.nspname = 'public' AND a.grantee = 0 AND a.privilege_type = 'CREATE')"
            ),
            &[&owner, &group, &schemas, &tables, &sequences, &database],
        )
        .await
        .map_err(PgError::sql("reading the user's privileges"))?;
    let wrong_tables: i32 = row.get(0);
    let wrong_sequences: i32 = row.get(1);
    let schemas_without_usage: i32 = row.get(2);
    let connect: Option<bool> = row.get(3);
    let in_scope: Vec<String> = row.get(4);
    let missing: Vec<String> = row.get(5);
    let defaults_found: Vec<String> = row.get(6);
    let public_create: bool = row.get(7);
    let mut defaults_wanted: Vec<String> = if everywhere {
        vec![
            format!(":S:{}", sequences.join(",")),
            ":n:USAGE".to_string(),
            format!(":r:{}", tables.join(",")),
        ]
    } else {
        in_scope
            .iter()
            .flat_map(|n| {
                [
                    format!("{n}:S:{}", sequences.join(",")),
                    format!("{n}:r:{}", tables.join(",")),
                ]
            })
            .collect()
    };
    defaults_wanted.sort();
    let defaults = defaults_found
        .iter()
        .filter_map(|d| {
            let mut parts = d.splitn(3, ':');
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    Ok(Grants {
        converged: wrong_tables == 0
            && !public_create
            && wrong_sequences == 0
            && schemas_without_usage == 0
            && connect == Some(true)
            && defaults_found == defaults_wanted,
        missing_schemas: missing,
        schemas: in_scope,
        defaults,
        public_create,
    })
}

/// Grants `access` to the group, as the owner, in one transaction: CONNECT, USAGE on the
/// schemas in scope, exactly the privileges of `access` on the owner's tables and
/// sequences there, and the same by default for what the owner creates later; default
/// privileges of the group that no longer apply are revoked.
pub async fn grant(
    s: &mut Session,
    owner: &str,
    group: &str,
    database: &str,
    everywhere: bool,
    found: &Grants,
    access: Access,
) -> Result<(), PgError> {
    let (tables, sequences) = privileges(access);
    let (o, g) = (quote_ident(owner), quote_ident(group));
    // One grant at a time per database: two users of one Database granting at once
    // would meet "tuple concurrently updated" on the database's and schemas' ACLs.
    let mut statements = vec![format!(
        "SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext({}))",
        quote_literal(&format!("dbops.dev/grant/{database}"))
    )];
    if found.public_create {
        // As the admin (public belongs to the bootstrap superuser before 15): CREATE in
        // public for the owner only, as PostgreSQL 15 has it.
        statements.push(format!("GRANT CREATE ON SCHEMA public TO {o}"));
        statements.push("REVOKE CREATE ON SCHEMA public FROM PUBLIC".to_string());
    }
    statements.extend([
        format!("SET LOCAL ROLE {o}"),
        format!("GRANT CONNECT ON DATABASE {} TO {g}", quote_ident(database)),
    ]);
    for schema in &found.schemas {
        let n = quote_ident(schema);
        statements.push(format!("GRANT USAGE ON SCHEMA {n} TO {g}"));
        statements.push(format!("REVOKE ALL ON ALL TABLES IN SCHEMA {n} FROM {g}"));
        statements.push(format!(
            "GRANT {} ON ALL TABLES IN SCHEMA {n} TO {g}",
            tables.join(", ")
        ));
        statements.push(format!(
            "REVOKE ALL ON ALL SEQUENCES IN SCHEMA {n} FROM {g}"
        ));
        statements.push(format!(
            "GRANT {} ON ALL SEQUENCES IN SCHEMA {n} TO {g}",
            sequences.join(", ")
        ));
    }
    // Default privileges: what no longer applies goes, then what applies is set anew.
    for (schema, kind) in &found.defaults {
        let on = match kind.as_str() {
            "r" => "TABLES",
            "S" => "SEQUENCES",
            "n" => "SCHEMAS",
            "f" => "FUNCTIONS",
            "T" => "TYPES",
            _ => continue,
        };
        let in_schema = if schema.is_empty() {
            String::new()
        } else {
            format!(" IN SCHEMA {}", quote_ident(schema))
        };
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o}{in_schema} REVOKE ALL ON {on} FROM {g}"
        ));
    }
    let targets: Vec<String> = if everywhere {
        vec![String::new()]
    } else {
        found
            .schemas
            .iter()
            .map(|n| format!(" IN SCHEMA {}", quote_ident(n)))
            .collect()
    };
    for in_schema in &targets {
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o}{in_schema} GRANT {} ON TABLES TO {g}",
            tables.join(", ")
        ));
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o}{in_schema} GRANT {} ON SEQUENCES TO {g}",
            sequences.join(", ")
        ));
    }
    if everywhere {
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o} GRANT USAGE ON SCHEMAS TO {g}"
        ));
    }
    in_transaction(
        s,
        &statements,
        format!("granting {} to {group}", access.as_str()),
    )
    .await
}

/// The databases where `roles` hold privileges or own something (`pg_shdepend`), with
/// each database's owner.
pub async fn databases_depending_on(
    s: &Session,
    roles: &[String],
) -> Result<Vec<(String, String)>, PgError> {
    Ok(s.query(
        "SELECT DISTINCT d.datname::text, pg_catalog.pg_get_userbyid(d.datdba)::text \
               FROM pg_catalog.pg_shdepend sd \
               JOIN pg_catalog.pg_database d ON d.oid = sd.dbid \
               JOIN pg_catalog.pg_roles r ON r.oid = sd.refobjid \
              WHERE sd.refclassid = 'pg_catalog.pg_authid'::regclass \
                AND r.rolname = ANY($1::text[]) AND d.datallowconn",
        &[&roles],
    )
    .await
    .map_err(PgError::sql(
        "finding where the user's roles hold privileges",
    ))?
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect())
}

/// In the Database's database: whatever the roles own goes to the owner, and their
/// privileges there (default ones included) are revoked (`REASSIGN OWNED`, `DROP OWNED`).
/// A read-write transaction even where the database defaults to read-only ones: the
/// source a Migration froze (`default_transaction_read_only`, kept with
/// `sourceRetention: Keep`) still holds the privileges of the users that moved away.
pub async fn disown(s: &mut Session, owner: &str, roles: &[String]) -> Result<(), PgError> {
    if roles.is_empty() {
        return Ok(());
    }
    let list = roles
        .iter()
        .map(|r| quote_ident(r))
        .collect::<Vec<_>>()
        .join(", ");
    in_transaction(
        s,
        &[
            "SET TRANSACTION READ WRITE".to_string(),
            format!("REASSIGN OWNED BY {list} TO {}", quote_ident(owner)),
            format!("DROP OWNED BY {list}"),
        ],
        format!("revoking the privileges of {list}"),
    )
    .await
}

/// Drops the roles: the logins can no longer log in, their sessions end, then every role
/// goes (`roles` in drop order, the group last).
pub async fn drop_roles(s: &mut Session, roles: &[String]) -> Result<(), PgError> {
    if roles.is_empty() {
        return Ok(());
    }
    let existing: Vec<String> = s
        .query(
            "SELECT rolname::text FROM pg_catalog.pg_roles WHERE rolname = ANY($1::text[])",
            &[&roles],
        )
        .await
        .map_err(PgError::sql("reading the user's roles"))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let present: Vec<&String> = roles.iter().filter(|r| existing.contains(r)).collect();
    if present.is_empty() {
        return Ok(());
    }
    let closing: Vec<String> = present
        .iter()
        .map(|r| format!("ALTER ROLE {} NOLOGIN", quote_ident(r)))
        .collect();
    in_transaction(s, &closing, "closing the user's logins".to_string()).await?;
    end_sessions(s, roles).await?;
    let dropping: Vec<String> = present
        .iter()
        .map(|r| format!("DROP ROLE {}", quote_ident(r)))
        .collect();
    in_transaction(s, &dropping, "dropping the user's roles".to_string()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_fit_postgres_and_leave_room_for_the_logins() {
        assert_eq!(
            group_role("orders", "orders-dashboard"),
            "orders_orders_dashboard"
        );
        assert_eq!(group_role("orders", "Ro.app"), "orders_ro_app");
        let long = group_role(&"d".repeat(63), &"n".repeat(60));
        assert_eq!(long.len(), 61);
        assert!(logins(&long).iter().all(|l| l.len() <= 63));
        assert_ne!(long, group_role(&"d".repeat(63), &"m".repeat(60)));
    }

    #[test]
    fn a_converged_login_needs_no_statement_and_drift_is_named() {
        let settings = vec![("statement_timeout", "15000".to_string())];
        let want = LoginSpec {
            name: "g_1",
            group: "g",
            mark: "m",
            connection_limit: 5,
            settings: &settings,
        };
        let have = RoleState {
            name: "g_1".into(),
            comment: Some("m".into()),
            can_login: true,
            connection_limit: 5,
            valid_until: None,
            settings: vec!["statement_timeout=15000".into()],
            in_group: true,
        };
        assert!(login_converged(&want, &have));
        let mut drift = have.clone();
        drift.settings = vec!["lock_timeout=1".into(), "search_path=x".into()];
        drift.connection_limit = -1;
        let st = login_statements(&want, Some(&drift));
        assert_eq!(
            st,
            [
                r#"ALTER ROLE "g_1" CONNECTION LIMIT 5"#,
                r#"ALTER ROLE "g_1" SET statement_timeout = '15000'"#,
                r#"ALTER ROLE "g_1" RESET lock_timeout"#,
            ]
        );
        let mut expiring = have;
        expiring.valid_until = Some(1.8e9);
        assert!(!login_converged(&want, &expiring));
    }
}
