//! The SQL only the database-controller runs; what it shares with the
//! migration-controller (observing, creating, marking and dropping the role and the
//! database) is `dbops_shared::postgres::ddl`, re-exported here. Every identifier and
//! literal goes through `quote_ident`/`quote_literal` (or a bind parameter); passwords only
//! as SCRAM verifiers, sent with statement logging off (`ddl::execute_unlogged`).
//!
//! Ownership: the role is created and marked in one transaction (`COMMENT ON ROLE`), and
//! the database is created `OWNER` that marked role and then marked itself, so after a
//! crash at any point the controller can tell its own objects from anyone else's.

// The second word of a database's mark while `spec.restoreFrom` has not been restored
// into it yet: a database found with it may hold half a restore and is made anew.
use dbops_api::names::comment::RESTORE_PENDING;
use dbops_shared::postgres::ddl;
use dbops_shared::postgres::{PgError, Session, quote_ident};

pub use ddl::{
    Fate, comment_database, create_role, drop_database, drop_marked, installed_extensions,
    is_marked as is_ours, mark, mark_database, observe, observe_in_use,
};

/// The mark of a database created for a restore that has not completed.
pub fn restore_pending_mark(uid: &str) -> String {
    format!("{} {RESTORE_PENDING}", mark(uid))
}

/// Whether a database's comment says its restore has not completed.
pub fn is_restore_pending(comment: Option<&str>) -> bool {
    ddl::has_note(comment, RESTORE_PENDING)
}

/// Creates the database owned by `owner`, closed to PUBLIC, and marks it.
pub async fn create_database(
    s: &Session,
    database: &str,
    owner: &str,
    connection_limit: i32,
    mark: &str,
) -> Result<(), PgError> {
    ddl::create_database(s, database, owner, connection_limit).await?;
    ddl::mark_database(s, database, mark).await
}

/// A new password for the role: its SCRAM verifier, with statement logging off.
pub async fn set_password(s: &mut Session, role: &str, password: &str) -> Result<(), PgError> {
    ddl::set_password(s, role, password).await
}

pub async fn set_owner(s: &Session, database: &str, owner: &str) -> Result<(), PgError> {
    ddl::execute(
        s,
        &format!(
            "ALTER DATABASE {} OWNER TO {}",
            quote_ident(database),
            quote_ident(owner)
        ),
        format!("changing the owner of {database}"),
    )
    .await
}

pub async fn set_connection_limit(s: &Session, database: &str, limit: i32) -> Result<(), PgError> {
    ddl::execute(
        s,
        &format!(
            "ALTER DATABASE {} CONNECTION LIMIT {limit}",
            quote_ident(database)
        ),
        format!("setting the connection limit of {database}"),
    )
    .await
}
