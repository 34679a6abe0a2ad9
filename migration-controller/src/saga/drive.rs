//! The reconcile: reads the Migration, guards its start (finished, refused, finalizer),
//! then executes the moves [`next_move`] chooses until one waits, fails or the saga ends.

use std::sync::Arc;

use dbops_api::{Database, Migration, MigrationPhase, MigrationReason, MigrationStep};
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use dbops_shared::status::Desired;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;

use super::next_move::{DatabaseView, Move, gives_up, next_move};
use super::rollback;
use crate::context::{Saga, State, StepOutcome, note};
use crate::debug::{Moment, injected_failure};
use crate::error::{Error, Result};
use crate::{progress, replication, steps};

/// The entry point: see the module documentation of `saga`.
pub async fn reconcile(obj: Arc<Migration>, ctx: Arc<Context<State>>) -> Result<Action> {
    let namespace = obj.namespace().unwrap_or_default();
    let api: Api<Migration> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(m) = api.get_opt(&obj.name_any()).await? else {
        ctx.state.index.forget(&namespace, &obj.name_any());
        if let Some(uid) = obj.uid() {
            ctx.state.status_writer.forget(&uid);
        }
        return Ok(Action::await_change());
    };
    ctx.state
        .index
        .record(&namespace, &m.name_any(), &m.spec.database_ref.name);
    let mut saga = Saga {
        ctx: &ctx,
        api,
        namespace,
        m,
    };
    run(&mut saga).await
}

/// A finished Migration loses its finalizer; one not started yet is refused while another
/// of its Database is active; the finalizer goes on; then [`drive`].
async fn run(saga: &mut Saga<'_>) -> Result<Action> {
    let status = saga.status();
    if progress::is_terminal(&status) {
        // Its last status is written and read back: nothing of it left to remember.
        saga.forget_written();
        saga.set_finalizer(false).await?;
        return Ok(Action::await_change());
    }
    if !progress::any_started(&status) && status.phase != Some(MigrationPhase::RollingBack) {
        if saga.deleting() {
            saga.set_finalizer(false).await?;
            return Ok(Action::await_change());
        }
        if let Some(other) = active_sibling(saga).await? {
            let mut status = status;
            progress::refused(&mut status, saga.generation(), &other);
            let refused = note(
                false,
                MigrationReason::MigrationAlreadyActive.as_str(),
                format!("refused: Migration {other} of the same Database is active"),
            );
            saga.write(Desired::new(status).with(refused)).await?;
            return Ok(Action::await_change());
        }
    }
    if !saga.deleting() {
        saga.set_finalizer(true).await?;
        saga.adopt_trace().await?;
    }
    drive(saga).await
}

/// A Migration of the same Database that is active, or that was created first and has
/// not ended (so two created at once never both run, nor both get refused).
async fn active_sibling(saga: &Saga<'_>) -> Result<Option<String>> {
    let all = saga.api.list(&ListParams::default()).await?;
    let me = (
        saga.m.metadata.creation_timestamp.clone(),
        saga.m.name_any(),
    );
    Ok(all
        .items
        .into_iter()
        .filter(|o| o.spec.database_ref.name == saga.m.spec.database_ref.name)
        .filter(|o| o.name_any() != saga.m.name_any())
        .filter(|o| o.metadata.deletion_timestamp.is_none())
        .find(|o| {
            let s = o.status.clone().unwrap_or_default();
            if progress::is_terminal(&s) {
                return false;
            }
            progress::any_started(&s) || (o.metadata.creation_timestamp.clone(), o.name_any()) < me
        })
        .map(|o| o.name_any()))
}

/// Executes the moves [`next_move`] chooses until one waits, fails or the saga ends.
async fn drive(saga: &mut Saga<'_>) -> Result<Action> {
    // The Database as read for the next decision; read again after every other move.
    let mut db: Option<Option<Database>> = None;
    loop {
        let status = saga.status();
        let view = match &db {
            None => DatabaseView::Unread,
            Some(None) => DatabaseView::Gone,
            Some(Some(d)) => DatabaseView::Found(d),
        };
        let chosen = next_move(&saga.m, &status, view);
        let read = db.take();
        match chosen {
            Move::ReadDatabase => db = Some(saga.database().await?),
            Move::Compensate => return rollback::roll_back(saga).await,
            Move::Finish => return finish(saga).await,
            Move::RollBack {
                step,
                reason,
                message,
            } => rollback::begin(saga, status, step, reason, &message).await?,
            Move::AwaitApproval { next, replicating } => {
                return await_approval(saga, next, replicating).await;
            }
            Move::FinishWithoutDatabase(step) => finish_without_database(saga, step).await?,
            Move::DatabaseNotFound => return database_not_found(saga).await,
            Move::DatabaseMissing => return Err(database_missing(saga)),
            Move::Run(step) => {
                let Some(db) = read.flatten() else {
                    return Err(database_missing(saga));
                };
                if let Some(action) = run_step(saga, step, &db).await? {
                    return Ok(action);
                }
            }
        }
    }
}

/// Preflight found no Database: Pending, looked at again after the resync interval.
async fn database_not_found(saga: &mut Saga<'_>) -> Result<Action> {
    let mut status = saga.status();
    progress::pending(
        &mut status,
        saga.generation(),
        MigrationReason::DatabaseNotFound,
        format!(
            "Database {}/{} does not exist",
            saga.namespace, saga.m.spec.database_ref.name
        ),
    );
    saga.save(status).await?;
    Ok(Action::requeue(saga.ctx.resync_interval))
}

fn database_missing(saga: &Saga<'_>) -> Error {
    Error::step(
        MigrationReason::DatabaseNotFound,
        format!("Database {} does not exist", saga.m.spec.database_ref.name),
    )
}

/// Runs `step` between its Running record and its outcome's: `None` when the saga goes
/// on (the step succeeded, or the rollback began), else how the reconcile ends.
async fn run_step(
    saga: &mut Saga<'_>,
    step: MigrationStep,
    db: &Database,
) -> Result<Option<Action>> {
    let mut status = saga.status();
    progress::start(&mut status, step, saga.generation());
    saga.save(status).await?;
    saga.crash_point(step, Moment::Started);

    let outcome = match steps::run(saga, step, db).await {
        Ok(StepOutcome::Done(_)) if saga.ctx.state.fail_at == Some(step) => {
            Err(injected_failure(step))
        }
        outcome => outcome,
    };
    let (message, requeue) = match outcome {
        Ok(StepOutcome::Done(message)) => {
            saga.crash_point(step, Moment::Done);
            succeeded(saga, step, message).await?;
            return Ok(None);
        }
        Ok(StepOutcome::Wait(message)) => (message, saga.ctx.resync_interval),
        Ok(StepOutcome::Poll(message, after)) => (message, after.min(saga.ctx.resync_interval)),
        Err(e) => return failed(saga, step, e).await.map(|()| None),
    };
    let mut status = saga.status();
    progress::waiting(&mut status, step, message);
    saga.save(status).await?;
    Ok(Some(Action::requeue(requeue)))
}

/// A step failed: a fatal failure before the switch, or the last attempt, begins the
/// rollback (`Ok`); a failure that counts is recorded and retried (`Err`, with backoff);
/// any other is retried as it is.
async fn failed(saga: &mut Saga<'_>, step: MigrationStep, e: Error) -> Result<()> {
    let before_switch = super::next_move::before_switch(step);
    match e {
        e if before_switch && e.kind() == ErrorKind::Permanent => {
            let status = saga.status();
            rollback::begin(saga, status, step, e.rollback_reason(), &e.to_string()).await
        }
        e if e.counts_as_attempt() => {
            let mut status = saga.status();
            let message = e.to_string();
            let attempts = progress::attempt_failed(&mut status, step, message.clone());
            if gives_up(step, attempts, saga.ctx.state.max_attempts) {
                let message = format!("{message} (after {attempts} attempts)");
                return rollback::begin(saga, status, step, e.rollback_reason(), &message).await;
            }
            let retrying = note(
                false,
                format!("{}Retrying", step.as_str()),
                format!("attempt {attempts} failed: {message}"),
            );
            saga.write(Desired::new(status).with(retrying)).await?;
            Err(e)
        }
        e => Err(e),
    }
}

/// The steps left after the switch when the Database object is gone (it was deleted
/// after SwitchTraffic): SwitchTraffic has nothing left to wait for; Cleanup works from
/// the names Preflight recorded.
async fn finish_without_database(saga: &mut Saga<'_>, step: MigrationStep) -> Result<()> {
    let mut status = saga.status();
    progress::start(&mut status, step, saga.generation());
    saga.save(status).await?;
    let message = match step {
        MigrationStep::Cleanup => steps::cleanup(saga, None).await?,
        _ => format!(
            "Database {} was deleted after its server was switched to the target; nothing left to wait for",
            saga.m.spec.database_ref.name
        ),
    };
    succeeded(saga, step, message).await
}

/// Records the step Succeeded with `message`, its duration and an Event.
async fn succeeded(saga: &mut Saga<'_>, step: MigrationStep, message: String) -> Result<()> {
    let mut status = saga.status();
    let seconds = progress::succeed(&mut status, step, message.clone());
    let event = note(true, format!("{}Succeeded", step.as_str()), message);
    saga.write(Desired::new(status).with(event)).await?;
    saga.ctx.state.metrics.observe_step(step.as_str(), seconds);
    Ok(())
}

/// Manual cutover: waits for approval before `next`. In the Logical mode (`replicating`)
/// the replication goes on meanwhile; each reconcile (every resync interval) checks it
/// and records its progress, and a failure (an apply error, a schema change on the
/// source) rolls the Migration back from Replicate.
async fn await_approval(
    saga: &mut Saga<'_>,
    next: MigrationStep,
    replicating: bool,
) -> Result<Action> {
    let mut status = saga.status();
    let first = status.phase != Some(MigrationPhase::AwaitingApproval);
    progress::awaiting_approval(&mut status, next, saga.generation());
    let message = progress::approval_message(status.mode);
    let mut desired = Desired::new(status);
    if first {
        desired = desired.with(note(
            true,
            MigrationReason::AwaitingApproval.as_str(),
            message,
        ));
    }
    saga.write(desired).await?;
    if !replicating {
        return Ok(Action::await_change());
    }
    match replication::watch_replication(saga).await {
        Ok(()) => Ok(Action::requeue(saga.ctx.resync_interval)),
        Err(e) if e.kind() == ErrorKind::Permanent => {
            let (status, step) = (saga.status(), MigrationStep::Replicate);
            rollback::begin(saga, status, step, e.rollback_reason(), &e.to_string()).await?;
            Box::pin(drive(saga)).await
        }
        Err(e) => Err(e),
    }
}

/// Every step succeeded: the Migration ends Succeeded and loses its finalizer.
async fn finish(saga: &mut Saga<'_>) -> Result<Action> {
    let mut status = saga.status();
    let message = format!(
        "Database {} now lives on DatabaseServer {}",
        saga.m.spec.database_ref.name, saga.m.spec.target.server_ref.name
    );
    progress::succeeded(&mut status, saga.generation(), message.clone());
    let succeeded = note(true, MigrationReason::Succeeded.as_str(), message);
    saga.write(Desired::new(status).with(succeeded)).await?;
    saga.set_finalizer(false).await?;
    Ok(Action::await_change())
}
