//! The Backup status derived from where a Backup stands, and the Event that tells about
//! it: the Backup's pure `desired` of the shared status path ([`dbops_shared::status`]);
//! no API call (the writes are [`crate::write`]'s).

use std::time::Duration;

use dbops_api::reasons::BackupReason;
use dbops_api::{
    Backup, BackupEncryption, BackupPhase, BackupRunner, BackupStatus, BackupVerification,
    VerificationResult, condition,
};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, set_condition};
use dbops_shared::status::{Desired, Note};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::error::Failure;

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
    /// The recipients the artifact is encrypted to (`--backup-recipients-secret`), if
    /// it is.
    pub encrypted_to: Option<Vec<String>>,
}

/// What a verification found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub result: VerificationResult,
    pub reason: BackupReason,
    pub message: String,
    /// The server it ran on, when one was chosen.
    pub server: Option<String>,
    pub tables: Option<i64>,
    pub rows: Option<i64>,
    pub took: Duration,
}

/// Where a Backup stands: what one status write reports.
#[derive(Debug)]
pub enum Standing<'a> {
    /// Nothing can start yet (the Database is not Ready, no dump slot is free).
    Waiting {
        reason: BackupReason,
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

/// One condition as `standing` asks for it: status, reason, message.
type Wanted = (ConditionStatus, BackupReason, String);

/// The phase and the Ready, Progressing and Failed conditions of a standing.
struct Conditions {
    phase: BackupPhase,
    ready: Wanted,
    progressing: Wanted,
    failed: Wanted,
}

/// The status `standing` asks for, from `current` (the latest status of `backup`: see
/// [`dbops_shared::status::StatusWriter::latest`]), and the Event its write tells.
pub fn desired(
    backup: &Backup,
    current: &BackupStatus,
    standing: &Standing<'_>,
    t: Time,
) -> Desired<BackupStatus> {
    let mut new = current.clone();
    let generation = backup.metadata.generation;
    new.observed_generation = generation;
    let Conditions {
        phase,
        ready,
        progressing,
        failed,
    } = conditions(standing);
    for (type_, (status, reason, message)) in [
        (condition::READY, ready),
        (condition::PROGRESSING, progressing),
        (condition::FAILED, failed),
    ] {
        let spec = ConditionSpec {
            type_,
            status,
            reason: reason.as_str(),
            message,
            observed_generation: generation,
        };
        set_condition(&mut new.conditions, spec, t.clone());
    }
    new.phase = Some(phase);
    record(&mut new, standing, t);
    match note(standing) {
        Some(note) => Desired::new(new).with(note),
        None => Desired::new(new),
    }
}

/// The phase and conditions of `standing`.
fn conditions(standing: &Standing<'_>) -> Conditions {
    use ConditionStatus::{False, True};
    let not_failed = (
        False,
        BackupReason::NoFailure,
        "the Backup has not failed".to_string(),
    );
    match standing {
        Standing::Waiting { reason, message } => Conditions {
            phase: BackupPhase::Pending,
            ready: (False, *reason, message.clone()),
            progressing: (True, *reason, message.clone()),
            failed: not_failed,
        },
        Standing::Running {
            attempt, of, what, ..
        } => {
            let message = format!("attempt {attempt} of {of}: {what}");
            Conditions {
                phase: BackupPhase::Running,
                ready: (False, BackupReason::Running, message.clone()),
                progressing: (True, BackupReason::Running, message),
                failed: not_failed,
            }
        }
        Standing::Retrying {
            failure,
            attempt,
            of,
            retry_in,
        } => Conditions {
            phase: BackupPhase::Pending,
            ready: (False, failure.reason, failure.message.clone()),
            progressing: (
                True,
                BackupReason::Retrying,
                format!(
                    "attempt {attempt} of {of} failed ({}); retrying in {}s: {}",
                    failure.reason,
                    retry_in.as_secs().max(1),
                    failure.message
                ),
            ),
            failed: not_failed,
        },
        Standing::Completed(done) => Conditions {
            phase: BackupPhase::Completed,
            ready: (True, BackupReason::Completed, completed_message(done)),
            progressing: (
                False,
                BackupReason::Completed,
                "nothing left to do".to_string(),
            ),
            failed: not_failed,
        },
        Standing::Failed(failure) => Conditions {
            phase: BackupPhase::Failed,
            ready: (False, failure.reason, failure.message.clone()),
            progressing: (
                False,
                failure.reason,
                "no further attempt will be made".to_string(),
            ),
            failed: (True, failure.reason, failure.message.clone()),
        },
    }
}

/// What Ready says of a completed Backup.
fn completed_message(done: &Completed) -> String {
    let encrypted = match done.encrypted_to {
        Some(_) => " encrypted (age)",
        None => "",
    };
    format!(
        "{} bytes{encrypted}, sha256 {}, at {}",
        done.size_bytes, done.checksum, done.location
    )
}

/// The fields besides the conditions: the attempt and its runner when one starts, the
/// artifact when it is complete.
fn record(new: &mut BackupStatus, standing: &Standing<'_>, t: Time) {
    match standing {
        Standing::Running {
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
                renew_time: t,
            });
        }
        Standing::Completed(done) => {
            new.completed_at = Some(done.completed_at.clone());
            new.size_bytes = Some(done.size_bytes);
            new.progress_bytes = Some(done.size_bytes);
            new.checksum = Some(done.checksum.clone());
            new.location = Some(done.location.clone());
            new.server_version = Some(done.server_version.clone());
            new.database_uid = Some(done.database_uid.clone());
            new.encryption = done.encrypted_to.as_ref().map(|to| BackupEncryption {
                format: dbops_shared::sealing::FORMAT.to_string(),
                recipients: to.clone(),
            });
        }
        _ => {}
    }
}

/// What the Events about a verification say they were doing.
pub const VERIFY_ACTION: &str = "Verify";

/// The status of a verification that starts now, run by replica `runner`: `Verified`
/// Unknown (`Verifying`), and `verification` Running.
pub fn verifying(
    backup: &Backup,
    current: &BackupStatus,
    runner: &str,
    server: Option<&str>,
    t: Time,
) -> Desired<BackupStatus> {
    let mut new = current.clone();
    let message = match server {
        Some(server) => {
            format!("restoring the artifact on DatabaseServer {server} and checking it")
        }
        None => "checking the artifact".to_string(),
    };
    set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::VERIFIED,
            status: ConditionStatus::Unknown,
            reason: BackupReason::Verifying.as_str(),
            message,
            observed_generation: backup.metadata.generation,
        },
        t.clone(),
    );
    new.verification = Some(BackupVerification {
        result: VerificationResult::Running,
        started_at: Some(t),
        server: server.map(str::to_owned),
        runner: Some(runner.to_string()),
        ..BackupVerification::default()
    });
    Desired::new(new)
}

/// The status of a verification that ended with `outcome`, and its Event (a Warning
/// unless it passed).
pub fn verified(
    backup: &Backup,
    current: &BackupStatus,
    outcome: &Outcome,
    t: Time,
) -> Desired<BackupStatus> {
    let mut new = current.clone();
    let status = match outcome.result {
        VerificationResult::Passed => ConditionStatus::True,
        VerificationResult::Failed => ConditionStatus::False,
        _ => ConditionStatus::Unknown,
    };
    set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::VERIFIED,
            status,
            reason: outcome.reason.as_str(),
            message: outcome.message.clone(),
            observed_generation: backup.metadata.generation,
        },
        t.clone(),
    );
    let started_at = current
        .verification
        .as_ref()
        .and_then(|v| v.started_at.clone());
    new.verification = Some(BackupVerification {
        result: outcome.result,
        started_at,
        verified_at: Some(t),
        server: outcome.server.clone(),
        tables: outcome.tables,
        rows: outcome.rows,
        duration: Some(format!("{:.1}s", outcome.took.as_secs_f64())),
        runner: None,
    });
    let note = match outcome.result {
        VerificationResult::Passed => {
            Note::normal(VERIFY_ACTION, "Verified", outcome.message.clone())
        }
        _ => Note::warning(
            VERIFY_ACTION,
            outcome.reason.as_str(),
            outcome.message.clone(),
        ),
    };
    Desired::new(new).with(note)
}

/// What the Events about a Backup say they were doing.
pub const ACTION: &str = "Backup";

/// The Event that tells about `standing` once its status is written: attempts that
/// start, fail or end; none while waiting.
fn note(standing: &Standing<'_>) -> Option<Note> {
    match standing {
        Standing::Waiting { .. } => None,
        Standing::Running {
            attempt, of, what, ..
        } => Some(Note::normal(
            ACTION,
            "Started",
            format!("attempt {attempt} of {of}: {what}"),
        )),
        Standing::Retrying {
            failure,
            attempt,
            of,
            ..
        } => Some(Note::warning(
            ACTION,
            failure.reason.as_str(),
            format!("attempt {attempt} of {of} failed: {}", failure.message),
        )),
        Standing::Completed(done) => Some(Note::normal(
            ACTION,
            "Completed",
            format!("{} bytes at {}", done.size_bytes, done.location),
        )),
        Standing::Failed(failure) => Some(Note::warning(
            ACTION,
            failure.reason.as_str(),
            failure.message.clone(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::conditions::get;
    use serde_json::json;

    fn backup() -> Backup {
        let spec = serde_json::from_value(json!({"databaseRef": {"name": "orders"}})).unwrap();
        let mut b = Backup::new("b", spec);
        b.metadata.namespace = Some("ns".into());
        b.metadata.uid = Some("u".into());
        b.metadata.generation = Some(1);
        b
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
            encrypted_to: None,
        };
        let completed = desired(
            &b,
            &BackupStatus::default(),
            &Standing::Completed(&done),
            at(10),
        );
        assert_eq!(completed.notes.len(), 1, "one Event");
        let status = completed.status;
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
        let again = desired(&b, &status, &Standing::Completed(&done), at(20));
        assert_eq!(again.status, status);
    }

    #[test]
    fn a_permanent_failure_sets_failed_with_its_reason() {
        let failure = Failure::new(
            BackupReason::DatabaseNotFound,
            "Database ns/orders not found",
        );
        let failed = desired(
            &backup(),
            &BackupStatus::default(),
            &Standing::Failed(&failure),
            at(1),
        );
        assert!(!failed.notes[0].normal, "a Warning Event");
        let status = failed.status;
        assert_eq!(status.phase, Some(BackupPhase::Failed));
        let failed = get(&status.conditions, condition::FAILED).unwrap();
        assert_eq!(
            (failed.status.as_str(), failed.reason.as_str()),
            ("True", "DatabaseNotFound")
        );
    }
}
