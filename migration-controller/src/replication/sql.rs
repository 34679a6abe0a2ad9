//! The Logical mode's SQL: the publication, the replication role and the replication
//! slot on the source, the subscription on the target, and what is read of them.
//!
//! One name for all four, derived from the Migration's UID ([`name`]): a process that
//! crashed at any line (even between the slot's creation on the source, which CREATE
//! SUBSCRIPTION does, and any record of it) finds and drops them by that name alone.
//! The subscription's table-synchronization slots (`pg_<subscription oid>_sync_<...>`)
//! are found by the subscription's OID, which the status records before the subscription
//! is dropped.
//!
//! Identifiers and literals go through `quote_ident`/`quote_literal` or bind parameters;
//! the replication role's password reaches the source only as a SCRAM verifier, and the
//! target only inside CREATE SUBSCRIPTION's connection string; both statements run with
//! the session's statement logging off (`ddl::execute_unlogged`), their spans masked.

use dbops_api::TlsMode;
use dbops_api::names::comment::{MIGRATION_PREFIX, REPLICATION};
use dbops_shared::postgres::ddl::{self, Unlogged};
use dbops_shared::postgres::{Endpoint, PgError, Session, quote_ident, quote_literal};

/// The replication slot, subscription, publication and role of the Migration `uid`.
pub fn name(migration_uid: &str) -> String {
    format!(
        "dbops_mig_{}",
        migration_uid.replace('-', "_").to_lowercase()
    )
}

/// The comment on the replication role: which Migration created it.
pub fn role_mark(migration_uid: &str) -> String {
    format!("{MIGRATION_PREFIX}{migration_uid} {REPLICATION}")
}

/// `LIKE` pattern of the table-synchronization slots of the subscription `oid`.
pub fn sync_slot_pattern(subscription_oid: i64) -> String {
    format!("pg\\_{subscription_oid}\\_sync\\_%")
}

/// A libpq connection-string value, single-quoted with `\` and `'` escaped.
fn conninfo_value(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// libpq's sslmode for the target's connection to the source. The target server has no
/// copy of the source's CA, so `verify-ca`/`verify-full` become `require` (encrypted, the
/// certificate not verified); `disable` becomes `prefer`.
pub fn sslmode(mode: TlsMode) -> &'static str {
    match mode {
        TlsMode::Disable => "prefer",
        TlsMode::Require | TlsMode::VerifyCa | TlsMode::VerifyFull => "require",
    }
}

/// The connection string the subscription uses to reach the source: as `user` (the
/// replication role, or the source's admin), named `application` there.
pub fn conninfo(
    source: &Endpoint,
    database: &str,
    user: &str,
    password: &str,
    application: &str,
) -> String {
    [
        ("host", source.key.host.as_str()),
        ("port", &source.key.port.to_string()),
        ("dbname", database),
        ("user", user),
        ("password", password),
        ("sslmode", sslmode(source.tls.mode)),
        ("connect_timeout", "10"),
        ("application_name", application),
    ]
    .iter()
    .map(|(k, v)| format!("{k}={}", conninfo_value(v)))
    .collect::<Vec<_>>()
    .join(" ")
}

// ---- source ---------------------------------------------------------------------------

/// Whether the publication exists in the connected database.
pub async fn publication_exists(s: &Session, name: &str) -> Result<bool, PgError> {
    Ok(
        s.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
            .await
            .map_err(PgError::sql("reading pg_publication"))?
            .is_some(),
    )
}

/// Creates the publication of `tables` (schema, table) in the connected database.
pub async fn create_publication(
    s: &Session,
    name: &str,
    tables: &[(String, String)],
) -> Result<(), PgError> {
    let list = tables
        .iter()
        .map(|(schema, table)| format!("{}.{}", quote_ident(schema), quote_ident(table)))
        .collect::<Vec<_>>()
        .join(", ");
    let statement = if list.is_empty() {
        format!("CREATE PUBLICATION {}", quote_ident(name))
    } else {
        format!("CREATE PUBLICATION {} FOR TABLE {list}", quote_ident(name))
    };
    s.batch_execute(&statement)
        .await
        .map_err(PgError::sql(format!("creating publication {name}")))
}

/// The tables of the publication, as (schema, table), sorted.
pub async fn published_tables(s: &Session, name: &str) -> Result<Vec<(String, String)>, PgError> {
    let rows = s
        .query(
            "SELECT schemaname::text, tablename::text FROM pg_publication_tables \
             WHERE pubname = $1 ORDER BY 1, 2",
            &[&name],
        )
        .await
        .map_err(PgError::sql("reading pg_publication_tables"))?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

pub async fn drop_publication(s: &Session, name: &str) -> Result<bool, PgError> {
    if !publication_exists(s, name).await? {
        return Ok(false);
    }
    s.batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", quote_ident(name)))
        .await
        .map_err(PgError::sql(format!("dropping publication {name}")))?;
    Ok(true)
}

/// The comment of the role `name`, if it exists (`Some(None)`: no comment).
pub async fn role(s: &Session, name: &str) -> Result<Option<Option<String>>, PgError> {
    let row = s
        .query_opt(
            "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1",
            &[&name],
        )
        .await
        .map_err(PgError::sql("reading pg_roles"))?;
    Ok(row.map(|r| r.get(0)))
}

/// Creates the replication role (LOGIN REPLICATION, the password's verifier), marks it,
/// makes the admin a member (its `DROP OWNED BY` needs that) and lets it connect to
/// `database` (closed to PUBLIC by dbops) and read the tables: `pg_read_all_data` when
/// the admin may grant it (`read_all`: a superuser on PostgreSQL 14+), else SELECT on the
/// tables of every schema of the connected database; in one transaction. `DROP OWNED BY`
/// takes it all back.
pub async fn create_role(
    s: &mut Session,
    name: &str,
    password: &str,
    mark: &str,
    database: &str,
    read_all: bool,
) -> Result<(), PgError> {
    let schemas: Vec<String> = if read_all {
        Vec::new()
    } else {
        s.query(
            &format!(
                "SELECT DISTINCT n.nspname::text {} ORDER BY 1",
                dbops_shared::postgres::ddl::USER_TABLES
            ),
            &[],
        )
        .await
        .map_err(PgError::sql("listing schemas"))?
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    let r = quote_ident(name);
    let mut statements = vec![
        format!("CREATE ROLE {r} LOGIN REPLICATION"),
        format!("COMMENT ON ROLE {r} IS {}", quote_literal(mark)),
        ddl::adopt_statement(name),
        format!("GRANT CONNECT ON DATABASE {} TO {r}", quote_ident(database)),
    ];
    if read_all {
        statements.push(format!("GRANT pg_read_all_data TO {r}"));
    }
    for schema in &schemas {
        let n = quote_ident(schema);
        statements.push(format!("GRANT USAGE ON SCHEMA {n} TO {r}"));
        statements.push(format!("GRANT SELECT ON ALL TABLES IN SCHEMA {n} TO {r}"));
    }
    // The verifier in a statement of its own, unlogged, in the same transaction.
    ddl::execute_unlogged(
        s,
        Unlogged::InTransactionAfter(&statements.join("; ")),
        &ddl::password_statement(name, password),
        format!("creating replication role {name}"),
    )
    .await
}

/// A new password for the role (its verifier only, with statement logging off).
pub async fn set_password(s: &mut Session, name: &str, password: &str) -> Result<(), PgError> {
    ddl::set_password(s, name, password).await
}

/// A replication slot on the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: String,
    pub active_pid: Option<i32>,
}

/// The slot `name` and the table-synchronization slots of the subscription `oid`.
pub async fn slots(
    s: &Session,
    name: &str,
    subscription_oid: Option<i64>,
) -> Result<Vec<Slot>, PgError> {
    let pattern = subscription_oid.map(sync_slot_pattern);
    let rows = s
        .query(
            "SELECT slot_name::text, active_pid FROM pg_replication_slots \
             WHERE slot_name = $1 OR ($2::text IS NOT NULL AND slot_name LIKE $2::text) \
             ORDER BY 1",
            &[&name, &pattern],
        )
        .await
        .map_err(PgError::sql("reading pg_replication_slots"))?;
    Ok(rows
        .iter()
        .map(|r| Slot {
            name: r.get(0),
            active_pid: r.get(1),
        })
        .collect())
}

/// Drops the slot, ending the WAL sender that holds it first (a few rounds: a
/// subscription that is still enabled reconnects). False when it is still held after
/// 20 s.
pub async fn drop_slot(s: &Session, slot: &str) -> Result<bool, PgError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    // pg_terminate_backend(pid, timeout) is PostgreSQL 14's; on 13 the loop waits itself.
    let (version, _) = crate::sql::server_version(s).await?;
    let terminate = if version >= 140000 {
        "SELECT pg_terminate_backend($1, 5000)"
    } else {
        "SELECT pg_terminate_backend($1)"
    };
    loop {
        let row = s
            .query_opt(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(PgError::sql("reading pg_replication_slots"))?;
        let Some(row) = row else {
            return Ok(true);
        };
        let active: Option<i32> = row.get(0);
        let result = match active {
            Some(pid) => s.query_one(terminate, &[&pid]).await.map(|_| ()),
            None => s
                .query_one("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
                .map(|_| ()),
        };
        match result {
            Ok(()) if active.is_none() => return Ok(true),
            Ok(()) => {}
            // Taken again between the read and the drop, or gone meanwhile: read again.
            Err(_) if std::time::Instant::now() < deadline => {}
            Err(e) => {
                return Err(PgError::sql(format!("dropping replication slot {slot}"))(e));
            }
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The source's WAL position now, as text (`0/16B3748`).
pub async fn current_lsn(s: &Session) -> Result<String, PgError> {
    Ok(s.query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map_err(PgError::sql("reading pg_current_wal_lsn()"))?
        .get(0))
}

/// What the source says of the slot: how far behind its WAL position the target's
/// confirmed position is, and whether it has reached `lsn` when one is given. `None`
/// when the slot does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotProgress {
    pub lag_bytes: Option<i64>,
    pub reached: bool,
    /// `pg_replication_slots.wal_status` (PostgreSQL 13+): `lost` means the WAL it needs
    /// is gone.
    pub wal_status: Option<String>,
}

pub async fn slot_progress(
    s: &Session,
    slot: &str,
    lsn: Option<&str>,
) -> Result<Option<SlotProgress>, PgError> {
    let row = s
        .query_opt(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, \
                    COALESCE(confirmed_flush_lsn >= $2::text::pg_lsn, false), wal_status::text \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot, &lsn.unwrap_or("0/0")],
        )
        .await
        .map_err(PgError::sql("reading the replication slot's position"))?;
    Ok(row.map(|r| SlotProgress {
        lag_bytes: r.get(0),
        reached: r.get(1),
        wal_status: r.get(2),
    }))
}

/// Every column of the connected database's tables as `schema.table.column type`,
/// sorted: the schema a replication relies on being the same on both sides.
pub async fn columns(s: &Session) -> Result<Vec<String>, PgError> {
    let rows = s
        .query(
            &format!(
                "SELECT format('%I.%I.%I %s', t.nspname, t.relname, a.attname, \
                               format_type(a.atttypid, a.atttypmod)) \
                   FROM (SELECT c.oid, n.nspname, c.relname {}) t \
                   JOIN pg_attribute a ON a.attrelid = t.oid \
                  WHERE a.attnum > 0 AND NOT a.attisdropped \
                  ORDER BY 1",
                dbops_shared::postgres::ddl::USER_TABLES
            ),
            &[],
        )
        .await
        .map_err(PgError::sql("reading the tables' columns"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The sequences of the connected database (not an extension's) with their last value,
/// as (schema, sequence, last_value); `None` for one never used.
pub async fn sequences(s: &Session) -> Result<Vec<(String, String, Option<i64>)>, PgError> {
    let rows = s
        .query(
            "SELECT s.schemaname::text, s.sequencename::text, s.last_value \
               FROM pg_sequences s \
               JOIN pg_namespace n ON n.nspname = s.schemaname \
               JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = s.sequencename \
              WHERE s.schemaname NOT IN ('pg_catalog', 'information_schema') \
                AND NOT EXISTS (SELECT 1 FROM pg_depend d \
                                 WHERE d.classid = 'pg_class'::regclass \
                                   AND d.objid = c.oid AND d.deptype = 'e') \
              ORDER BY 1, 2",
            &[],
        )
        .await
        .map_err(PgError::sql("reading pg_sequences"))?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

/// Sets each sequence of the connected database to the value it has on the source.
pub async fn set_sequences(
    s: &Session,
    values: &[(String, String, Option<i64>)],
) -> Result<usize, PgError> {
    let mut set = 0;
    for (schema, sequence, value) in values {
        let Some(value) = value else { continue };
        let qualified = format!("{}.{}", quote_ident(schema), quote_ident(sequence));
        s.query_one(
            "SELECT setval($1::text::regclass, $2, true)",
            &[&qualified, value],
        )
        .await
        .map_err(PgError::sql(format!(
            "setting sequence {schema}.{sequence}"
        )))?;
        set += 1;
    }
    Ok(set)
}

// ---- target ---------------------------------------------------------------------------

/// The subscription of that name in the connected database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub oid: i64,
    pub enabled: bool,
}

pub async fn subscription(s: &Session, name: &str) -> Result<Option<Subscription>, PgError> {
    let row = s
        .query_opt(
            "SELECT oid::bigint, subenabled FROM pg_subscription \
             WHERE subname = $1 \
               AND subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[&name],
        )
        .await
        .map_err(PgError::sql("reading pg_subscription"))?;
    Ok(row.map(|r| Subscription {
        oid: r.get(0),
        enabled: r.get(1),
    }))
}

/// Creates the subscription, which creates the slot `name` on the source and starts the
/// initial copy. The statement carries the password in its connection string: it runs
/// alone with the session's statement logging off ([`ddl::execute_unlogged`], best effort
/// when the admin may not), its span masks the string, and it never appears in an error
/// (`PgError` keeps the server's message, not the statement).
pub async fn create_subscription(
    s: &mut Session,
    name: &str,
    conninfo: &str,
) -> Result<(), PgError> {
    // `run_as_owner = false` (16's default, said out loud): the initial copy and the apply
    // run each table's triggers, index expressions, checks and defaults as the table's
    // owner, never as the subscription's (the admin). Only servers of 16 and newer have
    // it, and only they are ever subscribed to (`MIN_SAFE_TARGET`).
    let options = format!(
        "slot_name = {}, create_slot = true, copy_data = true, disable_on_error = true, run_as_owner = false",
        quote_literal(name)
    );
    ddl::execute_unlogged(
        s,
        Unlogged::Alone,
        &format!(
            "CREATE SUBSCRIPTION {n} CONNECTION {} PUBLICATION {n} WITH ({options})",
            quote_literal(conninfo),
            n = quote_ident(name),
        ),
        format!("creating subscription {name}"),
    )
    .await
}

/// Disables the subscription, detaches it from its slot (dropped on the source
/// separately) and drops it: nothing here waits for the source.
pub async fn drop_subscription(s: &Session, name: &str) -> Result<(), PgError> {
    let n = quote_ident(name);
    for statement in [
        format!("ALTER SUBSCRIPTION {n} DISABLE"),
        format!("ALTER SUBSCRIPTION {n} SET (slot_name = NONE)"),
        format!("DROP SUBSCRIPTION IF EXISTS {n}"),
    ] {
        s.batch_execute(&statement)
            .await
            .map_err(PgError::sql(format!("dropping subscription {name}")))?;
    }
    Ok(())
}

/// The subscription's tables: (copied, total). Copied: state ready or synchronized.
pub async fn sync_progress(s: &Session, oid: i64) -> Result<(i64, i64), PgError> {
    let row = s
        .query_one(
            "SELECT count(*) FILTER (WHERE srsubstate IN ('r', 's')), count(*) \
             FROM pg_subscription_rel WHERE srsubid = $1::bigint::oid",
            &[&oid],
        )
        .await
        .map_err(PgError::sql("reading pg_subscription_rel"))?;
    Ok((row.get(0), row.get(1)))
}

/// Apply and table-synchronization errors of the subscription since it was created
/// (`pg_stat_subscription_stats`, PostgreSQL 15+; `None` before).
pub async fn subscription_errors(
    s: &Session,
    oid: i64,
    server_version_num: i32,
) -> Result<Option<(i64, i64)>, PgError> {
    if server_version_num < 150000 {
        return Ok(None);
    }
    let row = s
        .query_opt(
            "SELECT apply_error_count, sync_error_count FROM pg_stat_subscription_stats \
             WHERE subid = $1::bigint::oid",
            &[&oid],
        )
        .await
        .map_err(PgError::sql("reading pg_stat_subscription_stats"))?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// The size of the connected database in bytes.
pub async fn database_size(s: &Session) -> Result<i64, PgError> {
    Ok(
        s.query_one("SELECT pg_database_size(current_database())", &[])
            .await
            .map_err(PgError::sql("reading pg_database_size"))?
            .get(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_name_per_migration_fits_an_identifier() {
        let n = name("0b7c1e2a-9f3d-4c55-8a1e-2f6b9d0c1a77");
        assert_eq!(n, "dbops_mig_0b7c1e2a_9f3d_4c55_8a1e_2f6b9d0c1a77");
        assert!(n.len() <= 63);
        assert!(
            n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "a valid replication slot name"
        );
        assert_eq!(sync_slot_pattern(16412), "pg\\_16412\\_sync\\_%");
    }

    #[test]
    fn connection_strings_quote_every_value() {
        let source = Endpoint::new("db.example", 5433, TlsMode::VerifyFull);
        let c = conninfo(&source, "it's", "dbops_mig_x", "p\\w'd", "dbops_mig_x");
        assert_eq!(
            c,
            "host='db.example' port='5433' dbname='it\\'s' user='dbops_mig_x' \
             password='p\\\\w\\'d' sslmode='require' connect_timeout='10' \
             application_name='dbops_mig_x'"
        );
        assert_eq!(sslmode(TlsMode::Disable), "prefer");
    }
}
