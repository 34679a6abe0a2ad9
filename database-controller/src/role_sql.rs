//! The SQL of roles: a DatabaseUser's, the Database owner's logins and settings (below
//! `user/`, `rotation/` and `owner_logins`, which all run it). A DatabaseUser's roles,
//! all marked `dbops.dev/uid=<DatabaseUser uid>`:
//! - the group `<base>` (NOLOGIN) holds the privileges in the Database's database;
//! - the logins `<base>-1` and `<base>-2` (LOGIN, INHERIT, members of the group) take
//!   turns: the connection Secret names one; after a rotation the other keeps working
//!   until its `VALID UNTIL` (`keepPrevious`), then loses LOGIN and its sessions end.
//!
//! The login SQL (observe, activate, repair, keep until, retire) serves the Database
//! owner's two rotation logins too (`crate::rotation::turn` runs it for both); the
//! settings SQL serves the owner role. The privileges of the group are
//! `user::grants`. Every identifier and literal is quoted; passwords travel only as
//! SCRAM verifiers, unlogged.

use dbops_shared::postgres::ddl::{self, Unlogged};
use dbops_shared::postgres::{PgError, Session, quote_ident, quote_literal};

/// Runs `statements` in one transaction (a failure rolls it back: the pooled session is
/// never left inside an aborted transaction).
pub(super) async fn in_transaction(
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

/// The group role of a DatabaseUser: `<database>.<name>` (non-identifier characters of
/// the name read as `_`; `dbops_shared::postgres::derived`: no tenant can take it).
pub fn group_role(database: &str, name: &str) -> String {
    dbops_shared::postgres::derived::user_group(database, name)
}

/// The two logins of a group, in turn order.
pub fn logins(group: &str) -> [String; 2] {
    dbops_shared::postgres::derived::user_logins(group)
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
            ddl::adopt_statement(group),
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
        statements.push(ddl::adopt_statement(want.name));
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

/// Sets up the previous login where it is missing or has no expiry (the Database moved
/// here): its SCRAM `verifier` as its password (unlogged), LOGIN and `VALID UNTIL until`,
/// in one transaction. A login of the pair (`want`) is created when missing (marked) and
/// gets its limit, settings and group; the owner role itself (`want` none) only its
/// credential and end.
pub async fn restore(
    s: &mut Session,
    login: &str,
    want: Option<&LoginSpec<'_>>,
    have: Option<&RoleState>,
    verifier: &str,
    until: &str,
) -> Result<(), PgError> {
    let r = quote_ident(login);
    let mut statements = Vec::new();
    if let Some(want) = want {
        if have.is_none() {
            statements.push(format!("CREATE ROLE {r} LOGIN INHERIT"));
            statements.push(format!(
                "COMMENT ON ROLE {r} IS {}",
                quote_literal(want.mark)
            ));
            statements.push(ddl::adopt_statement(login));
        }
        statements.extend(login_statements(want, have));
    }
    statements.push(format!(
        "ALTER ROLE {r} LOGIN VALID UNTIL {}",
        quote_literal(until)
    ));
    ddl::execute_unlogged(
        s,
        Unlogged::InTransactionAfter(&statements.join("; ")),
        &format!("ALTER ROLE {r} PASSWORD {}", quote_literal(verifier)),
        format!("setting up the previous login {login} until {until}"),
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
            "orders.orders_dashboard"
        );
        assert_eq!(group_role("orders", "Ro.app"), "orders.ro_app");
        assert_eq!(logins("orders.ro_app")[1], "orders.ro_app-2");
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
