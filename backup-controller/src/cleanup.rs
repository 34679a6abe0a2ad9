//! The Backup's finalizer and its deletion: the artifact and manifest leave the store
//! when `deletionPolicy` is Delete.

use dbops_api::names::finalizer;
use dbops_api::{Backup, BackupDeletionPolicy};
use dbops_shared::backup_store::traced;
use dbops_shared::controller::Context;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use crate::dump::object_key;
use crate::error::Result;
use crate::state::State;
use crate::write;

/// The finalizer of a Backup whose artifact goes with it.
const FINALIZER: &str = finalizer::BACKUP_ARTIFACT;

fn wants_finalizer(backup: &Backup) -> bool {
    backup.spec.deletion_policy == BackupDeletionPolicy::Delete
}

fn has_finalizer(backup: &Backup) -> bool {
    backup.finalizers().iter().any(|f| f == FINALIZER)
}

/// The finalizer is there exactly when deleting the Backup must remove its artifact.
pub async fn sync_finalizer(backup: &Backup, api: &Api<Backup>) -> Result<()> {
    let want = wants_finalizer(backup);
    Ok(dbops_shared::finalizer::set(backup, api, FINALIZER, want).await?)
}

/// Deletion: the artifact and manifest go when the policy says Delete (already gone is
/// fine), then the finalizer.
pub async fn cleanup(backup: &Backup, ctx: &Context<State>, api: &Api<Backup>) -> Result<Action> {
    let namespace = backup.namespace().unwrap_or_default();
    ctx.state.databases.forget(&namespace, &backup.name_any());
    let uid = backup.uid().unwrap_or_default();
    ctx.state.retries.forget(&uid);
    ctx.state.statuses.forget(&uid);
    if !has_finalizer(backup) {
        return Ok(Action::await_change());
    }
    let key = object_key(backup);
    if wants_finalizer(backup) {
        let store = &ctx.state.store;
        traced("delete", store.location(&key), store.delete(&key)).await?;
        write::publish_event(
            &ctx.state,
            backup,
            "ArtifactDeleted",
            &format!("removed {} and its manifest", store.location(&key)),
        )
        .await;
    }
    dbops_shared::finalizer::set(backup, api, FINALIZER, false).await?;
    Ok(Action::await_change())
}
