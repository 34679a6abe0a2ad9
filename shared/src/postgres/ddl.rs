//! The statements more than one controller runs on a server: reading its version and a
//! database's extensions, observing a Database's role and database, creating and marking
//! them, and dropping them. What only one controller needs stays in its own `sql` module.
//!
//! Every identifier and literal goes through [`quote_ident`]/[`quote_literal`] or a bind
//! parameter; passwords reach the server only as SCRAM verifiers ([`password_verifier`]).
//! Statements run through [`Session`]/[`Transaction`](super::Transaction), so each is traced.
//!
//! Marks: a role or database created for the Database `<uid>` is commented
//! `dbops.dev/uid=<uid>`, possibly followed by more words (a restore still pending, the
//! Migration that created it on a new server). The first word alone decides whose it is.

use super::{PgError, Session, password_verifier, quote_ident, quote_literal};

/// The mark left on roles and databases created for the Database `uid`: the first word
/// of their comment.
pub fn mark(uid: &str) -> String {
    format!("dbops.dev/uid={uid}")
}

/// Whether a role's or database's comment marks it as created for the Database `uid`
/// (its first word is [`mark`]).
pub fn is_marked(comment: Option<&str>, uid: &str) -> bool {
    comment
        .and_then(|c| c.split_whitespace().next())
        .is_some_and(|first| first == mark(uid))
}

/// Whether `word` stands among the comment's words after the first (the mark).
pub fn has_note(comment: Option<&str>, word: &str) -> bool {
    comment.is_some_and(|c| c.split_whitespace().skip(1).any(|w| w == word))
}

/// Runs `statements` as one batch (traced like every statement of the session); a
/// failure says what was being `done`.
pub async fn execute(s: &Session, statements: &str, doing: String) -> Result<(), PgError> {
    s.batch_execute(statements)
        .await
        .map_err(PgError::sql(doing))
}

/// What exists on the server under a Database's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub server_version: String,
    pub role: Option<RoleInfo>,
    pub database: Option<DatabaseInfo>,
}

impl Observed {
    /// The role exists and carries the mark of the object `uid`.
    pub fn role_is_ours(&self, uid: &str) -> bool {
        self.role_is(|comment| is_marked(comment, uid))
    }

    /// The database exists and is the object `uid`'s (see [`Observed::database_is`]).
    pub fn database_is_ours(&self, uid: &str, role: &str) -> bool {
        self.database_is(|comment| is_marked(comment, uid), role)
    }

    /// The role exists and its comment is a mark `ours` takes as its own.
    pub fn role_is(&self, ours: impl Fn(Option<&str>) -> bool) -> bool {
        self.role
            .as_ref()
            .is_some_and(|r| ours(r.comment.as_deref()))
    }

    /// The database exists and is ours: its comment is a mark `ours` takes as its own, or
    /// it has no comment and was created `OWNER` our marked `role` by a process that
    /// crashed before it could mark the database itself.
    pub fn database_is(&self, ours: impl Fn(Option<&str>) -> bool, role: &str) -> bool {
        self.database.as_ref().is_some_and(|d| {
            ours(d.comment.as_deref())
                || (d.comment.is_none() && self.role_is(&ours) && d.owner == role)
        })
    }
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

/// The server's version: `server_version_num` (for example 150014) and the text (for
/// example `15.14 (Debian 15.14-0+deb12u1)`).
pub async fn server_version(s: &Session) -> Result<(i32, String), PgError> {
    let row = s
        .query_one(
            // The statement the e2e traces test looks for in the backup-controller's trace.
            "SELECT current_setting('server_version'), current_setting('server_version_num')::int",
            &[],
        )
        .await
        .map_err(PgError::sql("reading the server version"))?;
    let text = row
        .try_get(0)
        .map_err(PgError::sql("reading the server version"))?;
    let num = row
        .try_get(1)
        .map_err(PgError::sql("reading the server version"))?;
    Ok((num, text))
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
            owner: row.get::<_, Option<String>>(4).unwrap_or_default(),
            connection_limit: row.get(5),
            comment: row.get(6),
        }),
    })
}

/// Creates the login role with the password's SCRAM verifier and marks it, atomically.
pub async fn create_role(
    s: &mut Session,
    role: &str,
    password: &str,
    mark: &str,
) -> Result<(), PgError> {
    let tx = s.transaction().await.map_err(PgError::sql("BEGIN"))?;
    tx.batch_execute(&format!(
        "CREATE ROLE {r} LOGIN PASSWORD {}; COMMENT ON ROLE {r} IS {}",
        quote_literal(&password_verifier(password)),
        quote_literal(mark),
        r = quote_ident(role),
    ))
    .await
    .map_err(PgError::sql(format!("creating role {role}")))?;
    tx.commit().await.map_err(PgError::sql("COMMIT"))
}

/// Creates the database owned by `owner` (one statement: CREATE DATABASE cannot share a
/// batch); marking it is [`mark_database`].
pub async fn create_database(
    s: &Session,
    database: &str,
    owner: &str,
    connection_limit: i32,
) -> Result<(), PgError> {
    execute(
        s,
        &format!(
            "CREATE DATABASE {} OWNER {} CONNECTION LIMIT {connection_limit}",
            quote_ident(database),
            quote_ident(owner),
        ),
        format!("creating database {database}"),
    )
    .await
}

/// Marks a database just created and closes it to PUBLIC.
pub async fn mark_database(s: &Session, database: &str, mark: &str) -> Result<(), PgError> {
    execute(
        s,
        &format!(
            "COMMENT ON DATABASE {db} IS {}; REVOKE ALL ON DATABASE {db} FROM PUBLIC",
            quote_literal(mark),
            db = quote_ident(database),
        ),
        format!("marking database {database}"),
    )
    .await
}

/// Replaces a database's comment (its mark) and nothing else: for a database already
/// marked and closed by [`mark_database`] (a restore that completed changes its mark).
pub async fn comment_database(s: &Session, database: &str, mark: &str) -> Result<(), PgError> {
    execute(
        s,
        &format!(
            "COMMENT ON DATABASE {} IS {}",
            quote_ident(database),
            quote_literal(mark)
        ),
        format!("marking database {database}"),
    )
    .await
}

/// Creates the extension in the database the session is connected to, if missing.
pub async fn create_extension(s: &Session, extension: &str) -> Result<(), PgError> {
    execute(
        s,
        &format!("CREATE EXTENSION IF NOT EXISTS {}", quote_ident(extension)),
        format!("creating extension {extension}"),
    )
    .await
}

/// Extensions installed in the database the session is connected to, by name.
pub async fn installed_extensions(s: &Session) -> Result<Vec<String>, PgError> {
    let rows = s
        .query("SELECT extname::text FROM pg_extension ORDER BY 1", &[])
        .await
        .map_err(PgError::sql("reading pg_extension"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Ends every session on the database and drops it; a missing database is success.
pub async fn drop_database(s: &Session, database: &str) -> Result<(), PgError> {
    execute(
        s,
        &format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(database)
        ),
        format!("dropping database {database}"),
    )
    .await
}

/// Hands what the role still owns (in the connected database) to the admin, drops its
/// privileges, then the role; a missing role is success.
pub async fn drop_role(s: &Session, role: &str) -> Result<(), PgError> {
    let exists = s
        .query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&role])
        .await
        .map_err(PgError::sql("reading pg_roles"))?
        .is_some();
    if !exists {
        return Ok(());
    }
    execute(
        s,
        &format!(
            "REASSIGN OWNED BY {r} TO CURRENT_USER; DROP OWNED BY {r}; DROP ROLE {r}",
            r = quote_ident(role)
        ),
        format!("dropping role {role}"),
    )
    .await
}

/// `FROM … WHERE …` of a database's own ordinary tables (`c`, schema `n`): outside the
/// system, TOAST and temporary schemas, and not members of an extension. The Migration's
/// table list and the Logical mode's Preflight read the same set.
pub const USER_TABLES: &str = "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.relkind = 'r' \
       AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
       AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp%' \
       AND NOT EXISTS (SELECT 1 FROM pg_depend d \
                        WHERE d.classid = 'pg_class'::regclass \
                          AND d.objid = c.oid AND d.deptype = 'e')";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ours_is_decided_by_the_first_token_of_the_comment() {
        assert!(is_marked(Some("dbops.dev/uid=u1"), "u1"));
        assert!(is_marked(
            Some("dbops.dev/uid=u1 dbops.dev/migration=m1"),
            "u1"
        ));
        assert!(!is_marked(Some("dbops.dev/uid=u12"), "u1"));
        assert!(!is_marked(
            Some("dbops.dev/migration=m1 dbops.dev/uid=u1"),
            "u1"
        ));
        assert!(!is_marked(Some("someone else's"), "u1"));
        assert!(!is_marked(Some(""), "u1"));
        assert!(!is_marked(None, "u1"));
    }

    #[test]
    fn an_unmarked_database_is_ours_only_if_our_marked_role_owns_it() {
        let observed = |role_comment: Option<&str>, owner: &str, comment: Option<&str>| Observed {
            server_version: "17".into(),
            role: Some(RoleInfo {
                comment: role_comment.map(Into::into),
            }),
            database: Some(DatabaseInfo {
                oid: 1,
                owner: owner.into(),
                connection_limit: -1,
                comment: comment.map(Into::into),
            }),
        };
        let ours = Some("dbops.dev/uid=u1");
        assert!(observed(ours, "r", ours).database_is_ours("u1", "r"));
        // A crash between CREATE DATABASE ... OWNER and its mark.
        assert!(observed(ours, "r", None).database_is_ours("u1", "r"));
        assert!(!observed(ours, "other", None).database_is_ours("u1", "r"));
        assert!(!observed(None, "r", None).database_is_ours("u1", "r"));
        assert!(!observed(ours, "r", Some("someone else's")).database_is_ours("u1", "r"));
        assert!(!observed(ours, "r", ours).database_is_ours("u2", "r"));
        // Any mark: a Migration's own, with the same fallback.
        let migrations = |c: Option<&str>| has_note(c, "dbops.dev/migration=m1");
        let marked = Some("dbops.dev/uid=u1 dbops.dev/migration=m1");
        assert!(observed(marked, "r", None).database_is(migrations, "r"));
        assert!(!observed(ours, "r", None).database_is(migrations, "r"));
        assert!(observed(marked, "r", None).role_is(migrations));
        let nothing = Observed {
            role: None,
            database: None,
            ..observed(ours, "r", ours)
        };
        assert!(!nothing.role_is_ours("u1") && !nothing.database_is_ours("u1", "r"));
    }

    #[test]
    fn notes_are_the_words_after_the_mark() {
        let c = Some("dbops.dev/uid=u1 dbops.dev/restore=pending");
        assert!(has_note(c, "dbops.dev/restore=pending"));
        assert!(!has_note(c, "dbops.dev/uid=u1"));
        assert!(!has_note(
            Some("dbops.dev/restore=pending"),
            "dbops.dev/restore=pending"
        ));
        assert!(!has_note(None, "dbops.dev/restore=pending"));
    }
}
