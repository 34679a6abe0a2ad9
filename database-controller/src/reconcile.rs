//! The Database reconcile, as a pipeline of named steps:
//!
//! 1. `delete::cleanup` when the Database is being deleted (behind the finalizer);
//! 2. `finalizer::sync_finalizer`: present exactly when deletion has work to do outside
//!    the cluster (policy Delete or Snapshot, or a Migration in flight);
//! 3. `provision::provision`: `admit` (the DatabaseServer exists, allows the namespace and
//!    has room under its quota), then session → observe → plan → apply → settings →
//!    logins → extensions → connection Secret; each step checks before it writes, so a
//!    converged Database costs reads only;
//! 4. `status::publish`: the status derived from the outcome, written only if it differs,
//!    and an Event for every condition transition.

use dbops_api::reasons::DatabaseReason;
use std::sync::Arc;
use std::time::Duration;

use dbops_api::{Database, Migration, MigrationPhase};
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;

use crate::delete::cleanup;
use crate::error::{Error, Result};
use crate::expiry;
use crate::finalizer::sync_finalizer;
use crate::provision::provision;
use crate::state::State;
use crate::status;

/// How long a reconcile waits for a cache's first list before it backs off.
const STORE_SYNC_WAIT: Duration = Duration::from_secs(30);

pub async fn reconcile(db: Arc<Database>, ctx: Arc<Context<State>>) -> Result<Action> {
    match reconcile_held(&db, &ctx).await {
        // What this reconcile waited for outlasted the object it read: the object of that
        // name now (if any) is reconciled in its own right, this one is left alone.
        Err(Error::Superseded(why)) => {
            tracing::info!(
                why,
                "reconcile abandoned: what it read is no longer current (the Database, or its connection Secret newer than the cache); nothing was changed for it"
            );
            ctx.state.verified.forget(&db.uid().unwrap_or_default());
            Ok(Action::requeue(SUPERSEDED_REQUEUE))
        }
        other => other,
    }
}

/// How soon the name of a Database whose reconcile was abandoned ([`Error::Superseded`]) is
/// looked at again (its watch event usually comes first).
const SUPERSEDED_REQUEUE: Duration = Duration::from_secs(1);

async fn reconcile_held(db: &Database, ctx: &Context<State>) -> Result<Action> {
    let namespace = db.namespace().unwrap_or_default();
    let api: Api<Database> = Api::namespaced(ctx.client.clone(), &namespace);
    ctx.state.prune(ctx.resync_interval);

    let migration = active_migration(ctx, db).await?;

    if db.metadata.deletion_timestamp.is_some() {
        ctx.state
            .expiry_warned
            .forget(&db.uid().unwrap_or_default());
        return cleanup(db, ctx, &api, migration.as_deref()).await;
    }
    sync_finalizer(db, &api, migration.is_some()).await?;
    let (expired, expiry_next) = expiry::act(db, ctx, &api, migration.as_deref()).await?;
    if expired {
        // The deletion's event brings it back, to the finalizer's work.
        return Ok(Action::await_change());
    }
    let resync = expiry_next.map_or(ctx.resync_interval, |n| n.min(ctx.resync_interval));

    let outcome = provision(db, ctx, migration.is_some()).await;
    match outcome {
        Err(Error::Superseded(why)) => return Err(Error::Superseded(why)),
        // Nothing was read, the status stands: looked at again at the next resync.
        Err(Error::Deferred) => return Ok(Action::requeue(resync)),
        _ => {}
    }
    status::publish(db, ctx, &api, &outcome, migration.as_deref()).await?;
    match outcome {
        Ok(p) => Ok(Action::requeue(
            p.logins.next.map_or(resync, |n| n.min(resync)),
        )),
        // Nothing to retry until something changes; the watches and the resync notice.
        Err(Error::Waiting { again, .. }) => Ok(Action::requeue(again.min(resync))),
        Err(e) if e.kind() == ErrorKind::Permanent => Ok(Action::requeue(resync)),
        // Transient, a breaker refusal included: the error policy's per-object backoff
        // grows (an Ok here would reset it). The server's return wakes it sooner: the
        // DatabaseServer turning Ready maps to its Databases.
        Err(e) => Err(e),
    }
}

/// The name of a Migration of this Database that has not ended.
async fn active_migration(ctx: &Context<State>, db: &Database) -> Result<Option<String>> {
    let namespace = db.namespace().unwrap_or_default();
    let name = db.name_any();
    let migrations: Vec<Arc<Migration>> = match ctx.state.migrations.get() {
        Some(store) => {
            // Before the first list, "no Migration" would be a guess; the wait is bounded.
            if !dbops_shared::store_ready::ready_within(store, STORE_SYNC_WAIT).await {
                return Err(Error::Reported {
                    reason: DatabaseReason::CacheNotSynced.into(),
                    message: "the Migration cache has not synced yet".into(),
                });
            }
            store.state()
        }
        None => {
            let api: Api<Migration> = Api::namespaced(ctx.client.clone(), &namespace);
            let list = api.list(&ListParams::default()).await?;
            list.items.into_iter().map(Arc::new).collect()
        }
    };
    Ok(migrations
        .into_iter()
        .find(|m| {
            m.metadata.namespace.as_deref() == Some(namespace.as_str())
                && m.spec.database_ref.name == name
                && !m
                    .status
                    .as_ref()
                    .and_then(|s| s.phase)
                    .is_some_and(MigrationPhase::is_final)
        })
        .map(|m| m.name_any()))
}
