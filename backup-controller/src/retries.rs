//! When each Backup's failed attempt may be retried, by the Backup's UID: the backoff
//! of `status.attempts` turned into a time this process waits for. Not persisted: a
//! process that restarts retries at once (the status says Pending).
//!
//! What the watch cache may not show yet of this process's own status writes is not
//! here: the shared status path answers that ([`dbops_shared::status::StatusWriter`]).

use std::time::{Duration, Instant};

use dbops_shared::memo::Memo;

/// The time before which each Backup's failed attempt is not retried.
#[derive(Default)]
pub struct Retries {
    at: Memo<Instant>,
}

impl Retries {
    /// The failed attempt of `uid` is retried at `at`, not before.
    pub fn retry_at(&self, uid: &str, at: Instant) {
        self.at.insert(uid, at);
    }

    /// How long until the failed attempt of `uid` may be retried.
    pub fn retry_in(&self, uid: &str) -> Option<Duration> {
        self.at
            .get(uid, |at| at.checked_duration_since(Instant::now()))?
            .filter(|d| !d.is_zero())
    }

    pub fn forget(&self, uid: &str) {
        self.at.forget(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_waits_for_its_time() {
        let retries = Retries::default();
        assert_eq!(retries.retry_in("u"), None);
        retries.retry_at("u", Instant::now() + Duration::from_secs(60));
        assert!(
            retries
                .retry_in("u")
                .is_some_and(|d| d > Duration::from_secs(50))
        );
        retries.retry_at("u", Instant::now());
        assert_eq!(retries.retry_in("u"), None, "due");
        retries.forget("u");
        assert_eq!(retries.retry_in("u"), None);
    }
}
