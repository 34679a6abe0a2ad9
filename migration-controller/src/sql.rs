//! The SQL the migration-controller runs, on the source and the target server; what it
//! shares with the database-controller (observing, creating, marking and dropping the role
//! and the database) is `dbops_shared::postgres::ddl`, re-exported here. Every identifier
//! and literal goes through `quote_ident`/`quote_literal` or a bind parameter; the target
//! role's password only as a SCRAM verifier.
//!
//! Marks: the database-controller comments its role and database `dbops.dev/uid=<Database
//! uid>`; what this controller creates on the target is commented
//! `dbops.dev/uid=<Database uid> dbops.dev/migration=<Migration uid>`, so the
//! database-controller takes it as its own after the switch (first word) and a rollback
//! drops only what this Migration created (second word).

use dbops_api::migration::FreezeRecord;
use dbops_api::names::comment::MIGRATION_PREFIX;
use dbops_shared::postgres::ddl;
use dbops_shared::postgres::{PgError, Session, quote_ident, quote_literal};

/// Whether the comment marks an object of the Database `database_uid` (first word).
pub use ddl::is_marked as is_databases;
/// The database-controller's mark: the first word of the comment.
pub use ddl::mark as database_mark;
pub use ddl::{
    capabilities, create_database, create_role, drop_marked, drop_role, mark_database, observe,
    server_version,
};

/// The mark of objects this Migration created on the target.
pub fn migration_mark(database_uid: &str, migration_uid: &str) -> String {
    format!(
        "{} {MIGRATION_PREFIX}{migration_uid}",
        database_mark(database_uid)
    )
}

/// Whether the comment marks an object created by the Migration `migration_uid` for the
/// Database `database_uid`.
pub fn is_migrations(comment: Option<&str>, database_uid: &str, migration_uid: &str) -> bool {
    is_databases(comment, database_uid)
        && ddl::has_note(comment, &format!("{MIGRATION_PREFIX}{migration_uid}"))
}

/// Extensions installed in the database the session is connected to (not plpgsql, which
/// every database has).
pub async fn installed_extensions(s: &Session) -> Result<Vec<String>, PgError> {
    let mut installed = ddl::installed_extensions(s).await?;
    installed.retain(|e| e != "plpgsql");
    Ok(installed)
}

/// What FreezeSource is about to change: the connection limit and the database-level
/// `default_transaction_read_only`, and for an admin that is not a superuser
/// (`close_by_privilege`) the roles holding CONNECT on it but the admin and `spare_roles`.
/// `None` when the database does not exist.
pub async fn freeze_state(
    s: &Session,
    database: &str,
    close_by_privilege: bool,
    spare_roles: &[String],
) -> Result<Option<FreezeRecord>, PgError> {
    let row = s
        .query_opt(
            "SELECT d.datconnlimit, \
               (SELECT substr(c, length('default_transaction_read_only=') + 1) \
                  FROM pg_db_role_setting r, unnest(r.setconfig) AS c \
                 WHERE r.setdatabase = d.oid AND r.setrole = 0 \
                   AND c LIKE 'default\\_transaction\\_read\\_only=%'), \
               ARRAY(SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' \
                                          ELSE pg_get_userbyid(a.grantee)::text END \
                       FROM aclexplode(COALESCE(d.datacl, acldefault('d', d.datdba))) a \
                      WHERE a.privilege_type = 'CONNECT' \
                        AND a.grantee <> (SELECT oid FROM pg_roles WHERE rolname = CURRENT_USER) \
                        AND (a.grantee = 0 OR pg_get_userbyid(a.grantee)::text <> ALL ($2::text[])) \
                      ORDER BY 1) \
             FROM pg_database d WHERE d.datname = $1",
            &[&database, &spare_roles],
        )
        .await
        .map_err(PgError::sql("reading the settings of the source database"))?;
    Ok(row.map(|r| FreezeRecord {
        previous_connection_limit: r.get(0),
        previous_read_only: r.get(1),
        closed_to: close_by_privilege.then(|| r.get(2)),
    }))
}

/// `r1, r2` of a GRANT or REVOKE: each role quoted, `PUBLIC` as the keyword.
fn grantees(roles: &[String]) -> String {
    roles
        .iter()
        .map(|r| {
            if r == "PUBLIC" {
                r.clone()
            } else {
                quote_ident(r)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// How [`freeze`] closes the database to new sessions.
fn close_statements(db: &str, record: &FreezeRecord) -> String {
    match record.closed_to.as_deref() {
        None => format!("ALTER DATABASE {db} CONNECTION LIMIT 0"),
        // The admin keeps CONNECT of its own (it had it through the owner's), so the
        // steps after the freeze still reach the database.
        Some([]) => format!("GRANT CONNECT ON DATABASE {db} TO CURRENT_USER"),
        Some(roles) => format!(
            "GRANT CONNECT ON DATABASE {db} TO CURRENT_USER; \
             REVOKE CONNECT ON DATABASE {db} FROM {}",
            grantees(roles)
        ),
    }
}

/// Stops new writes: new sessions default to read-only transactions, no new session is
/// admitted but a superuser's (connection limit 0) or, as `record` says for an admin that
/// is not a superuser, but the admin's and `spare_roles`' (CONNECT revoked from the
/// others), and every other session on the database is ended (waiting up to 5 s for
/// each, a few rounds), except those of `spare_roles` (the Logical mode's WAL sender,
/// which the final catch-up needs). Returns (sessions ended, sessions still there).
pub async fn freeze(
    s: &Session,
    database: &str,
    record: &FreezeRecord,
    spare_roles: &[String],
) -> Result<(usize, i64), PgError> {
    let now = freeze_state(s, database, record.closed_to.is_some(), spare_roles).await?;
    let frozen = now.is_some_and(|f| {
        f.previous_read_only.as_deref() == Some("on")
            && match &f.closed_to {
                None => f.previous_connection_limit == 0,
                Some(open) => open.is_empty(),
            }
    });
    if !frozen {
        let db = quote_ident(database);
        s.batch_execute(&format!(
            "{}; ALTER DATABASE {db} SET default_transaction_read_only = on",
            close_statements(&db, record)
        ))
        .await
        .map_err(PgError::sql(format!("freezing database {database}")))?;
    }
    let (version, _) = server_version(s).await?;
    let mut ended = 0;
    for _ in 0..5 {
        let rows = s
            .query(terminate_sessions(version), &[&database, &spare_roles])
            .await
            .map_err(PgError::sql(format!("ending the sessions on {database}")))?;
        if rows.is_empty() {
            return Ok((ended, 0));
        }
        ended += rows.len();
        if version < 140000 {
            let pids: Vec<i32> = rows.iter().map(|r| r.get(1)).collect();
            wait_gone(s, &pids, TERMINATE_WAIT).await?;
        }
    }
    let left: i64 = s
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() \
               AND (usename IS NULL OR usename::text <> ALL ($2::text[]))",
            &[&database, &spare_roles],
        )
        .await
        .map_err(PgError::sql(format!("counting the sessions on {database}")))?
        .get(0);
    Ok((ended, left))
}

/// How long [`freeze`] waits for each ended session to go.
const TERMINATE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Ends the sessions on database `$1` but this one and those of role `$2`, returning
/// (ended, pid) for each: waiting up to [`TERMINATE_WAIT`] for each to go, where the server
/// can (`pg_terminate_backend(pid, timeout)`, PostgreSQL 14 and newer); before 14 the
/// caller waits ([`wait_gone`]).
fn terminate_sessions(server_version_num: i32) -> &'static str {
    if server_version_num >= 140000 {
        "SELECT pg_terminate_backend(pid, 5000), pid FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid() \
           AND (usename IS NULL OR usename::text <> ALL ($2::text[]))"
    } else {
        "SELECT pg_terminate_backend(pid), pid FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid() \
           AND (usename IS NULL OR usename::text <> ALL ($2::text[]))"
    }
}

/// Waits, at most `limit`, until no session has one of `pids` (then goes on either way).
async fn wait_gone(s: &Session, pids: &[i32], limit: std::time::Duration) -> Result<(), PgError> {
    let every = std::time::Duration::from_millis(50);
    dbops_shared::poll::until(limit, every, || async move {
        let left: i64 = s
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
                &[&pids],
            )
            .await
            .map_err(PgError::sql("waiting for ended sessions to go"))?
            .get(0);
        Ok((left == 0).then_some(()))
    })
    .await?;
    Ok(())
}

/// Restores exactly what [`freeze`] changed, from the record written before it.
pub async fn unfreeze(s: &Session, database: &str, was: &FreezeRecord) -> Result<(), PgError> {
    let db = quote_ident(database);
    let read_only = match &was.previous_read_only {
        Some(value) => format!(
            "ALTER DATABASE {db} SET default_transaction_read_only = {}",
            quote_literal(value)
        ),
        None => format!("ALTER DATABASE {db} RESET default_transaction_read_only"),
    };
    let reopen = match was.closed_to.as_deref() {
        None | Some([]) => String::new(),
        Some(roles) => format!("GRANT CONNECT ON DATABASE {db} TO {}; ", grantees(roles)),
    };
    s.batch_execute(&format!(
        "{reopen}ALTER DATABASE {db} CONNECTION LIMIT {}; {read_only}",
        was.previous_connection_limit
    ))
    .await
    .map_err(PgError::sql(format!("unfreezing database {database}")))
}

/// How many schemas, relations (tables, views, foreign tables and sequences of their own;
/// indexes, TOAST tables and column sequences come with a table) and functions outside
/// the system schemas the connected database holds, not counting what belongs to an
/// extension (ProvisionTarget creates the extensions, and some bring schemas, tables or
/// functions of their own): the restore runs in one transaction, so more than none means
/// it committed.
pub async fn user_objects(s: &Session) -> Result<i64, PgError> {
    let row = s
        .query_one(
            "SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                      WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') \
                        AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp%' \
                        AND (c.relkind IN ('r', 'p', 'v', 'm', 'f') \
                             OR (c.relkind = 'S' AND NOT EXISTS (SELECT 1 FROM pg_depend o \
                                   WHERE o.classid = 'pg_class'::regclass AND o.objid = c.oid \
                                     AND o.refclassid = 'pg_class'::regclass \
                                     AND o.deptype IN ('a', 'i')))) \
                        AND NOT EXISTS (SELECT 1 FROM pg_depend d \
                                         WHERE d.classid = 'pg_class'::regclass \
                                           AND d.objid = c.oid AND d.deptype = 'e')) \
                  + (SELECT count(*) FROM pg_namespace n \
                      WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'public') \
                        AND n.nspname NOT LIKE 'pg\\_%' \
                        AND NOT EXISTS (SELECT 1 FROM pg_depend d \
                                         WHERE d.classid = 'pg_namespace'::regclass \
                                           AND d.objid = n.oid AND d.deptype = 'e')) \
                  + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                      WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') \
                        AND NOT EXISTS (SELECT 1 FROM pg_depend d \
                                         WHERE d.classid = 'pg_proc'::regclass \
                                           AND d.objid = p.oid AND d.deptype = 'e'))",
            &[],
        )
        .await
        .map_err(PgError::sql("counting the objects in the target database"))?;
    Ok(row.get(0))
}

/// The ordinary tables of the connected database outside the system schemas and not
/// belonging to an extension, as (schema, table), sorted.
pub async fn tables(s: &Session) -> Result<Vec<(String, String)>, PgError> {
    let rows = s
        .query(
            &format!(
                "SELECT n.nspname::text, c.relname::text {} ORDER BY 1, 2",
                ddl::USER_TABLES
            ),
            &[],
        )
        .await
        .map_err(PgError::sql("listing tables"))?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The statement that counts the rows of one table.
pub fn count_statement(schema: &str, table: &str) -> String {
    format!(
        "SELECT count(*) FROM {}.{}",
        quote_ident(schema),
        quote_ident(table)
    )
}

/// `count(*)` of one table.
pub async fn count_rows(s: &Session, schema: &str, table: &str) -> Result<i64, PgError> {
    let row = s
        .query_one(&count_statement(schema, table), &[])
        .await
        .map_err(PgError::sql(format!(
            "counting the rows of {schema}.{table}"
        )))?;
    Ok(row.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_tell_the_databases_objects_from_the_migrations() {
        let mark = migration_mark("db-1", "mig-1");
        assert_eq!(mark, "dbops.dev/uid=db-1 dbops.dev/migration=mig-1");
        assert!(is_databases(Some(&mark), "db-1"));
        assert!(is_migrations(Some(&mark), "db-1", "mig-1"));
        assert!(!is_migrations(Some(&mark), "db-1", "mig-2"));
        assert!(!is_migrations(Some(&mark), "db-2", "mig-1"));
        let plain = database_mark("db-1");
        assert!(is_databases(Some(&plain), "db-1"));
        assert!(!is_migrations(Some(&plain), "db-1", "mig-1"));
        assert!(!is_databases(Some("dbops.dev/uid=db-10"), "db-1"));
        assert!(!is_databases(None, "db-1"));
        assert!(!is_migrations(
            Some("dbops.dev/migration=mig-1 dbops.dev/uid=db-1"),
            "db-1",
            "mig-1"
        ));
    }

    #[test]
    fn sessions_are_ended_with_a_wait_only_where_the_server_has_one() {
        assert!(terminate_sessions(140000).contains("pg_terminate_backend(pid, 5000)"));
        assert!(terminate_sessions(180004).contains("pg_terminate_backend(pid, 5000)"));
        // PostgreSQL 13 has only pg_terminate_backend(pid): freeze waits itself.
        assert!(terminate_sessions(130023).contains("pg_terminate_backend(pid),"));
    }
}
