//! What both servers say of the replication: every sign of divergence is a fatal error
//! (an apply error, the subscription or slot gone, the WAL lost, a schema change), and the
//! progress goes into `status.replication`.

use dbops_api::{MigrationReason, ReplicationStatus};
use dbops_shared::postgres::Session;
use dbops_shared::server::Resolved;

use super::sql;
use crate::context::Saga;
use crate::error::{Error, Result};
use crate::servers::{at, migration_uid, names, session, source_server, target_server};

/// The source and target, resolved, the database name and the replication's name.
pub struct Ends {
    pub source: Resolved,
    pub target: Resolved,
    pub database: String,
    pub name: String,
}

pub async fn ends(saga: &Saga<'_>, database: &str) -> Result<Ends> {
    Ok(Ends {
        source: source_server(saga).await?,
        target: target_server(saga).await?,
        database: database.to_string(),
        name: sql::name(&migration_uid(saga)),
    })
}

// ---- what the servers say -------------------------------------------------------------

/// The replication as both servers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub copied: i64,
    pub total: i64,
    pub lag_bytes: Option<i64>,
    pub target_bytes: i64,
    /// The target confirmed the position CatchUp waits for.
    pub reached: bool,
    pub subscription_oid: i64,
}

impl Seen {
    pub fn describe(&self) -> String {
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
pub async fn observe(saga: &Saga<'_>, e: &Ends, catch_up_lsn: Option<&str>) -> Result<Seen> {
    let t = session(saga, &e.target, &e.database).await?;
    let Some(sub) = sql::subscription(&t, &e.name).await? else {
        return Err(Error::step(
            MigrationReason::SubscriptionGone,
            format!(
                "subscription {} is gone from {}: the replication stopped",
                e.name,
                at(&e.target)
            ),
        ));
    };
    let (target_num, _) = crate::sql::server_version(&t).await?;
    let errors = sql::subscription_errors(&t, sub.oid, target_num).await?;
    if let Some((apply, sync)) = errors.filter(|(a, s)| a + s > 0) {
        return Err(Error::step(
            MigrationReason::ReplicationApplyFailed,
            format!(
                "the target {} failed to apply the replicated changes ({apply} apply errors, {sync} table-synchronization errors; the target server's log says which): the copies would diverge",
                at(&e.target)
            ),
        ));
    }
    // Paused for Verify's counts by a controller that died before it enabled it again:
    // enabled now. Disabled otherwise: by an apply error.
    if !sub.enabled && !super::pause::resume_paused(&t, &e.name).await? {
        return Err(Error::step(
            MigrationReason::ReplicationApplyFailed,
            format!(
                "subscription {} on {} was disabled by an apply error (the target server's log says which): the copies would diverge",
                e.name,
                at(&e.target)
            ),
        ));
    }
    let (copied, total) = sql::sync_progress(&t, sub.oid).await?;
    let target_bytes = sql::database_size(&t).await?;
    let s = session(saga, &e.source, &e.database).await?;
    let Some(slot) = sql::slot_progress(&s, &e.name, catch_up_lsn).await? else {
        return Err(Error::step(
            MigrationReason::ReplicationSlotGone,
            format!(
                "replication slot {} is gone from {}: the replication stopped",
                e.name,
                at(&e.source)
            ),
        ));
    };
    if slot.wal_status.as_deref() == Some("lost") {
        return Err(Error::step(
            MigrationReason::ReplicationSlotLost,
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
        crate::sql::tables(s).await?,
        sql::published_tables(s, &e.name).await?,
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
        return Err(Error::step(
            MigrationReason::SchemaChanged,
            format!(
                "the source's tables changed during the replication (new: {new:?}, dropped: {gone:?}); schema changes are not replicated, so the Migration is rolled back: migrate again after the change"
            ),
        ));
    }
    let (on_source, on_target) = (sql::columns(s).await?, sql::columns(t).await?);
    if on_source != on_target {
        let differ: Vec<&String> = on_source
            .iter()
            .filter(|c| !on_target.contains(c))
            .chain(on_target.iter().filter(|c| !on_source.contains(c)))
            .take(10)
            .collect();
        return Err(Error::step(
            MigrationReason::SchemaChanged,
            format!(
                "the columns of the source's tables changed during the replication ({differ:?} differ between the servers); schema changes are not replicated, so the Migration is rolled back: migrate again after the change"
            ),
        ));
    }
    Ok(())
}

/// Writes the replication's progress into status (nothing when it did not change).
pub async fn record(saga: &mut Saga<'_>, seen: &Seen) -> Result<()> {
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

pub async fn update(saga: &mut Saga<'_>, f: impl FnOnce(&mut ReplicationStatus)) -> Result<()> {
    let mut status = saga.status();
    let mut r = status.replication.clone().unwrap_or_default();
    f(&mut r);
    status.replication = Some(r);
    saga.save(status).await
}

/// For a Manual cutover waiting while it replicates: the same checks as Replicate, and
/// the progress in status.
pub async fn watch_replication(saga: &mut Saga<'_>) -> Result<()> {
    let (database, _) = names(saga, None)?;
    let e = ends(saga, &database).await?;
    let seen = observe(saga, &e, None).await?;
    record(saga, &seen).await
}
