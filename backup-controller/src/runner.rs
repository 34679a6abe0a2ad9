//! Which replica runs a Backup's attempt.
//!
//! Leader election keeps one backup-controller replica active, but a deposed leader may
//! still be finishing a dump, and replicas run without it (`--leader-elect=false`) must be
//! safe too. So the attempt itself is held like a Lease, in the Backup's status:
//!
//! - a replica starts an attempt only by a status write conditioned on the
//!   resourceVersion it read (two replicas that saw the same Pending Backup cannot both
//!   start it: one gets a conflict), and that write names it `status.runner` with a
//!   `renewTime`;
//! - while the dump runs the runner renews every [`RENEW_EVERY`], and every write it makes
//!   about the attempt (renewals, the outcome) is conditioned on the status still naming
//!   it as the runner of that attempt; a runner that finds otherwise stops its dump and
//!   writes nothing;
//! - a Backup found `Running` is started over by another replica only once its runner
//!   has not renewed for [`LEASE`], or at once when the runner is this replica itself
//!   (the same `$POD_NAME`: a container restarted in its pod, whose old process is gone).

use std::time::Duration;

use dbops_api::{BackupRunner, BackupStatus};

/// How long a runner's renewal holds the attempt against other replicas.
pub const LEASE: Duration = Duration::from_secs(30);
/// How often a runner renews: three renewals fit in one lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(10);

/// What a replica may do with a Backup whose status says `Running`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Running {
    /// The attempt was interrupted (its runner is this replica restarted, is unknown, or
    /// stopped renewing): start it over.
    Interrupted,
    /// Another replica holds it: look again after this long.
    HeldBy { identity: String, for_: Duration },
}

/// Who holds a `Running` attempt, seen by replica `me` at `now`.
pub fn running(status: &BackupStatus, me: &str, now: jiff::Timestamp) -> Running {
    let Some(BackupRunner {
        identity,
        renew_time,
    }) = status.runner.as_ref()
    else {
        return Running::Interrupted;
    };
    if identity == me {
        return Running::Interrupted;
    }
    let held_until = renew_time
        .0
        .checked_add(jiff::SignedDuration::try_from(LEASE).unwrap_or_default())
        .unwrap_or(renew_time.0);
    match Duration::try_from(held_until.duration_since(now)) {
        Ok(left) if !left.is_zero() => Running::HeldBy {
            identity: identity.clone(),
            for_: left,
        },
        _ => Running::Interrupted,
    }
}

/// Whether `status` still names `identity` as the runner of attempt `attempt`.
pub fn holds(status: Option<&BackupStatus>, identity: &str, attempt: i32) -> bool {
    status.is_some_and(|s| {
        s.attempts == Some(attempt) && s.runner.as_ref().is_some_and(|r| r.identity == identity)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn at(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(s).unwrap()
    }

    fn held_by(identity: &str, renewed: i64, attempts: i32) -> BackupStatus {
        BackupStatus {
            attempts: Some(attempts),
            runner: Some(BackupRunner {
                identity: identity.into(),
                renew_time: Time(at(renewed)),
            }),
            ..BackupStatus::default()
        }
    }

    #[test]
    fn a_live_runner_holds_its_attempt_until_its_lease_runs_out() {
        let status = held_by("pod-a", 1000, 1);
        assert_eq!(
            running(&status, "pod-b", at(1010)),
            Running::HeldBy {
                identity: "pod-a".into(),
                for_: Duration::from_secs(20)
            }
        );
        assert_eq!(running(&status, "pod-b", at(1030)), Running::Interrupted);
        assert_eq!(running(&status, "pod-b", at(1100)), Running::Interrupted);
    }

    #[test]
    fn the_runner_restarted_or_unknown_starts_over_at_once() {
        assert_eq!(
            running(&held_by("pod-a", 1000, 1), "pod-a", at(1001)),
            Running::Interrupted
        );
        assert_eq!(
            running(&BackupStatus::default(), "pod-a", at(1001)),
            Running::Interrupted
        );
    }

    #[test]
    fn only_the_named_runner_of_that_attempt_holds_it() {
        let status = held_by("pod-a", 1000, 2);
        assert!(holds(Some(&status), "pod-a", 2));
        assert!(!holds(Some(&status), "pod-a", 1));
        assert!(!holds(Some(&status), "pod-b", 2));
        assert!(!holds(Some(&BackupStatus::default()), "pod-a", 2));
        assert!(!holds(None, "pod-a", 2));
    }
}
