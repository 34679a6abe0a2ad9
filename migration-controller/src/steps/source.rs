//! The source's steps: FreezeSource (and its compensation, the unfreeze) and Cleanup
//! (`sourceRetention`).

use dbops_api::{ChosenMode, Database, MigrationReason, SourceRetention};

use crate::context::{Saga, StepOutcome};
use crate::error::{Error, Result};
use crate::servers::{
    at, database_uid, migration_uid, names, resolve, session, source_ref, source_server,
};
use crate::sql;

pub async fn freeze_source(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let source = source_server(saga).await?;
    let database = db.database_name();
    let status = saga.status();
    let logical = status.mode == Some(ChosenMode::Logical);
    // Logical mode, nothing frozen yet: Verify's counts now, while the source is writable
    // (before this step takes a session of its own).
    let counted = if logical && status.freeze.is_none() {
        Some(crate::replication::baseline::take(saga, &database).await)
    } else {
        None
    };
    // Logical mode: the subscription's WAL sender stays for the catch-up, whether it
    // logs in as the Migration's replication role or as the source's admin (an admin
    // that may not create a replication role: see `replication::replicate`).
    let spare: Vec<String> = if logical {
        vec![
            crate::replication::sql::name(&migration_uid(saga)),
            source.credentials.username.clone(),
        ]
    } else {
        Vec::new()
    };
    // The source's pooler holds the database's new transactions first: the freeze then
    // ends no pooled transaction, and the pooler's clients wait instead of failing.
    let held = Box::pin(crate::pooled::hold(saga, &source, &database)).await?;
    let mut status = saga.status();
    let s = session(saga, &source, "postgres").await?;
    let record = match status.freeze.clone() {
        Some(r) => r,
        None => {
            // A connection limit of 0 would shut out an admin that is not a superuser.
            let by_privilege = !sql::capabilities(&s).await?.superuser;
            let found = sql::freeze_state(&s, &database, by_privilege, &spare)
                .await?
                .ok_or_else(|| {
                    Error::step(
                        MigrationReason::SourceNotFound,
                        format!("database {database:?} is gone from {}", at(&source)),
                    )
                })?;
            // Written before anything changes: the compensation restores exactly this.
            status.freeze = Some(found.clone());
            saga.save(status).await?;
            found
        }
    };
    let (ended, left) = sql::freeze(&s, &database, &record, &spare).await?;
    if left > 0 {
        return Err(Error::step(
            MigrationReason::SessionsRemain,
            format!("{left} sessions on {database} survived pg_terminate_backend"),
        ));
    }
    let counted = match counted {
        Some(Ok(said)) => format!("; before it, {said}"),
        Some(Err(why)) => format!("; Verify counts in the freeze: {why}"),
        None => String::new(),
    };
    let closed = match &record.closed_to {
        None => format!(
            "connection limit 0 (was {})",
            record.previous_connection_limit
        ),
        Some(roles) => format!("CONNECT revoked from {roles:?}"),
    };
    let held = held.map(|m| format!("; {m}")).unwrap_or_default();
    Ok(StepOutcome::Done(format!(
        "database {database} on {}: {closed}, default_transaction_read_only on (was {}); {ended} sessions ended{counted}{held}",
        at(&source),
        record.previous_read_only.as_deref().unwrap_or("unset"),
    )))
}

/// FreezeSource's compensation: the source as it was, then the pooler's clients let go.
pub async fn unfreeze_source(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    let unfrozen = unfreeze(saga, db).await?;
    let held = saga.status().pooler.is_some_and(|p| p.holds());
    if !held {
        return Ok(unfrozen);
    }
    let source = source_server(saga).await?;
    Ok(
        match Box::pin(crate::pooled::let_go(saga, &source)).await? {
            Some(done) => format!("{unfrozen}; {done}"),
            None => unfrozen,
        },
    )
}

async fn unfreeze(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    let Some(record) = saga.status().freeze else {
        return Ok("nothing was frozen".into());
    };
    let (database, _) = names(saga, db)?;
    let source = source_server(saga).await?;
    let s = session(saga, &source, "postgres").await?;
    if sql::freeze_state(&s, &database, false, &[])
        .await?
        .is_none()
    {
        return Ok(format!(
            "database {database} no longer exists on {}",
            at(&source)
        ));
    }
    sql::unfreeze(&s, &database, &record).await?;
    Ok(format!(
        "database {database} on {}: connection limit {} and default_transaction_read_only {} restored",
        at(&source),
        record.previous_connection_limit,
        record.previous_read_only.as_deref().unwrap_or("unset"),
    ))
}

/// Keep or Drop the source; `db` is `None` when the Database was deleted after the switch.
pub async fn cleanup(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    let source_ref = source_ref(saga)?;
    let (database, role) = names(saga, db)?;
    // Logical mode: CatchUp took the replication down; once more in case it did not
    // finish (nothing is written when nothing is left).
    let replication = if saga.status().mode == Some(ChosenMode::Logical) {
        let counts = crate::replication::baseline::forget(saga, &database)
            .await
            .map(|dropped| format!("{dropped}; "))
            .unwrap_or_default();
        format!(
            "{counts}{}; ",
            crate::replication::teardown(saga, &database).await?
        )
    } else {
        String::new()
    };
    if saga.m.spec.source_retention == SourceRetention::Keep {
        return Ok(format!(
            "{replication}sourceRetention Keep: database {database} stays on DatabaseServer {}, frozen (read-only, closed to new sessions)",
            source_ref.name
        ));
    }
    let source = resolve(saga, &source_ref).await?;
    let uid = database_uid(saga)?;
    let s = session(saga, &source, "postgres").await?;
    let ours = |comment: Option<&str>| sql::is_databases(comment, &uid);
    let dropped = sql::drop_marked(&s, &database, &role, &[], ours).await?;
    let mut done = dropped.describe(&database, &role, "not this Database's");
    if done.is_empty() {
        done.push("already gone".into());
    }
    Ok(format!(
        "{replication}sourceRetention Drop on {}: {}",
        at(&source),
        done.join(", ")
    ))
}
