//! The finalizer `dbops.dev/database-cleanup`: present on a Database exactly when its
//! deletion has work to do outside the cluster (policy Delete or Snapshot, or a Migration
//! in flight); `delete` removes it once that work is done.

use dbops_api::{Database, DatabaseDeletionPolicy};
use kube::ResourceExt;
use kube::api::Api;

use dbops_api::names::finalizer::DATABASE_CLEANUP as FINALIZER;

use crate::error::Result;

pub(crate) fn needs_finalizer(db: &Database, migration_active: bool) -> bool {
    db.spec.deletion_policy != DatabaseDeletionPolicy::Retain || migration_active
}

pub(crate) fn has_finalizer(db: &Database) -> bool {
    db.finalizers().iter().any(|f| f == FINALIZER)
}

/// The finalizer is there exactly when deletion has work to do outside the cluster.
pub(crate) async fn sync_finalizer(
    db: &Database,
    api: &Api<Database>,
    migration_active: bool,
) -> Result<()> {
    let want = needs_finalizer(db, migration_active);
    Ok(dbops_shared::finalizer::set(db, api, FINALIZER, want).await?)
}

pub(crate) async fn remove_finalizer(db: &Database, api: &Api<Database>) -> Result<()> {
    Ok(dbops_shared::finalizer::set(db, api, FINALIZER, false).await?)
}
