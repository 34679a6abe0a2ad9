//! The API writes of a plan: the slot's Backup created, the pruned ones deleted, owner
//! references set as `onDatabaseDeletion` says; an Event for each create and delete.

use dbops_api::{Backup, Database};
use dbops_shared::controller::Context;
use dbops_shared::status::Note;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};

use crate::schedule::cron::MAX_COUNTED;
use crate::schedule::desired::{database_owner, deleted_with, desired_backup};
use crate::schedule::error::Error;
use crate::schedule::plan::{Plan, Take};
use crate::schedule::retention::Prune;
use crate::schedule::scheduled::Scheduled;
use crate::schedule::state::State;

/// Carries `plan` out: the slot's Backup created, the pruned ones deleted (retention
/// `keepLast: keep`), and the owner references of the others as `onDatabaseDeletion`
/// says.
pub async fn apply(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    plan: &Plan,
    existing: &[Scheduled],
    keep: usize,
) -> Result<(), Error> {
    if let Some(take) = &plan.take {
        create(ctx, db, api, take).await?;
    }
    if let Some(busy) = &plan.waiting_for {
        tracing::info!(backup = %busy, "a slot is due; waiting for the unfinished scheduled Backup first");
    }
    for prune in &plan.prune {
        delete(ctx, db, api, prune, keep).await?;
    }
    let pruned: Vec<&str> = plan.prune.iter().map(|p| p.uid.as_str()).collect();
    let want_owned = deleted_with(db);
    for b in existing
        .iter()
        .filter(|b| !b.deleting && b.owned_by_database != want_owned)
        .filter(|b| !pruned.contains(&b.uid.as_str()))
    {
        set_owner(ctx, db, api, b, want_owned).await?;
    }
    Ok(())
}

/// Creates the slot's Backup; one that exists already (another replica, an earlier
/// reconcile that stopped before it saw its own write) is success.
async fn create(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    take: &Take,
) -> Result<(), Error> {
    match api
        .create(&PostParams::default(), &desired_backup(db, take))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {
            tracing::debug!(backup = %take.name, "the slot's Backup exists already");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    }
    tracing::info!(backup = %take.name, slot = %take.slot, skipped = take.skipped, "scheduled Backup created");
    if take.skipped > 0 {
        let counted = if take.skipped >= MAX_COUNTED {
            "at least "
        } else {
            ""
        };
        let plural = if take.skipped == 1 { "" } else { "s" };
        publish(
            ctx,
            db,
            true,
            "SlotsSkipped",
            &format!(
                "skipped {counted}{} slot{plural} that passed while no controller ran; one catch-up Backup {} for the latest slot {}",
                take.skipped, take.name, take.slot
            ),
        )
        .await;
    }
    publish(
        ctx,
        db,
        true,
        "BackupScheduled",
        &format!("created Backup {} for the slot {}", take.name, take.slot),
    )
    .await;
    Ok(())
}

/// Deletes a Backup retention prunes (its finalizer removes the artifact when its
/// policy is Delete); one already gone, or replaced by another of the same name, is
/// left alone.
async fn delete(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    prune: &Prune,
    keep: usize,
) -> Result<(), Error> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(prune.uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&prune.name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    tracing::info!(backup = %prune.name, keep, "pruned by retention");
    publish(
        ctx,
        db,
        true,
        "BackupPruned",
        &format!(
            "deleted Backup {} (retention keepLast {keep}): {}",
            prune.name, prune.why
        ),
    )
    .await;
    Ok(())
}

/// Gives a scheduled Backup an owner reference to its Database, or takes it away, after
/// `onDatabaseDeletion` changed. The Backup's other owner references stay.
async fn set_owner(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    backup: &Scheduled,
    owned: bool,
) -> Result<(), Error> {
    let Some(current) = ctx
        .state
        .backups
        .state()
        .into_iter()
        .find(|b| b.uid().as_deref() == Some(backup.uid.as_str()))
    else {
        return Ok(());
    };
    let uid = db.uid().unwrap_or_default();
    let mut owners: Vec<OwnerReference> = current
        .owner_references()
        .iter()
        .filter(|o| o.uid != uid)
        .cloned()
        .collect();
    if owned {
        owners.extend(database_owner(db));
    }
    // The resourceVersion makes a stale view fail (409) instead of dropping an owner.
    let patch = serde_json::json!({"metadata": {
        "resourceVersion": current.resource_version(),
        "ownerReferences": owners,
    }});
    match api
        .patch(&backup.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    tracing::info!(backup = %backup.name, owned, "owner reference to the Database changed");
    Ok(())
}

/// Publishes an Event about the Database's schedule; failures are logged, never fatal.
/// Through `dbops_shared::status::announce`: the schedule keeps no status of its own.
pub async fn publish(ctx: &Context<State>, db: &Database, normal: bool, reason: &str, note: &str) {
    let note = Note::of(normal, "Schedule", reason, note);
    dbops_shared::status::announce(&ctx.state.recorder, db, &note).await;
}
