//! The Backup status derived from what a reconcile found or did: written only when it
//! differs from what is stored, with an Event when an attempt starts, fails or ends.

use std::time::Duration;

use dbops_api::{Backup, BackupPhase, BackupStatus, condition};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, set_condition};
use dbops_shared::controller::Context;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::error::{Failure, Result};
use crate::reconcile::State;

/// What a complete attempt produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub location: String,
    pub size_bytes: i64,
    pub checksum: String,
    pub server_version: String,
    pub completed_at: Time,
    /// The UID of the Database dumped.
    pub database_uid: String,
}

/// Where a Backup stands.
#[derive(Debug)]
pub enum Outcome<'a> {
    /// Nothing can start yet (the Database is not Ready, no dump slot is free).
    Waiting {
        reason: &'static str,
        message: String,
    },
    /// Attempt `attempt` of `of` started at `started_at`.
    Running {
        attempt: i32,
        of: i32,
        started_at: Time,
        what: String,
    },
    /// Attempt `attempt` of `of` failed; the next one starts in `retry_in`.
    Retrying {
        failure: &'a Failure,
        attempt: i32,
        of: i32,
        retry_in: Duration,
    },
    Completed(&'a Completed),
    Failed(&'a Failure),
}

pub fn now() -> Time {
    Time(jiff::Timestamp::now())
}

/// The status `outcome` asks for, from the current one.
pub fn desired(backup: &Backup, outcome: &Outcome<'_>, t: Time) -> BackupStatus {
    let mut new = backup.status.clone().unwrap_or_default();
    let generation = backup.metadata.generation;
    new.observed_generation = generation;
    let mut set = |type_, status: ConditionStatus, reason: &str, message: String| {
        set_condition(
            &mut new.conditions,
            ConditionSpec {
                type_,
                status,
                reason,
                message,
                observed_generation: generation,
            },
            t.clone(),
        );
    };
    let (phase, ready, progressing, failed): (BackupPhase, _, _, _) = match outcome {
        Outcome::Waiting { reason, message } => (
            BackupPhase::Pending,
            (ConditionStatus::False, *reason, message.clone()),
            (ConditionStatus::True, *reason, message.clone()),
            None,
        ),
        Outcome::Running {
            attempt, of, what, ..
        } => {
            let message = format!("attempt {attempt} of {of}: {what}");
            (
                BackupPhase::Running,
                (ConditionStatus::False, "Running", message.clone()),
                (ConditionStatus::True, "Running", message),
                None,
            )
        }
        Outcome::Retrying {
            failure,
            attempt,
            of,
            retry_in,
        } => (
            BackupPhase::Pending,
            (
                ConditionStatus::False,
                failure.reason,
                failure.message.clone(),
            ),
            (
                ConditionStatus::True,
                "Retrying",
                format!(
                    "attempt {attempt} of {of} failed ({}); retrying in {}s: {}",
                    failure.reason,
                    retry_in.as_secs().max(1),
                    failure.message
                ),
            ),
            None,
        ),
        Outcome::Completed(done) => (
            BackupPhase::Completed,
            (
                ConditionStatus::True,
                "Completed",
                format!(
                    "{} bytes, sha256 {}, at {}",
                    done.size_bytes, done.checksum, done.location
                ),
            ),
            (
                ConditionStatus::False,
                "Completed",
                "nothing left to do".to_string(),
            ),
            None,
        ),
        Outcome::Failed(failure) => (
            BackupPhase::Failed,
            (
                ConditionStatus::False,
                failure.reason,
                failure.message.clone(),
            ),
            (
                ConditionStatus::False,
                failure.reason,
                "no further attempt will be made".to_string(),
            ),
            Some((failure.reason, failure.message.clone())),
        ),
    };
    set(condition::READY, ready.0, ready.1, ready.2);
    set(
        condition::PROGRESSING,
        progressing.0,
        progressing.1,
        progressing.2,
    );
    match failed {
        Some((reason, message)) => set(condition::FAILED, ConditionStatus::True, reason, message),
        None => set(
            condition::FAILED,
            ConditionStatus::False,
            "NoFailure",
            "the Backup has not failed".to_string(),
        ),
    }
    new.phase = Some(phase);
    match outcome {
        Outcome::Running {
            attempt,
            started_at,
            ..
        } => {
            new.attempts = Some(*attempt);
            new.started_at = Some(started_at.clone());
            new.progress_bytes = Some(0);
        }
        Outcome::Completed(done) => {
            new.completed_at = Some(done.completed_at.clone());
            new.size_bytes = Some(done.size_bytes);
            new.progress_bytes = Some(done.size_bytes);
            new.checksum = Some(done.checksum.clone());
            new.location = Some(done.location.clone());
            new.server_version = Some(done.server_version.clone());
            new.database_uid = Some(done.database_uid.clone());
        }
        _ => {}
    }
    new
}

/// Writes the status for `outcome` if it differs from the stored one, and returns it.
/// An Event tells about attempts that start, fail or end.
pub async fn publish(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    outcome: &Outcome<'_>,
) -> Result<BackupStatus> {
    let old = backup.status.clone().unwrap_or_default();
    let new = desired(backup, outcome, now());
    if new == old {
        return Ok(new);
    }
    write(api, &backup.name_any(), &new).await?;
    let event = match outcome {
        Outcome::Waiting { .. } => None,
        Outcome::Running {
            attempt, of, what, ..
        } => Some((
            true,
            "Started",
            format!("attempt {attempt} of {of}: {what}"),
        )),
        Outcome::Retrying {
            failure,
            attempt,
            of,
            ..
        } => Some((
            false,
            failure.reason,
            format!("attempt {attempt} of {of} failed: {}", failure.message),
        )),
        Outcome::Completed(done) => Some((
            true,
            "Completed",
            format!("{} bytes at {}", done.size_bytes, done.location),
        )),
        Outcome::Failed(failure) => Some((false, failure.reason, failure.message.clone())),
    };
    if let Some((normal, reason, note)) = event {
        publish_event(ctx, backup, normal, reason, &note).await;
    }
    Ok(new)
}

/// Records that the current generation was seen, without changing anything else (for a
/// Backup that has ended).
pub async fn observe_generation(backup: &Backup, api: &Api<Backup>) -> Result<()> {
    let old = backup.status.clone().unwrap_or_default();
    let generation = backup.metadata.generation;
    let mut new = old.clone();
    new.observed_generation = generation;
    for c in &mut new.conditions {
        c.observed_generation = generation;
    }
    if new != old {
        write(api, &backup.name_any(), &new).await?;
    }
    Ok(())
}

/// Only `status.progressBytes` of a running attempt.
pub async fn progress(api: &Api<Backup>, name: &str, bytes: u64) {
    let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
    let patch = json!({"status": {"progressBytes": bytes}});
    if let Err(e) = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::debug!(error = %e, "could not report progress");
    }
}

async fn write(api: &Api<Backup>, name: &str, new: &BackupStatus) -> Result<()> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": new })),
    )
    .await?;
    Ok(())
}

/// Publishes an Event about the Backup; failures are logged, never fatal.
pub async fn publish_event(
    ctx: &Context<State>,
    backup: &Backup,
    normal: bool,
    reason: &str,
    note: &str,
) {
    dbops_shared::events::publish(&ctx.state.recorder, backup, normal, "Backup", reason, note)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::conditions::get;

    fn backup() -> Backup {
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
            "metadata": {"name": "b", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"databaseRef": {"name": "orders"}}
        }))
        .unwrap()
    }

    fn at(s: i64) -> Time {
        Time(jiff::Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn a_completed_backup_is_ready_and_a_repeat_changes_nothing() {
        let mut b = backup();
        let done = Completed {
            location: "file:///x/ns/b-u.dump".into(),
            size_bytes: 42,
            checksum: "ab".into(),
            server_version: "15.14".into(),
            completed_at: at(10),
            database_uid: "db-uid".into(),
        };
        let status = desired(&b, &Outcome::Completed(&done), at(10));
        assert_eq!(status.phase, Some(BackupPhase::Completed));
        assert_eq!(status.size_bytes, Some(42));
        assert_eq!(status.database_uid.as_deref(), Some("db-uid"));
        let ready = get(&status.conditions, condition::READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("True", "Completed")
        );
        let progressing = get(&status.conditions, condition::PROGRESSING).unwrap();
        assert_eq!(progressing.status, "False");
        b.status = Some(status.clone());
        assert_eq!(desired(&b, &Outcome::Completed(&done), at(20)), status);
    }

    #[test]
    fn a_permanent_failure_sets_failed_with_its_reason() {
        let failure = Failure::permanent("DatabaseNotFound", "Database ns/orders not found");
        let status = desired(&backup(), &Outcome::Failed(&failure), at(1));
        assert_eq!(status.phase, Some(BackupPhase::Failed));
        let failed = get(&status.conditions, condition::FAILED).unwrap();
        assert_eq!(
            (failed.status.as_str(), failed.reason.as_str()),
            ("True", "DatabaseNotFound")
        );
    }
}
