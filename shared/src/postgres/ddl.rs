//! The statements more than one controller runs on a server: reading its version and a
//! database's extensions, observing a Database's role and database, creating and marking
//! them, and dropping them. What only one controller needs stays in its own `sql` module.
//!
//! Every identifier and literal goes through [`quote_ident`]/[`quote_literal`] or a bind
//! parameter; passwords reach the server only as SCRAM verifiers ([`password_verifier`](super::password_verifier)).
//! Statements run through [`Session`]/[`Transaction`](super::Transaction), so each is traced.
//!
//! Marks: a role or database created for the Database `<uid>` is commented
//! `dbops.dev/uid=<uid>`, possibly followed by more words (a restore still pending, the
//! Migration that created it on a new server). The first word alone decides whose it is.

use super::error::PgError;
use super::quote::{quote_ident, quote_literal};
use super::session::Session;

mod unlogged;

pub use unlogged::*;

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
    Ok(observe_row(s, role, database, false, false).await?.0)
}

/// What a Database's full check reads besides [`Observed`]: the owner role's own session
/// settings (`ALTER ROLE ... SET`, as `name=value`, sorted) and, when asked, the
/// database's size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InUse {
    pub role_settings: Vec<String>,
    /// `pg_database_size`; `None` when there is no database or it was not asked for.
    pub size_bytes: Option<i64>,
}

/// [`observe`] and [`InUse`] in the same round trip: a converged Database's whole check
/// is this one statement. The size only `with_size`: `pg_database_size` walks the
/// database's files, and costs the server more than the rest of the statement.
pub async fn observe_in_use(
    s: &Session,
    role: &str,
    database: &str,
    with_size: bool,
) -> Result<(Observed, InUse), PgError> {
    observe_row(s, role, database, true, with_size).await
}

/// The one query of [`observe`] and [`observe_in_use`]; the settings only when `in_use`,
/// the size only when `with_size` too (a `CASE` PostgreSQL does not evaluate otherwise).
async fn observe_row(
    s: &Session,
    role: &str,
    database: &str,
    in_use: bool,
    with_size: bool,
) -> Result<(Observed, InUse), PgError> {
    let row = s
        .query_one(
            "SELECT current_setting('server_version'), \
               (SELECT true FROM pg_roles WHERE rolname = $1), \
               (SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1), \
               d.oid, pg_get_userbyid(d.datdba)::text, d.datconnlimit, \
               shobj_description(d.oid, 'pg_database'), \
               CASE WHEN $3 THEN ARRAY(SELECT c FROM pg_catalog.pg_db_role_setting x \
                                 JOIN pg_catalog.pg_roles r ON r.oid = x.setrole, \
                                 pg_catalog.unnest(x.setconfig) AS c \
                                WHERE r.rolname = $1 AND x.setdatabase = 0 ORDER BY c) END, \
               CASE WHEN $3 AND $4 AND d.oid IS NOT NULL THEN pg_catalog.pg_database_size(d.oid) END \
             FROM (SELECT 1) AS one LEFT JOIN pg_database d ON d.datname = $2",
            &[&role, &database, &in_use, &with_size],
        )
        .await
        .map_err(PgError::sql("reading pg_roles and pg_database"))?;
    let role_exists: Option<bool> = row.get(1);
    let oid: Option<u32> = row.get(3);
    let observed = Observed {
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
    };
    let in_use = InUse {
        role_settings: row.get::<_, Option<Vec<String>>>(7).unwrap_or_default(),
        size_bytes: row.get(8),
    };
    Ok((observed, in_use))
}

/// Creates the login role, marks it, makes the admin a member of it ([`adopt_statement`])
/// and gives it the password's SCRAM verifier, in one transaction. `CREATE ROLE` and its
/// mark are logged as usual; the verifier goes in a statement of its own with statement
/// logging off ([`execute_unlogged`]).
pub async fn create_role(
    s: &mut Session,
    role: &str,
    password: &str,
    mark: &str,
) -> Result<(), PgError> {
    let r = quote_ident(role);
    execute_unlogged(
        s,
        Unlogged::InTransactionAfter(&format!(
            "CREATE ROLE {r} LOGIN; COMMENT ON ROLE {r} IS {}; {}",
            quote_literal(mark),
            adopt_statement(role)
        )),
        &password_statement(role, password),
        format!("creating role {role}"),
    )
    .await
}

/// `GRANT <role> TO CURRENT_USER`: the admin becomes a member of a role it made, with
/// the role's privileges (INHERIT) and the right to `SET ROLE` to it, the defaults of a
/// plain GRANT on every major. An admin that is not a superuser needs both: to create a
/// database `OWNER` the role, to alter, comment, close and drop what the role owns, to
/// set its default privileges and to restore as it (`SET ROLE`). The membership goes
/// one way: the role gets nothing of the admin's. A `CREATEROLE` admin may grant it on
/// every major (from PostgreSQL 16 it holds ADMIN OPTION on each role it created); for a
/// superuser it changes nothing.
pub fn adopt_statement(role: &str) -> String {
    format!("GRANT {} TO CURRENT_USER", quote_ident(role))
}

/// Makes the admin a member of `role` ([`adopt_statement`]) unless it already has the
/// role's privileges (a superuser always has): for a role made before the admin needed
/// it, or by another admin. A missing role is left to the statement that needs it.
pub async fn adopt(s: &Session, role: &str) -> Result<(), PgError> {
    let row = s
        .query_opt(
            "SELECT pg_catalog.pg_has_role(CURRENT_USER, r.oid, 'USAGE') \
               FROM pg_catalog.pg_roles r WHERE r.rolname = $1",
            &[&role],
        )
        .await
        .map_err(PgError::sql(format!(
            "reading the admin's membership in {role}"
        )))?;
    if row.is_some_and(|r| !r.get::<_, bool>(0)) {
        execute(
            s,
            &adopt_statement(role),
            format!("making the admin a member of role {role}"),
        )
        .await?;
    }
    Ok(())
}

/// What the admin role may do on its server, as found by [`capabilities`]: the
/// `DatabaseServer.status.capabilities` the probe reports.
pub use dbops_api::ServerCapabilities as Capabilities;

/// What a [`Capabilities`] says of one [`Capability`].
pub trait Has {
    /// Whether the admin has `c`.
    fn has(&self, c: Capability) -> bool;
    /// The first of `needs` the admin lacks.
    fn lacking(&self, needs: &[Capability]) -> Option<Capability> {
        needs.iter().copied().find(|c| !self.has(*c))
    }
}

impl Has for Capabilities {
    fn has(&self, c: Capability) -> bool {
        match c {
            Capability::CreateRole => self.create_role || self.superuser,
            Capability::CreateDatabase => self.create_database || self.superuser,
            Capability::Replication => self.replication || self.superuser,
            Capability::CreateReplicationRole => self.create_replication_role,
            Capability::CreateSubscription => self.create_subscription,
            Capability::SignalBackend => self.signal_backend,
            Capability::Superuser => self.superuser,
        }
    }
}

/// One right the admin may lack, by its name in `DatabaseServer.status.capabilities`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    CreateRole,
    CreateDatabase,
    Replication,
    CreateReplicationRole,
    CreateSubscription,
    SignalBackend,
    Superuser,
}

impl Capability {
    /// The field of `status.capabilities`.
    pub fn field(self) -> &'static str {
        match self {
            Self::CreateRole => "createRole",
            Self::CreateDatabase => "createDatabase",
            Self::Replication => "replication",
            Self::CreateReplicationRole => "createReplicationRole",
            Self::CreateSubscription => "createSubscription",
            Self::SignalBackend => "signalBackend",
            Self::Superuser => "superuser",
        }
    }

    /// What PostgreSQL calls the right, for a message.
    pub fn grant(self) -> &'static str {
        match self {
            Self::CreateRole => "the CREATEROLE attribute",
            Self::CreateDatabase => "the CREATEDB attribute",
            Self::Replication => "the REPLICATION attribute",
            Self::CreateReplicationRole => {
                "SUPERUSER, or REPLICATION on PostgreSQL 16 or newer (to create a replication role)"
            }
            Self::CreateSubscription => {
                "SUPERUSER, or membership in pg_create_subscription on PostgreSQL 16 or newer"
            }
            Self::SignalBackend => "membership in pg_signal_backend",
            Self::Superuser => "SUPERUSER",
        }
    }
}

/// Reads what the admin may do (one statement; no write). Role attributes come from
/// `pg_roles` and memberships from `pg_has_role`, both of which every role may read; a
/// built-in role a major does not have counts as not held.
pub async fn capabilities(s: &Session) -> Result<Capabilities, PgError> {
    let row = s
        .query_one(
            "WITH me AS (SELECT * FROM pg_catalog.pg_roles WHERE rolname = CURRENT_USER), \
                  v AS (SELECT pg_catalog.current_setting('server_version_num')::int AS num) \
             SELECT me.rolsuper, me.rolcreaterole, me.rolcreatedb, me.rolreplication, \
                    me.rolbypassrls, v.num, \
                    ARRAY(SELECT b.rolname::text FROM pg_catalog.pg_roles b \
                           WHERE b.rolname IN ('pg_read_all_data', 'pg_create_subscription', \
                                               'pg_signal_backend', 'pg_monitor', \
                                               'pg_read_all_stats', 'rds_replication', \
                                               'rds_superuser', 'cloudsqlsuperuser', \
                                               'azure_pg_admin') \
                             AND pg_catalog.pg_has_role(CURRENT_USER, b.oid, 'USAGE')) \
               FROM me, v",
            &[],
        )
        .await
        .map_err(PgError::sql("reading the admin's attributes"))?;
    let superuser: bool = row.get(0);
    let replication: bool = row.get(3);
    let num: i32 = row.get(5);
    let member: Vec<String> = row.get(6);
    let has = |r: &str| superuser || member.iter().any(|m| m == r);
    // The managed services' own roles, as their documentation describes them (untested
    // here: the test bed emulates them with PostgreSQL's own attributes and roles): RDS's
    // `rds_replication` gives replication; RDS's `rds_superuser`, Cloud SQL's
    // `cloudsqlsuperuser` and Azure's `azure_pg_admin` may create subscriptions on
    // every major.
    let managed_admin = ["rds_superuser", "cloudsqlsuperuser", "azure_pg_admin"]
        .iter()
        .any(|r| has(r));
    Ok(Capabilities {
        superuser,
        create_role: row.get(1),
        create_database: row.get(2),
        replication: replication || has("rds_replication"),
        // Only the attribute lets a CREATEROLE admin give it (16+); a role that
        // replicates through a membership replicates as itself.
        create_replication_role: superuser || (num >= 160000 && replication),
        create_subscription: managed_admin || (num >= 160000 && has("pg_create_subscription")),
        read_all_data: has("pg_read_all_data"),
        signal_backend: has("pg_signal_backend"),
        monitor: has("pg_monitor") || has("pg_read_all_stats"),
        bypass_rls: superuser || row.get::<_, bool>(4),
    })
}

/// Creates the database owned by `owner` (one statement: CREATE DATABASE cannot share a
/// batch); marking it is [`mark_database`].
pub async fn create_database(
    s: &Session,
    database: &str,
    owner: &str,
    connection_limit: i32,
) -> Result<(), PgError> {
    // `OWNER` needs the admin's membership: a role made before it was given (a crash
    // in between cannot happen: one transaction) or by an earlier admin gets it now.
    adopt(s, owner).await?;
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
    // REASSIGN and DROP OWNED need the role's privileges.
    adopt(s, role).await?;
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

/// What [`drop_marked`] did with one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Not on the server: nothing to do.
    Absent,
    /// Marked ours, and dropped.
    Dropped,
    /// On the server but not ours: left alone.
    LeftAlone,
}

/// What [`drop_marked`] found and did with the database and its owner role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    pub database: Fate,
    pub role: Fate,
}

impl Dropped {
    /// One phrase per object that was there (`database x dropped`, `database x left alone
    /// (<why>)`, `role r dropped`); empty when nothing was.
    pub fn describe(&self, database: &str, role: &str, why_left: &str) -> Vec<String> {
        let mut done = Vec::new();
        match self.database {
            Fate::Dropped => done.push(format!("database {database} dropped")),
            Fate::LeftAlone => done.push(format!("database {database} left alone ({why_left})")),
            Fate::Absent => {}
        }
        if self.role == Fate::Dropped {
            done.push(format!("role {role} dropped"));
        }
        done
    }
}

/// Drops `database` and its owner `role` if (and only if) they are marked ours, as `ours`
/// judges a comment. Both are judged once, before anything is dropped: the database is ours
/// when its comment is, or when it has none and is owned by our marked `role` (a crash
/// between `CREATE DATABASE` and its `COMMENT`; see [`Observed::database_is`]). The
/// `logins` (the owner's rotation logins) are dropped after the database and before the
/// role, each only when its own comment is ours. A missing object is nothing to do; a
/// database's open sessions are ended by [`drop_database`].
pub async fn drop_marked(
    s: &Session,
    database: &str,
    role: &str,
    logins: &[String],
    ours: impl Fn(Option<&str>) -> bool,
) -> Result<Dropped, PgError> {
    let found = observe(s, role, database).await?;
    let fate = |there: bool, mine: bool| match (there, mine) {
        (false, _) => Fate::Absent,
        (true, true) => Fate::Dropped,
        (true, false) => Fate::LeftAlone,
    };
    let dropped = Dropped {
        database: fate(found.database.is_some(), found.database_is(&ours, role)),
        role: fate(found.role.is_some(), found.role_is(&ours)),
    };
    if dropped.database == Fate::Dropped {
        drop_database(s, database).await?;
    }
    for login in logins {
        if observe(s, login, database).await?.role_is(&ours) {
            drop_role(s, login).await?;
        }
    }
    if dropped.role == Fate::Dropped {
        drop_role(s, role).await?;
    }
    Ok(dropped)
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
    fn what_was_dropped_is_described_per_object_that_was_there() {
        let dropped = Dropped {
            database: Fate::LeftAlone,
            role: Fate::Dropped,
        };
        assert_eq!(
            dropped.describe("shop", "shop_owner", "not ours"),
            [
                "database shop left alone (not ours)",
                "role shop_owner dropped"
            ]
        );
        let none = Dropped {
            database: Fate::Absent,
            role: Fate::LeftAlone,
        };
        assert!(none.describe("shop", "shop_owner", "not ours").is_empty());
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
    fn a_role_statement_carries_a_verifier_never_the_password() {
        let statement = password_statement("app\"x", "s3cret-Pa55");
        assert!(
            statement.starts_with("ALTER ROLE \"app\"\"x\" PASSWORD 'SCRAM-SHA-256$4096:"),
            "{statement}"
        );
        assert!(!statement.contains("s3cret-Pa55"), "{statement}");
        // The span shows neither.
        let recorded = super::super::redact_statement(&statement);
        assert_eq!(recorded, "ALTER ROLE \"app\"\"x\" PASSWORD '***'");
    }

    #[test]
    fn statement_recording_is_turned_off_setting_by_setting() {
        let all: Vec<(&str, &str)> = STATEMENT_RECORDING.to_vec();
        let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
        for needed in [
            "log_statement",
            "log_min_duration_statement",
            "log_min_error_statement",
            "pg_stat_statements.track_utility",
        ] {
            assert!(names.contains(&needed), "{needed}");
        }
        assert_eq!(
            set_statements("SET LOCAL", &all[..2]).as_deref(),
            Some("SET LOCAL log_statement = 'none'; SET LOCAL log_min_duration_statement = '-1'")
        );
        assert_eq!(set_statements("SET", &[]), None);
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
