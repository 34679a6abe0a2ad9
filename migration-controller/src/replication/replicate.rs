//! The Logical mode's steps and their compensation (SQL in `replication`):
//!
//! | step | does | compensation |
//! |---|---|---|
//! | Replicate | the schema (`pg_dump --schema-only` into the target database, in one transaction); a publication of the database's tables, a replication role (LOGIN REPLICATION, a random password, read access) on the source; a subscription on the target whose slot has the Migration's name; waits for the initial copy of every table and a lag under [`LAG_BOUND`] | [`teardown`] |
//! | CatchUp | after FreezeSource: records the source's WAL position, waits until the target has confirmed it, copies the sequences' values, then [`teardown`] | [`teardown`] |
//!
//! [`teardown`] drops the subscription (disabled and detached from its slot first, so it
//! never waits for the source), then on the source the slot (and the subscription's
//! table-synchronization slots), the publication and the role: every one found by the
//! name derived from the Migration's UID, so it runs the same after a crash at any line.
//! The source's part runs even when the target cannot be reached: a slot is never left
//! holding the source's WAL.
//!
//! While it replicates (and while a Manual cutover waits), every check fails the
//! Migration with a clear reason rather than letting the copies diverge: an apply or
//! table-synchronization error on the target (`ReplicationApplyFailed`, PostgreSQL 15+
//! counts them; the subscription is disabled on error), the subscription or the slot
//! gone, the slot's WAL lost, and a schema change on the source (`SchemaChanged`: the
//! tables published, or any table's columns, differ between the servers).

use std::time::{Duration, Instant};

use dbops_api::{Database, MigrationStep, ReplicationStatus};
use dbops_shared::postgres::Session;
use dbops_shared::server::Resolved;

use crate::copy::{self, Contents, Programs, Side};
use crate::error::{Error, Result};
use crate::replication;
use crate::saga::{Moment, Saga};
use crate::sql;
use crate::steps::{Outcome, at, migration_uid, session, source_server, target_server};

/// The lag (bytes of the source's WAL the target has not confirmed) under which the
/// Replicate step is done: the catch-up after the freeze then takes about a second.
pub const LAG_BOUND: i64 = 16 * 1024 * 1024;
/// How often Replicate looks at the replication while it waits.
const POLL: Duration = Duration::from_secs(2);
/// How long CatchUp waits within one reconcile before it records its progress.
const CATCH_UP_INLINE: Duration = Duration::from_secs(30);
/// How long the source may stay frozen waiting for the catch-up before the Migration is
/// rolled back (and the source unfrozen).
const CATCH_UP_LIMIT: Duration = Duration::from_secs(600);

/// The source and target, resolved, the database name and the replication's name.
struct Ends {
    source: Resolved,
    target: Resolved,
    database: String,
    name: String,
}

async fn ends(saga: &Saga<'_>, database: &str) -> Result<Ends> {
    Ok(Ends {
        source: source_server(saga).await?,
        target: target_server(saga).await?,
        database: database.to_string(),
        name: replication::name(&migration_uid(saga)),
    })
}

// ---- Replicate ------------------------------------------------------------------------

pub async fn replicate(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let e = ends(saga, &db.database_name()).await?;
    let schema = copy_schema(saga, &e, &db.owner_role()).await?;
    let mut s = session(saga, &e.source, &e.database).await?;
    if !replication::publication_exists(&s, &e.name).await? {
        let tables = sql::tables(&s).await?;
        replication::create_publication(&s, &e.name, &tables).await?;
    }
    let (source_num, _) = sql::server_version(&s).await?;
    let mark = replication::role_mark(&migration_uid(saga));
    let mut password = match replication::role(&s, &e.name).await? {
        None => {
            let password = dbops_shared::postgres::generate_password();
            replication::create_role(&mut s, &e.name, &password, &mark, &e.database, source_num)
                .await?;
            Some(password)
        }
        Some(comment) if comment.as_deref() == Some(mark.as_str()) => None,
        Some(_) => {
            return Err(Error::fatal(
                "NameConflict",
                format!(
                    "a role {} exists on {} and was not created by this Migration",
                    e.name,
                    at(&e.source)
                ),
            ));
        }
    };
    let mut t = session(saga, &e.target, &e.database).await?;
    if replication::subscription(&t, &e.name).await?.is_none() {
        // A slot of this name without its subscription: a CREATE SUBSCRIPTION that did
        // not commit on the target after it created the slot. Dropped, then made again.
        for slot in replication::slots(&s, &e.name, None).await? {
            drop_slot(&s, &slot.name).await?;
        }
        // The password is known only to this process: a new one when the role was not
        // created just now (a restarted controller rotates it).
        let password = match password.take() {
            Some(p) => p,
            None => {
                let p = dbops_shared::postgres::generate_password();
                replication::set_password(&mut s, &e.name, &p).await?;
                p
            }
        };
        let conninfo = replication::conninfo(&e.source.endpoint, &e.database, &e.name, &password);
        let (target_num, target_version) = sql::server_version(&t).await?;
        // Preflight refuses such a target; a Migration that chose Logical before that rule
        // (an older controller) ends here, before anything runs as the admin.
        if let Some(unsafe_target) = crate::logical::unsafe_target(target_num, &target_version) {
            return Err(Error::fatal(
                unsafe_target.reason(),
                unsafe_target.message(),
            ));
        }
        replication::create_subscription(&mut t, &e.name, &conninfo)
            .await
            .map_err(|err| subscription_error(err, &e))?;
        // The slot exists on the source; the status knows nothing of it yet.
        saga.crash_point(MigrationStep::Replicate, Moment::SlotCreated);
    }
    drop((s, t));
    let seen = observe(saga, &e, None).await?;
    record(saga, &seen).await?;
    let progress = seen.describe();
    if seen.copied < seen.total || seen.lag_bytes.is_none_or(|lag| lag > LAG_BOUND) {
        return Ok(Outcome::Poll(
            format!(
                "replicating {} from {}: {progress}",
                e.database,
                at(&e.source)
            ),
            POLL,
        ));
    }
    Ok(Outcome::Done(format!(
        "{schema}; publication, replication role and subscription {} replicate {} from {} to {}: {progress}",
        e.name,
        e.database,
        at(&e.source),
        at(&e.target)
    )))
}

/// The schema, once: a restore in one transaction, so a database with objects of its
/// own has it all.
async fn copy_schema(saga: &Saga<'_>, e: &Ends, owner: &str) -> Result<String> {
    let t = session(saga, &e.target, &e.database).await?;
    let already = sql::user_objects(&t).await?;
    let (target_num, target_version) = sql::server_version(&t).await?;
    drop(t);
    if already > 0 {
        return Ok(format!(
            "schema already copied ({already} objects in the target database)"
        ));
    }
    let s = session(saga, &e.source, &e.database).await?;
    let (source_num, source_version) = sql::server_version(&s).await?;
    drop(s);
    // The programs that suit both majors, as the Dump mode's copy takes them.
    let (pg_dump, pg_restore) = crate::steps::copy_programs(
        saga,
        (source_num, &source_version),
        (target_num, &target_version),
        true,
    )
    .await?;
    let started = Instant::now();
    copy::copy(
        &Programs {
            pg_dump: &pg_dump.path,
            pg_restore: &pg_restore.path,
        },
        &Side {
            server: &e.source.endpoint,
            credentials: &e.source.credentials,
            database: &e.database,
        },
        &Side {
            server: &e.target.endpoint,
            credentials: &e.target.credentials,
            database: &e.database,
        },
        owner,
        Contents::SchemaOnly,
    )
    .await?;
    Ok(format!(
        "schema copied in {:.1}s",
        started.elapsed().as_secs_f64()
    ))
}

/// CREATE SUBSCRIPTION's failure, with the server's message: the target could not reach
/// the source (or log in there), or another.
fn subscription_error(err: dbops_shared::postgres::PgError, e: &Ends) -> Error {
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    if text.contains("could not connect to the publisher") {
        return Error::transient(
            "SourceUnreachableFromTarget",
            format!(
                "the target {} cannot connect to the source {} for the subscription: {text}",
                at(&e.target),
                at(&e.source)
            ),
        );
    }
    Error::transient("SubscriptionFailed", text)
}

// ---- what the servers say -------------------------------------------------------------

/// The replication as both servers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    copied: i64,
    total: i64,
    lag_bytes: Option<i64>,
    target_bytes: i64,
    /// The target confirmed the position CatchUp waits for.
    reached: bool,
    subscription_oid: i64,
}

impl Seen {
    fn describe(&self) -> String {
        format!(
            "{}/{} tables copied, lag {}, target database {} bytes",
            self.copied,
            self.total,
            self.lag_bytes
                .map_or("unknown".to_string(), |l| format!("{l} bytes")),
            self.target_bytes
        )
    }
}

/// Reads the replication on both servers; every sign of divergence is a fatal error.
async fn observe(saga: &Saga<'_>, e: &Ends, catch_up_lsn: Option<&str>) -> Result<Seen> {
    let t = session(saga, &e.target, &e.database).await?;
    let Some(sub) = replication::subscription(&t, &e.name).await? else {
        return Err(Error::fatal(
            "SubscriptionGone",
            format!(
                "subscription {} is gone from {}: the replication stopped",
                e.name,
                at(&e.target)
            ),
        ));
    };
    let (target_num, _) = sql::server_version(&t).await?;
    let errors = replication::subscription_errors(&t, sub.oid, target_num).await?;
    if let Some((apply, sync)) = errors.filter(|(a, s)| a + s > 0) {
        return Err(Error::fatal(
            "ReplicationApplyFailed",
            format!(
                "the target {} failed to apply the replicated changes ({apply} apply errors, {sync} table-synchronization errors; the target server's log says which): the copies would diverge",
                at(&e.target)
            ),
        ));
    }
    if !sub.enabled {
        return Err(Error::fatal(
            "ReplicationApplyFailed",
            format!(
                "subscription {} on {} was disabled by an apply error (the target server's log says which): the copies would diverge",
                e.name,
                at(&e.target)
            ),
        ));
    }
    let (copied, total) = replication::sync_progress(&t, sub.oid).await?;
    let target_bytes = replication::database_size(&t).await?;
    let s = session(saga, &e.source, &e.database).await?;
    let Some(slot) = replication::slot_progress(&s, &e.name, catch_up_lsn).await? else {
        return Err(Error::fatal(
            "ReplicationSlotGone",
            format!(
                "replication slot {} is gone from {}: the replication stopped",
                e.name,
                at(&e.source)
            ),
        ));
    };
    if slot.wal_status.as_deref() == Some("lost") {
        return Err(Error::fatal(
            "ReplicationSlotLost",
            format!(
                "the WAL replication slot {} needs was removed from {} (max_slot_wal_keep_size)",
                e.name,
                at(&e.source)
            ),
        ));
    }
    schema_unchanged(&s, &t, e).await?;
    Ok(Seen {
        copied,
        total,
        lag_bytes: slot.lag_bytes,
        target_bytes,
        reached: slot.reached,
        subscription_oid: sub.oid,
    })
}

/// The tables published are the source's tables, and every table has the same columns
/// on both servers: otherwise the source's schema changed during the replication.
async fn schema_unchanged(s: &Session, t: &Session, e: &Ends) -> Result<()> {
    let (tables, published) = (
        sql::tables(s).await?,
        replication::published_tables(s, &e.name).await?,
    );
    if tables != published {
        let new: Vec<String> = tables
            .iter()
            .filter(|x| !published.contains(x))
            .map(|(n, t)| format!("{n}.{t}"))
            .collect();
        let gone: Vec<String> = published
            .iter()
            .filter(|x| !tables.contains(x))
            .map(|(n, t)| format!("{n}.{t}"))
            .collect();
        return Err(Error::fatal(
            "SchemaChanged",
            format!(
                "the source's tables changed during the replication (new: {new:?}, dropped: {gone:?}); schema changes are not replicated, so the Migration is rolled back: migrate again after the change"
            ),
        ));
    }
    let (on_source, on_target) = (
        replication::columns(s).await?,
        replication::columns(t).await?,
    );
    if on_source != on_target {
        let differ: Vec<&String> = on_source
            .iter()
            .filter(|c| !on_target.contains(c))
            .chain(on_target.iter().filter(|c| !on_source.contains(c)))
            .take(10)
            .collect();
        return Err(Error::fatal(
            "SchemaChanged",
            format!(
                "the columns of the source's tables changed during the replication ({differ:?} differ between the servers); schema changes are not replicated, so the Migration is rolled back: migrate again after the change"
            ),
        ));
    }
    Ok(())
}

/// Writes the replication's progress into status (nothing when it did not change).
async fn record(saga: &mut Saga<'_>, seen: &Seen) -> Result<()> {
    let mut status = saga.status();
    let mut r = status.replication.clone().unwrap_or_default();
    r.tables_copied = i32::try_from(seen.copied).unwrap_or(i32::MAX);
    r.tables_total = i32::try_from(seen.total).unwrap_or(i32::MAX);
    r.lag_bytes = seen.lag_bytes;
    r.target_bytes = Some(seen.target_bytes);
    r.subscription_oid = Some(seen.subscription_oid);
    status.replication = Some(r);
    saga.save(status).await
}

async fn update(saga: &mut Saga<'_>, f: impl FnOnce(&mut ReplicationStatus)) -> Result<()> {
    let mut status = saga.status();
    let mut r = status.replication.clone().unwrap_or_default();
    f(&mut r);
    status.replication = Some(r);
    saga.save(status).await
}

/// For a Manual cutover waiting while it replicates: the same checks as Replicate, and
/// the progress in status.
pub async fn watch_replication(saga: &mut Saga<'_>) -> Result<()> {
    let (database, _) = crate::steps::names(saga, None)?;
    let e = ends(saga, &database).await?;
    let seen = observe(saga, &e, None).await?;
    record(saga, &seen).await
}

// ---- CatchUp --------------------------------------------------------------------------

pub async fn catch_up(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let e = ends(saga, &db.database_name()).await?;
    let replication = saga.status().replication.unwrap_or_default();
    let mut sequences = 0;
    if !replication.caught_up {
        let lsn = match replication.catch_up_lsn {
            Some(lsn) => lsn,
            None => {
                // The source is frozen (FreezeSource succeeded): every committed write
                // is before this position.
                let s = session(saga, &e.source, &e.database).await?;
                let lsn = replication::current_lsn(&s).await?;
                let recorded = lsn.clone();
                update(saga, |r| r.catch_up_lsn = Some(recorded)).await?;
                lsn
            }
        };
        let started = Instant::now();
        let seen = loop {
            let seen = observe(saga, &e, Some(&lsn)).await?;
            if seen.reached && seen.copied == seen.total {
                break seen;
            }
            if started.elapsed() >= CATCH_UP_INLINE {
                record(saga, &seen).await?;
                if frozen_for(saga) >= CATCH_UP_LIMIT {
                    return Err(Error::fatal(
                        "CatchUpTimedOut",
                        format!(
                            "the target did not apply the source's changes up to {lsn} within {} s of the freeze ({})",
                            CATCH_UP_LIMIT.as_secs(),
                            seen.describe()
                        ),
                    ));
                }
                return Ok(Outcome::Poll(
                    format!(
                        "waiting for the target to apply up to {lsn}: {}",
                        seen.describe()
                    ),
                    Duration::from_secs(1),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        record(saga, &seen).await?;
        let s = session(saga, &e.source, &e.database).await?;
        let values = replication::sequences(&s).await?;
        drop(s);
        let t = session(saga, &e.target, &e.database).await?;
        sequences = replication::set_sequences(&t, &values).await?;
        drop(t);
        update(saga, |r| r.caught_up = true).await?;
    }
    let lsn = saga
        .status()
        .replication
        .and_then(|r| r.catch_up_lsn)
        .unwrap_or_default();
    let down = teardown(saga, &e.database).await?;
    Ok(Outcome::Done(format!(
        "the target applied everything up to the source's {lsn}; {sequences} sequences copied; {down}"
    )))
}

/// How long the CatchUp step has been running (the source is frozen meanwhile).
fn frozen_for(saga: &Saga<'_>) -> Duration {
    let status = saga.status();
    crate::progress::step(&status, MigrationStep::CatchUp)
        .and_then(|s| s.started_at.clone())
        .map(|t| {
            let ms = jiff::Timestamp::now().as_millisecond() - t.0.as_millisecond();
            Duration::from_millis(u64::try_from(ms).unwrap_or_default())
        })
        .unwrap_or_default()
}

// ---- teardown -------------------------------------------------------------------------

/// Drops the subscription, its slots, the publication and the replication role (each
/// only if it is there); returns what was done.
pub async fn teardown(saga: &mut Saga<'_>, database: &str) -> Result<String> {
    let name = replication::name(&migration_uid(saga));
    let mut done = Vec::new();
    let target = teardown_target(saga, database, &name).await;
    if let Ok(Some(what)) = &target {
        done.push(what.clone());
    }
    done.extend(teardown_source(saga, database, &name).await?);
    target?;
    if done.is_empty() {
        done.push(format!("no replication {name} left on either server"));
    }
    Ok(done.join(", "))
}

async fn teardown_target(
    saga: &mut Saga<'_>,
    database: &str,
    name: &str,
) -> Result<Option<String>> {
    let target = target_server(saga).await?;
    let tp = session(saga, &target, "postgres").await?;
    let found = sql::observe(&tp, "", database).await?.database;
    drop(tp);
    if found.is_none() {
        return Ok(None);
    }
    let t = session(saga, &target, database).await?;
    let Some(sub) = replication::subscription(&t, name).await? else {
        return Ok(None);
    };
    // Recorded before the drop: the subscription's table-synchronization slots on the
    // source are named after its OID.
    update(saga, |r| r.subscription_oid = Some(sub.oid)).await?;
    replication::drop_subscription(&t, name).await?;
    Ok(Some(format!(
        "subscription {name} dropped on {}",
        at(&target)
    )))
}

async fn teardown_source(saga: &mut Saga<'_>, database: &str, name: &str) -> Result<Vec<String>> {
    let source = source_server(saga).await?;
    let sp = session(saga, &source, "postgres").await?;
    let found = sql::observe(&sp, "", database).await?.database;
    let mut done = Vec::new();
    let mark = replication::role_mark(&migration_uid(saga));
    let role_session = if found.is_some() {
        drop(sp);
        // The database may be frozen (read-only by default): this session writes.
        let s = session(saga, &source, database).await?;
        s.batch_execute("SET default_transaction_read_only = off")
            .await
            .map_err(dbops_shared::postgres::PgError::sql(
                "allowing writes in the admin's session",
            ))?;
        let oid = saga.status().replication.and_then(|r| r.subscription_oid);
        for slot in replication::slots(&s, name, oid).await? {
            drop_slot(&s, &slot.name).await?;
            done.push(format!("replication slot {} dropped", slot.name));
        }
        if replication::drop_publication(&s, name).await? {
            done.push(format!("publication {name} dropped"));
        }
        s
    } else {
        sp
    };
    if replication::role(&role_session, name)
        .await?
        .flatten()
        .as_deref()
        == Some(mark.as_str())
    {
        sql::drop_role(&role_session, name).await?;
        done.push(format!("replication role {name} dropped"));
    }
    if found.is_some() {
        let _ = role_session
            .batch_execute("RESET default_transaction_read_only")
            .await;
    }
    if !done.is_empty() {
        done = vec![format!("on {}: {}", at(&source), done.join(", "))];
    }
    Ok(done)
}

async fn drop_slot(s: &Session, slot: &str) -> Result<()> {
    if replication::drop_slot(s, slot).await? {
        return Ok(());
    }
    Err(Error::transient(
        "ReplicationSlotActive",
        format!("replication slot {slot} is still in use after its WAL sender was ended"),
    ))
}
