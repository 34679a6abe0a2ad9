//! The Backup reconcile, as a pipeline of named steps:
//!
//! 1. `cleanup` when the Backup is being deleted: its artifact and manifest leave the
//!    store when `deletionPolicy` is Delete (behind the finalizer; [`crate::cleanup`]);
//! 2. `sync_finalizer`: present exactly when deletion has work outside the cluster;
//! 3. every decision is made on the Backup's latest status: the one this process wrote
//!    last while the watch cache does not show it yet, else the cached one
//!    ([`dbops_shared::status::StatusWriter::latest`]); nothing more for a Completed or
//!    Failed Backup (`ended`) but a Completed one's verification when it is due
//!    ([`crate::verifying`]); nothing yet while a retry is not due (`not_yet`,
//!    [`crate::retries`]);
//! 4. a Backup found Running is left to the live replica that holds it, or started over
//!    (`running`, [`crate::runner`]);
//! 5. `ready_database`: the Database (same namespace) must exist (else Failed, at once)
//!    and be Ready (else Pending, `WaitingForDatabase`; its watch brings us back;
//!    [`crate::dereference`]);
//! 6. `take_slot`: one of `--max-concurrent-backups`, and the server's only one
//!    ([`crate::slots`]);
//! 7. `start`: status Running (attempts + 1) written over the Backup as read, then the
//!    attempt ([`crate::attempt`]) while this replica renews its hold;
//! 8. the outcome ([`crate::finish`]): Completed; a transient failure retried after the
//!    shared backoff curve until `maxRetries` retries are spent; a permanent one Failed
//!    at once.
//!
//! A Backup found Running whose runner is this replica restarted, or has stopped renewing
//! its hold (see [`crate::runner`]), was interrupted: it is attempted again, as the next
//! attempt, into the same object key. One held by a live replica is left to it.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use dbops_api::reasons::BackupReason;
use dbops_api::{Backup, BackupPhase, BackupStatus, Database};
use dbops_shared::controller::Context;
use dbops_shared::postgres::ServerKey;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use crate::attempt;
use crate::cleanup;
use crate::dereference::{Dereferenced, dereference};
use crate::error::{Failure, Result};
use crate::finish::{allowed, finish};
use crate::runner::{self, Running};
use crate::slots::Slot;
use crate::state::State;
use crate::status::Standing;
use crate::verifying::{self, Due};
use crate::write::{self, CHANGED_UNDER_US, Over, Published};

/// How soon a Backup waiting for a dump slot looks again.
const SLOT_POLL: Duration = Duration::from_secs(2);

pub async fn reconcile(backup: Arc<Backup>, ctx: Arc<Context<State>>) -> Result<Action> {
    let namespace = backup.namespace().unwrap_or_default();
    let api: Api<Backup> = Api::namespaced(ctx.client.clone(), &namespace);

    if backup.metadata.deletion_timestamp.is_some() {
        return cleanup::cleanup(&backup, &ctx, &api).await;
    }
    cleanup::sync_finalizer(&backup, &api).await?;
    let current = ctx.state.statuses.latest(&backup);
    if let Some(action) = ended(&backup, &ctx, &api, &current).await? {
        return Ok(action);
    }
    if let Some(action) = not_yet(&backup, &ctx) {
        return Ok(action);
    }
    if current.phase == Some(BackupPhase::Running)
        && let Some(action) = running(&backup, &ctx, &api, &current).await?
    {
        return Ok(action);
    }
    let db = match ready_database(&backup, &ctx, &api).await? {
        ControlFlow::Continue(db) => db,
        ControlFlow::Break(action) => return Ok(action),
    };
    let (server, slot) = match take_slot(&backup, &ctx, &api, &db).await? {
        ControlFlow::Continue(taken) => taken,
        ControlFlow::Break(action) => return Ok(action),
    };
    start(&backup, &ctx, &api, &current, &db, &server, slot).await
}

/// A Completed or Failed Backup: forgotten, and a spec change (deletionPolicy,
/// maxRetries) after the end is observed, no more; but a Completed one whose
/// verification is due is verified ([`crate::verifying`]).
async fn ended(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    current: &BackupStatus,
) -> Result<Option<Action>> {
    if !matches!(
        current.phase,
        Some(BackupPhase::Completed | BackupPhase::Failed)
    ) {
        return Ok(None);
    }
    let namespace = backup.namespace().unwrap_or_default();
    ctx.state.databases.forget(&namespace, &backup.name_any());
    ctx.state.retries.forget(&backup.uid().unwrap_or_default());
    if current.phase == Some(BackupPhase::Completed) {
        verifying::remember(backup, current, ctx);
        let timeout = ctx.state.verification.timeout;
        let now = jiff::Timestamp::now();
        match verifying::due(backup, current, &ctx.state.identity, timeout, now) {
            Due::Now => return Ok(Some(verifying::run(backup, ctx, api).await?)),
            Due::HeldBy(left) => return Ok(Some(Action::requeue(left + Duration::from_secs(1)))),
            Due::No => {}
        }
    }
    write::observe_generation(backup, &ctx.state, api).await?;
    Ok(Some(Action::await_change()))
}

/// An unfinished Backup, indexed under its Database; nothing to do yet while its failed
/// attempt's retry is not due.
fn not_yet(backup: &Backup, ctx: &Context<State>) -> Option<Action> {
    let namespace = backup.namespace().unwrap_or_default();
    let uid = backup.uid().unwrap_or_default();
    let database = &backup.spec.database_ref.name;
    ctx.state
        .databases
        .record(&namespace, &backup.name_any(), database);
    ctx.state.retries.retry_in(&uid).map(Action::requeue)
}

/// A Backup found Running: left to the live replica that holds it; started over when its
/// runner stopped (`None`), or Failed when that was the last attempt allowed.
async fn running(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    current: &BackupStatus,
) -> Result<Option<Action>> {
    let done = current.attempts.unwrap_or(0);
    let allowed = allowed(backup);
    match runner::running(current, &ctx.state.identity, jiff::Timestamp::now()) {
        Running::HeldBy { identity, for_ } => {
            // Another replica runs it: nothing to write, look again when its hold
            // would run out (its outcome arrives through the watch before that).
            tracing::debug!(runner = %identity, ?for_, "attempt {done} is held by another replica");
            Ok(Some(Action::requeue(for_ + Duration::from_secs(1))))
        }
        Running::Interrupted => {
            tracing::info!(
                attempt = done,
                "attempt {done} was interrupted (its runner stopped); starting over"
            );
            if done < allowed {
                return Ok(None);
            }
            let failure = Failure::new(
                BackupReason::Interrupted,
                format!("attempt {done} of {allowed} was interrupted and no retry is left"),
            );
            Ok(Some(
                finish(backup, ctx, api, Err(failure), Over::Read).await?,
            ))
        }
    }
}

/// The Database to dump, once it exists and is Ready; a missing one fails the Backup, one
/// not Ready leaves it Pending (the Database watch brings it back when that changes).
async fn ready_database(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
) -> Result<ControlFlow<Action, Box<Database>>> {
    let message = match dereference(backup, ctx).await? {
        Dereferenced::Ready(db) => return Ok(ControlFlow::Continue(db)),
        Dereferenced::Missing(failure) => {
            let action = finish(backup, ctx, api, Err(failure), Over::Read).await?;
            return Ok(ControlFlow::Break(action));
        }
        Dereferenced::NotReady(message) => message,
    };
    let waiting = Standing::Waiting {
        reason: BackupReason::WaitingForDatabase,
        message,
    };
    let published = write::publish(backup, &ctx.state, api, &waiting, Over::Read).await?;
    Ok(ControlFlow::Break(if published.refused() {
        Action::requeue(CHANGED_UNDER_US)
    } else {
        // The Database watch brings the Backup back when it changes.
        Action::requeue(ctx.resync_interval)
    }))
}

/// The Database's server and a dump slot on it; Pending (`WaitingForSlot`) while none is
/// free.
async fn take_slot(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    db: &Database,
) -> Result<ControlFlow<Action, (ServerKey, Slot)>> {
    let server = match ctx.state.directory.get(&db.spec.server_ref.name) {
        Some(found) => dbops_shared::server::key_of(&found),
        // Not found: the attempt reports it (ServerNotFound), under this name's slot.
        None => ServerKey {
            host: db.spec.server_ref.name.clone(),
            port: 0,
        },
    };
    if let Some(slot) = ctx.state.slots.try_acquire(&server) {
        return Ok(ControlFlow::Continue((server, slot)));
    }
    let waiting = Standing::Waiting {
        reason: BackupReason::WaitingForSlot,
        message: format!(
            "waiting for a free dump slot (one dump per server at a time; {server} is busy or all slots are in use)"
        ),
    };
    write::publish(backup, &ctx.state, api, &waiting, Over::Read).await?;
    Ok(ControlFlow::Break(Action::requeue(SLOT_POLL)))
}

/// The next attempt after `current`'s: claimed by a status write over the version
/// decided on, run while this replica renews its hold, and finished as its runner.
/// `slot` is held to the end.
async fn start(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    current: &BackupStatus,
    db: &Database,
    server: &ServerKey,
    slot: Slot,
) -> Result<Action> {
    let (name, uid) = (backup.name_any(), backup.uid().unwrap_or_default());
    let attempt = current.attempts.unwrap_or(0) + 1;
    let started_at = dbops_shared::conditions::now();
    let identity = ctx.state.identity.as_str();
    let running = Standing::Running {
        attempt,
        of: allowed(backup),
        started_at: started_at.clone(),
        what: format!("pg_dump of database {} on {server}", db.database_name()),
        runner: identity,
    };
    // The claim: written only over the Backup as read, so that of two replicas that saw
    // it Pending one starts the attempt and the other gets a conflict.
    let claimed = match write::publish(backup, &ctx.state, api, &running, Over::Read).await? {
        Published::Stored(claimed) => claimed,
        Published::Unchanged | Published::Refused => {
            tracing::debug!("another replica changed the Backup first; not starting an attempt");
            return Ok(Action::requeue(CHANGED_UNDER_US));
        }
    };
    let as_runner = Over::Runner { identity, attempt };
    let ended = tokio::select! {
        ended = attempt::run(&claimed, db, ctx, api, &started_at) => Some(ended),
        () = attempt::hold(&ctx.state, api, &name, identity, attempt) => None,
    };
    let action = match ended {
        Some(ended) => finish(&claimed, ctx, api, ended, as_runner).await,
        None => {
            // The dump (and pg_dump with it) was dropped: the attempt is another's now.
            ctx.state.statuses.forget(&uid);
            ctx.state.retries.forget(&uid);
            Ok(Action::requeue(runner::LEASE))
        }
    };
    // Only now: the next dump on this server must not show Running beside this one.
    drop(slot);
    action
}
