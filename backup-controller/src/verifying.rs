//! The verification step of a Completed Backup's reconcile (`spec.verify`): whether one
//! is due, its claim, the run ([`crate::verify`]) and its outcome in the status, the
//! Event and the metrics.
//!
//! Two replicas: the claim is a status write over the version read (`verification`
//! Running, naming this replica), so one of them runs it; the outcome is written only
//! while the status still names this replica. A verification is bounded by
//! `--verify-timeout`, so one found Running longer than that (and [`MARGIN`]) was
//! interrupted, and is started over by whichever replica sees it; one found naming this
//! replica was interrupted by its restart (a reconcile never runs twice at once here).

use std::time::Duration;

use dbops_api::{Backup, BackupStatus, VerificationResult};
use dbops_shared::controller::Context;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use crate::error::Result;
use crate::state::State;
use crate::verify;
use crate::write::{self, CHANGED_UNDER_US, Published};

/// How long past `--verify-timeout` a Running verification's runner is still trusted to
/// write its outcome.
pub const MARGIN: Duration = Duration::from_secs(120);
/// How soon a verification waiting for this replica's running one looks again.
const QUEUED: Duration = Duration::from_secs(5);

/// Whether a verification of a Completed Backup is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Due {
    /// Not asked for, or done.
    No,
    /// Start it (first time, or interrupted).
    Now,
    /// Another replica runs it: look again after this long.
    HeldBy(Duration),
}

/// Whether `backup` (Completed, with `status`) has a verification to run, seen by
/// replica `me` at `now` with `--verify-timeout` `timeout`.
pub fn due(
    backup: &Backup,
    status: &BackupStatus,
    me: &str,
    timeout: Duration,
    now: jiff::Timestamp,
) -> Due {
    if !backup.spec.verify {
        return Due::No;
    }
    let Some(v) = &status.verification else {
        return Due::Now;
    };
    if v.result != VerificationResult::Running {
        return Due::No;
    }
    if v.runner.as_deref() == Some(me) {
        return Due::Now;
    }
    let Some(started) = &v.started_at else {
        return Due::Now;
    };
    let lease = jiff::SignedDuration::try_from(timeout + MARGIN).unwrap_or_default();
    let until = started.0.checked_add(lease).unwrap_or(started.0);
    match Duration::try_from(until.duration_since(now)) {
        Ok(left) if !left.is_zero() => Due::HeldBy(left),
        _ => Due::Now,
    }
}

/// Runs the verification of `backup` (due): claimed, run, its outcome recorded.
pub async fn run(backup: &Backup, ctx: &Context<State>, api: &Api<Backup>) -> Result<Action> {
    let state = &ctx.state;
    // One at a time on this replica (the verification server restores one artifact).
    let Ok(_permit) = state.verification.running.clone().try_acquire_owned() else {
        return Ok(Action::requeue(QUEUED));
    };
    let claimed = match write::claim_verification(backup, state, api).await? {
        Published::Stored(claimed) => claimed,
        Published::Unchanged | Published::Refused => return Ok(Action::requeue(CHANGED_UNDER_US)),
    };
    let started_at = claimed
        .status
        .as_ref()
        .and_then(|s| s.verification.as_ref())
        .and_then(|v| v.started_at.clone());
    let outcome = verify::verify(&claimed, state).await;
    tracing::info!(
        result = outcome.result.as_str(),
        reason = outcome.reason.as_str(),
        took_s = outcome.took.as_secs_f64(),
        "verification ended: {}",
        outcome.message
    );
    let recorded = write::record_verification(
        state,
        api,
        &backup.name_any(),
        started_at.as_ref(),
        &outcome,
    )
    .await?;
    if recorded.refused() {
        tracing::warn!("the verification's outcome was not recorded: another replica took it over");
        return Ok(Action::requeue(CHANGED_UNDER_US));
    }
    let metrics = &ctx.state.metrics;
    metrics.record_verification(outcome.result.as_str());
    if outcome.result == VerificationResult::Passed {
        let namespace = backup.namespace().unwrap_or_default();
        let now = jiff::Timestamp::now().as_second();
        metrics.record_verified(&namespace, &backup.spec.database_ref.name, now);
    }
    Ok(Action::await_change())
}

/// A Backup whose verification passed, seen again (at start, or any change): its
/// Database's last verification is at least that recent.
pub fn remember(backup: &Backup, status: &BackupStatus, ctx: &Context<State>) {
    let Some(v) = &status.verification else {
        return;
    };
    if v.result != VerificationResult::Passed {
        return;
    }
    if let Some(at) = &v.verified_at {
        let namespace = backup.namespace().unwrap_or_default();
        ctx.state.metrics.record_verified(
            &namespace,
            &backup.spec.database_ref.name,
            at.0.as_second(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_api::BackupVerification;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    fn backup(verify: bool) -> Backup {
        let spec =
            serde_json::from_value(json!({"databaseRef": {"name": "orders"}, "verify": verify}))
                .expect("spec");
        Backup::new("b", spec)
    }

    fn running(runner: &str, started: i64) -> BackupStatus {
        BackupStatus {
            verification: Some(BackupVerification {
                result: VerificationResult::Running,
                started_at: Some(Time(jiff::Timestamp::from_second(started).expect("time"))),
                runner: Some(runner.into()),
                ..BackupVerification::default()
            }),
            ..BackupStatus::default()
        }
    }

    #[test]
    fn a_verification_is_due_once_and_again_only_when_interrupted() {
        let t = |s| jiff::Timestamp::from_second(s).expect("time");
        let timeout = Duration::from_secs(600);
        let none = BackupStatus::default();
        assert_eq!(due(&backup(false), &none, "a", timeout, t(0)), Due::No);
        assert_eq!(due(&backup(true), &none, "a", timeout, t(0)), Due::Now);
        // Another replica's, within its timeout and margin: held.
        assert_eq!(
            due(&backup(true), &running("b", 1000), "a", timeout, t(1100)),
            Due::HeldBy(Duration::from_secs(620))
        );
        // Past them: interrupted. Ours, found on a reconcile: interrupted by a restart.
        assert_eq!(
            due(&backup(true), &running("b", 1000), "a", timeout, t(1721)),
            Due::Now
        );
        assert_eq!(
            due(&backup(true), &running("a", 1000), "a", timeout, t(1001)),
            Due::Now
        );
        let mut done = running("a", 1000);
        if let Some(v) = done.verification.as_mut() {
            v.result = VerificationResult::Failed;
        }
        assert_eq!(due(&backup(true), &done, "a", timeout, t(1001)), Due::No);
    }
}
