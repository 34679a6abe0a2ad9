//! The rollback: begun when a step before SwitchTraffic cannot succeed ([`begin`]), then
//! the compensations of the steps that ran, in reverse order, each recorded as it
//! completes, ending RolledBack ([`roll_back`]).

use dbops_api::{MigrationReason, MigrationStatus, MigrationStep};
use dbops_shared::status::Desired;
use kube::runtime::controller::Action;

use crate::context::{Saga, note};
use crate::error::{Error, Result};
use crate::progress;
use crate::steps;

/// Records `step` failed for good with `reason` and `message` on `status` (the phase
/// becomes RollingBack), with the rollback metric and an Event.
pub async fn begin(
    saga: &mut Saga<'_>,
    mut status: MigrationStatus,
    step: MigrationStep,
    reason: MigrationReason,
    message: &str,
) -> Result<()> {
    progress::begin_rollback(
        &mut status,
        step,
        reason.as_str(),
        message,
        saga.generation(),
    );
    let (reason, message) = progress::failure(&status);
    let started = note(
        false,
        "RollbackStarted",
        format!("{reason}: {message}; undoing the steps that ran"),
    );
    saga.write(Desired::new(status).with(started)).await?;
    saga.ctx.state.metrics.record_rollback(step.as_str());
    Ok(())
}

/// Compensations in reverse order, each recorded as done; then RolledBack.
pub async fn roll_back(saga: &mut Saga<'_>) -> Result<Action> {
    let db = saga.database().await?;
    let mut pending: Option<(MigrationStep, Error)> = None;
    for step in progress::to_compensate(&saga.status()) {
        if progress::is_compensated(&saga.status(), step) {
            continue;
        }
        match steps::compensate(saga, step, db.as_ref()).await {
            Ok(message) => {
                let mut status = saga.status();
                progress::compensated(&mut status, step, message.clone());
                let compensated = note(true, format!("{}Compensated", step.as_str()), message);
                saga.write(Desired::new(status).with(compensated)).await?;
            }
            // A server that cannot be reached holds up its own compensation only: the
            // others (above all unfreezing the source) go ahead; this one is retried
            // with backoff.
            Err(e) if pending.is_none() && !matches!(e, Error::Kube(_) | Error::Stale) => {
                pending = Some((step, e));
            }
            Err(e) => return Err(e),
        }
    }
    if let Some((step, e)) = pending {
        let mut status = saga.status();
        progress::compensation_failed(&mut status, step, &e.to_string(), saga.generation());
        saga.save(status).await?;
        return Err(e);
    }
    let mut status = saga.status();
    progress::rolled_back(&mut status, saga.generation());
    let (reason, message) = progress::failure(&status);
    let rolled_back = note(
        false,
        MigrationReason::RolledBack.as_str(),
        format!("{reason}: {message}; every step that ran was undone"),
    );
    saga.write(Desired::new(status).with(rolled_back)).await?;
    saga.set_finalizer(false).await?;
    Ok(Action::await_change())
}
