//! The replication taken down: the compensation of Replicate and CatchUp, the end of
//! CatchUp and (once more) of Cleanup.

use dbops_api::MigrationReason;
use dbops_shared::postgres::Session;

use super::observe::update;
use super::sql;
use crate::context::Saga;
use crate::error::{Error, Result};
use crate::servers::{at, migration_uid, session, source_server, target_server};

// ---- teardown -------------------------------------------------------------------------

/// Drops the subscription, its slots, the publication and the replication role (each
/// only if it is there); returns what was done.
pub async fn teardown(saga: &mut Saga<'_>, database: &str) -> Result<String> {
    let name = sql::name(&migration_uid(saga));
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
    let found = crate::sql::observe(&tp, "", database).await?.database;
    drop(tp);
    if found.is_none() {
        return Ok(None);
    }
    let t = session(saga, &target, database).await?;
    let Some(sub) = sql::subscription(&t, name).await? else {
        return Ok(None);
    };
    // Recorded before the drop: the subscription's table-synchronization slots on the
    // source are named after its OID.
    update(saga, |r| r.subscription_oid = Some(sub.oid)).await?;
    sql::drop_subscription(&t, name).await?;
    Ok(Some(format!(
        "subscription {name} dropped on {}",
        at(&target)
    )))
}

async fn teardown_source(saga: &mut Saga<'_>, database: &str, name: &str) -> Result<Vec<String>> {
    let source = source_server(saga).await?;
    let sp = session(saga, &source, "postgres").await?;
    let found = crate::sql::observe(&sp, "", database).await?.database;
    let mut done = Vec::new();
    let mark = sql::role_mark(&migration_uid(saga));
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
        for slot in sql::slots(&s, name, oid).await? {
            drop_slot(&s, &slot.name).await?;
            done.push(format!("replication slot {} dropped", slot.name));
        }
        if sql::drop_publication(&s, name).await? {
            done.push(format!("publication {name} dropped"));
        }
        s
    } else {
        sp
    };
    if sql::role(&role_session, name).await?.flatten().as_deref() == Some(mark.as_str()) {
        crate::sql::drop_role(&role_session, name).await?;
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

pub async fn drop_slot(s: &Session, slot: &str) -> Result<()> {
    if sql::drop_slot(s, slot).await? {
        return Ok(());
    }
    Err(Error::step(
        MigrationReason::ReplicationSlotActive,
        format!("replication slot {slot} is still in use after its WAL sender was ended"),
    ))
}
