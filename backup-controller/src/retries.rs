//! What this process wrote about each Backup's attempts, by the Backup's UID: this
//! controller's answer to "the watch cache may be older than my own write", and the
//! time before which a failed attempt is not retried. Nothing here is persisted: the
//! status itself (`attempts`, `phase`, `runner`) is what another process decides on.

use std::time::{Duration, Instant};

use dbops_api::{BackupPhase, BackupStatus};
use dbops_shared::memo::Memo;

/// What this process wrote about each Backup's attempts: tells a status from the watch
/// cache that lags behind our own write (ignored) from an attempt left Running by another
/// process (repeated), and holds the time before which a failed attempt is not retried.
#[derive(Default)]
pub struct Attempts {
    last: Memo<LastAttempt>,
}

/// The attempt and phase of this process's last status write about one Backup.
#[derive(Clone, Copy, Debug)]
struct LastAttempt {
    attempt: i32,
    phase: BackupPhase,
    retry_at: Option<Instant>,
}

impl Attempts {
    /// Remembers that this process wrote `phase` for attempt `attempt`, and when a failed
    /// one may be retried.
    pub fn wrote(&self, uid: &str, attempt: i32, phase: BackupPhase, retry_at: Option<Instant>) {
        self.last.insert(
            uid,
            LastAttempt {
                attempt,
                phase,
                retry_at,
            },
        );
    }

    /// Whether `status` is older than what this process last wrote.
    pub fn is_stale(&self, uid: &str, status: &BackupStatus) -> bool {
        let seen = status.attempts.unwrap_or(0);
        self.last.is(uid, |w| {
            seen < w.attempt || (seen == w.attempt && status.phase != Some(w.phase))
        })
    }

    /// How long until the failed attempt of `uid` may be retried.
    pub fn retry_in(&self, uid: &str) -> Option<Duration> {
        self.last
            .get(uid, |w| w.retry_at)??
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    pub fn forget(&self, uid: &str) {
        self.last.forget(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(attempts: i32, phase: BackupPhase) -> BackupStatus {
        BackupStatus {
            attempts: Some(attempts),
            phase: Some(phase),
            ..BackupStatus::default()
        }
    }

    #[test]
    fn a_lagging_cache_is_told_from_an_interrupted_attempt() {
        let attempts = Attempts::default();
        // Another process's attempt left Running: not ours, so not stale.
        assert!(!attempts.is_stale("u", &status(1, BackupPhase::Running)));
        attempts.wrote("u", 2, BackupPhase::Completed, None);
        assert!(attempts.is_stale("u", &status(2, BackupPhase::Running)));
        assert!(attempts.is_stale("u", &status(1, BackupPhase::Pending)));
        assert!(!attempts.is_stale("u", &status(2, BackupPhase::Completed)));
    }
}
