//! The Backup status derived from what a reconcile found or did: written only when it
//! differs from what is stored, with an Event when an attempt starts, fails or ends.

use std::time::Duration;

use dbops_api::{Backup, BackupPhase, BackupRunner, BackupStatus, condition};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, now, set_condition};
use dbops_shared::controller::Context;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::error::{Failure, Result};
use crate::reconcile::State;
use crate::runner;

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
    /// Attempt `attempt` of `of` started at `started_at`, run by replica `runner`.
    Running {
        attempt: i32,
        of: i32,
        started_at: Time,
        what: String,
        runner: &'a str,
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
            runner,
            ..
        } => {
            new.attempts = Some(*attempt);
            new.started_at = Some(started_at.clone());
            new.progress_bytes = Some(0);
            new.runner = Some(BackupRunner {
                identity: (*runner).to_string(),
                renew_time: t.clone(),
            });
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

/// What a status write may overwrite (see [`crate::runner`]).
#[derive(Debug, Clone, Copy)]
pub enum Guard<'a> {
    /// Only the Backup as it was read (its resourceVersion): a replica that decided on an
    /// older version writes nothing.
    AsRead,
    /// Only a status that still names `identity` the runner of attempt `attempt`, read
    /// afresh; the new status is derived from that one.
    Runner { identity: &'a str, attempt: i32 },
}

/// Writes the status for `outcome` if it differs from the stored one, and returns it;
/// `None` when `guard` refused the write (another replica changed the Backup first).
/// An Event tells about attempts that start, fail or end.
pub async fn publish(
    backup: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    outcome: &Outcome<'_>,
    guard: Guard<'_>,
) -> Result<Option<BackupStatus>> {
    let new = match guard {
        Guard::AsRead => {
            let new = desired(backup, outcome, now());
            if Some(&new) == backup.status.as_ref() {
                return Ok(Some(new));
            }
            if !write_if_unchanged(api, backup, &new).await? {
                return Ok(None);
            }
            new
        }
        Guard::Runner { identity, attempt } => {
            let written = write_as_runner(api, &backup.name_any(), identity, attempt, |fresh| {
                desired(fresh, outcome, now())
            })
            .await?;
            match written {
                Written::Changed(new) => new,
                Written::Unchanged(new) => return Ok(Some(new)),
                Written::Lost => return Ok(None),
            }
        }
    };
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
    Ok(Some(new))
}

/// The runner's renewal of its hold on attempt `attempt`: `false` once the status names
/// another runner or attempt.
pub async fn renew(api: &Api<Backup>, name: &str, identity: &str, attempt: i32) -> Result<bool> {
    let written = write_as_runner(api, name, identity, attempt, |fresh| {
        let mut status = fresh.status.clone().unwrap_or_default();
        status.runner = Some(BackupRunner {
            identity: identity.to_string(),
            renew_time: now(),
        });
        status
    })
    .await?;
    Ok(!matches!(written, Written::Lost))
}

enum Written {
    Changed(BackupStatus),
    Unchanged(BackupStatus),
    Lost,
}

/// Writes `make(fresh)` while the freshly read status names `identity` the runner of
/// `attempt`; a conflict (a progress report of our own in between) reads again.
async fn write_as_runner(
    api: &Api<Backup>,
    name: &str,
    identity: &str,
    attempt: i32,
    make: impl Fn(&Backup) -> BackupStatus,
) -> Result<Written> {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let fresh = api.get_status(name).await?;
        if !runner::holds(fresh.status.as_ref(), identity, attempt) {
            return Ok(Written::Lost);
        }
        let new = make(&fresh);
        if Some(&new) == fresh.status.as_ref() {
            return Ok(Written::Unchanged(new));
        }
        if write_if_unchanged(api, &fresh, &new).await? {
            return Ok(Written::Changed(new));
        }
    }
    tracing::warn!(
        attempts = TRIES,
        "the Backup kept changing under its runner's status write; leaving it"
    );
    Ok(Written::Lost)
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
        write_if_unchanged(api, backup, &new).await?;
    }
    Ok(())
}

/// Only `status.progressBytes` of a running attempt, on the Backup `uid` only: a JSON
/// patch whose test makes the UID a precondition (a Backup deleted and created again under
/// that name while the dump runs is not written; a merge patch's `metadata.uid` is no
/// precondition on the status subresource).
pub async fn progress(api: &Api<Backup>, name: &str, uid: &str, bytes: u64) {
    let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
    let patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "add", "path": "/status/progressBytes", "value": bytes},
    ]));
    let written = match patch {
        Ok(patch) => {
            api.patch_status(name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
        }
        Err(e) => {
            tracing::debug!(error = %e, "could not build the progress patch");
            return;
        }
    };
    if let Err(e) = written {
        tracing::debug!(error = %e, "could not report progress");
    }
}

/// Writes `new` over the status of `read` unless the Backup changed since it was read
/// (the resourceVersion in a merge patch is a precondition): `false` on a conflict.
async fn write_if_unchanged(api: &Api<Backup>, read: &Backup, new: &BackupStatus) -> Result<bool> {
    let patch = json!({
        "metadata": {"resourceVersion": read.metadata.resource_version},
        "status": new,
    });
    match api
        .patch_status(
            &read.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
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
