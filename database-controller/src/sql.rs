//! The SQL the database-controller runs. Every identifier and literal goes through
//! `quote_ident`/`quote_literal` (or a bind parameter); passwords only as SCRAM verifiers.
//!
//! Ownership: the role is created and marked in one transaction (`COMMENT ON ROLE`), and
//! the database is created `OWNER` that marked role and then marked itself, so after a
//! crash at any point the controller can tell its own objects from anyone else's.

use dbops_shared::postgres::{PgError, Session, password_verifier, quote_ident, quote_literal};

/// The mark left on roles and databases this controller created.
pub fn mark(uid: &str) -> String {
    format!("dbops.dev/uid={uid}")
}

/// The second word of a database's mark while `spec.restoreFrom` has not been restored
/// into it yet: a database found with it may hold half a restore and is made anew.
const RESTORE_PENDING: &str = "dbops.dev/restore=pending";

/// The mark of a database created for a restore that has not completed.
pub fn restore_pending_mark(uid: &str) -> String {
    format!("{} {RESTORE_PENDING}", mark(uid))
}

/// Whether a role's or database's comment marks it as created for the Database `uid`.
/// The mark is the comment's first word; words after it record more (a restore still
/// pending, or the Migration that created it on a new server).
pub fn is_ours(comment: Option<&str>, uid: &str) -> bool {
    comment
        .and_then(|c| c.split_whitespace().next())
        .is_some_and(|first| first == mark(uid))
}

/// Whether a database's comment says its restore has not completed.
pub fn is_restore_pending(comment: Option<&str>) -> bool {
    comment.is_some_and(|c| c.split_whitespace().skip(1).any(|w| w == RESTORE_PENDING))
}

/// What exists on the server under the Database's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub server_version: String,
    pub role: Option<RoleInfo>,
    pub database: Option<DatabaseInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleInfo {
    pub comment: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseInfo {
    pub oid: u32,
    pub owner: String,
    pub connection_limit: i32,
    pub comment: Option<String>,
}

/// Reads the server version, the role and the database in one round trip (no writes).
pub async fn observe(s: &Session, role: &str, database: &str) -> Result<Observed, PgError> {
    let row = s
        .query_one(
            "SELECT current_setting('server_version'), \
               (SELECT true FROM pg_roles WHERE rolname = $1), \
               (SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1), \
               d.oid, pg_get_userbyid(d.datdba)::text, d.datconnlimit, \
               shobj_description(d.oid, 'pg_database') \
             FROM (SELECT 1) AS one LEFT JOIN pg_database d ON d.datname = $2",
            &[&role, &database],
        )
        .await
        .map_err(PgError::sql("reading pg_roles and pg_database"))?;
    let role_exists: Option<bool> = row.get(1);
    let oid: Option<u32> = row.get(3);
    Ok(Observed {
        server_version: row.get(0),
        role: role_exists.map(|_| RoleInfo {
            comment: row.get(2),
        }),
        database: oid.map(|oid| DatabaseInfo {
            oid,
            owner: row.get(4),
            connection_limit: row.get(5),
            comment: row.get(6),
        }),
    })
}

/// Creates the login role with `password` and marks it, atomically.
pub async fn create_role(
    s: &mut Session,
    role: &str,
    password: &str,
    mark: &str,
) -> Result<(), PgError> {
    let tx = s.transaction().await.map_err(PgError::sql("BEGIN"))?;
    tx.batch_execute(&format!(
        "CREATE ROLE {} LOGIN PASSWORD {}; COMMENT ON ROLE {} IS {}",
        quote_ident(role),
        quote_literal(&password_verifier(password)),
        quote_ident(role),
        quote_literal(mark),
    ))
    .await
    .map_err(PgError::sql(format!("creating role {role}")))?;
    tx.commit().await.map_err(PgError::sql("COMMIT"))
}

pub async fn set_password(s: &Session, role: &str, password: &str) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "ALTER ROLE {} PASSWORD {}",
        quote_ident(role),
        quote_literal(&password_verifier(password)),
    ))
    .await
    .map_err(PgError::sql(format!("setting the password of {role}")))
}

/// Creates the database owned by `owner`, closed to PUBLIC, and marks it.
pub async fn create_database(
    s: &Session,
    database: &str,
    owner: &str,
    connection_limit: i32,
    mark: &str,
) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "CREATE DATABASE {} OWNER {} CONNECTION LIMIT {connection_limit}",
        quote_ident(database),
        quote_ident(owner),
    ))
    .await
    .map_err(PgError::sql(format!("creating database {database}")))?;
    s.batch_execute(&format!(
        "COMMENT ON DATABASE {db} IS {}; REVOKE ALL ON DATABASE {db} FROM PUBLIC",
        quote_literal(mark),
        db = quote_ident(database),
    ))
    .await
    .map_err(PgError::sql(format!("marking database {database}")))
}

pub async fn mark_database(s: &Session, database: &str, mark: &str) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "COMMENT ON DATABASE {} IS {}",
        quote_ident(database),
        quote_literal(mark)
    ))
    .await
    .map_err(PgError::sql(format!("marking database {database}")))
}

pub async fn set_owner(s: &Session, database: &str, owner: &str) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "ALTER DATABASE {} OWNER TO {}",
        quote_ident(database),
        quote_ident(owner)
    ))
    .await
    .map_err(PgError::sql(format!("changing the owner of {database}")))
}

pub async fn set_connection_limit(s: &Session, database: &str, limit: i32) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "ALTER DATABASE {} CONNECTION LIMIT {limit}",
        quote_ident(database)
    ))
    .await
    .map_err(PgError::sql(format!(
        "setting the connection limit of {database}"
    )))
}

/// Extensions installed in the database the session is connected to.
pub async fn installed_extensions(s: &Session) -> Result<Vec<String>, PgError> {
    let rows = s
        .query("SELECT extname::text FROM pg_extension", &[])
        .await
        .map_err(PgError::sql("reading pg_extension"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

pub async fn create_extension(s: &Session, extension: &str) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "CREATE EXTENSION IF NOT EXISTS {}",
        quote_ident(extension)
    ))
    .await
    .map_err(PgError::sql(format!("creating extension {extension}")))
}

/// Ends every session on the database and drops it; a missing database is success.
pub async fn drop_database(s: &Session, database: &str) -> Result<(), PgError> {
    s.batch_execute(&format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        quote_ident(database)
    ))
    .await
    .map_err(PgError::sql(format!("dropping database {database}")))
}

/// Hands what the role still owns to the admin, drops its privileges, then the role; a
/// missing role is success.
pub async fn drop_role(s: &Session, role: &str) -> Result<(), PgError> {
    let exists = s
        .query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&role])
        .await
        .map_err(PgError::sql("reading pg_roles"))?
        .is_some();
    if !exists {
        return Ok(());
    }
    s.batch_execute(&format!(
        "REASSIGN OWNED BY {r} TO CURRENT_USER; DROP OWNED BY {r}; DROP ROLE {r}",
        r = quote_ident(role)
    ))
    .await
    .map_err(PgError::sql(format!("dropping role {role}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ours_is_decided_by_the_first_token_of_the_comment() {
        assert!(is_ours(Some("dbops.dev/uid=u1"), "u1"));
        assert!(is_ours(
            Some("dbops.dev/uid=u1 dbops.dev/migration=m1"),
            "u1"
        ));
        assert!(!is_ours(Some("dbops.dev/uid=u12"), "u1"));
        assert!(!is_ours(
            Some("dbops.dev/migration=m1 dbops.dev/uid=u1"),
            "u1"
        ));
        assert!(!is_ours(Some("someone else's"), "u1"));
        assert!(!is_ours(Some(""), "u1"));
        assert!(!is_ours(None, "u1"));
    }
}
