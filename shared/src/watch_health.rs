//! Watches that fail without a break end the process.
//!
//! Every watch of a controller process (its main kind, the kinds it maps from, the
//! background caches) retries a failure with backoff, so one failed request is nothing to
//! act on. A watch that fails *again and again*, though, leaves a cache that no longer
//! follows the cluster: reconciles then run on stale objects (409 on every write, a
//! deletion never seen) while the process looks alive. The chaos suite saw exactly that
//! after a kube-apiserver restart (issue 12): the database-controller's leader kept failing
//! its relists with `request timed out` for minutes, and only a new process recovered.
//!
//! [`WatchHealth`] keeps, per watch, the current *streak* of failures: failures no further
//! apart than [`WatchHealth::gap`] belong to one streak, and a success ends it: an event
//! (a list, including an empty one, or a change), or a silence longer than the gap (a
//! quiet watch that works again reports nothing). Once the failures of a streak have
//! kept coming for `--watch-stall-timeout` (from its first failure to its latest), the
//! [`watchdog`] ends the process with [`crate::controller::ControllerError::WatchStalled`],
//! naming the watch, the number of failures and the last one; the Deployment (or the
//! test bed) starts a fresh process, which lists everything anew. One failure, or a few
//! within less than the timeout, followed by nothing, is a watch that recovered (issue
//! 35: one 429 while a CRD's storage started ended the controller 90 s later, when a
//! streak was measured up to now).

use std::{
    collections::HashMap,
    fmt::Display,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// kube-runtime's default watch backoff never waits longer than this between attempts.
const MAX_WATCH_BACKOFF: Duration = Duration::from_secs(30);
/// `--api-timeout`'s default.
const DEFAULT_API_TIMEOUT: Duration = Duration::from_secs(30);
static PROCESS: OnceLock<WatchHealth> = OnceLock::new();
/// How often [`watchdog`] looks.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// The failure streaks of a process's watches; clones share them.
#[derive(Clone, Debug)]
pub struct WatchHealth {
    streaks: Arc<Mutex<HashMap<String, Streak>>>,
    gap: Duration,
}

#[derive(Clone, Debug)]
struct Streak {
    first: Instant,
    last: Instant,
    failures: u64,
    last_error: String,
}

/// A watch whose failures have lasted the stall timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stall {
    pub watch: String,
    pub failing_for: Duration,
    pub failures: u64,
    pub last_error: String,
}

impl WatchHealth {
    /// `api_timeout` is the longest one request may take: a watch that keeps failing
    /// reports a failure at least every `api_timeout` plus the longest backoff, so failures
    /// further apart than twice that are two streaks.
    pub fn new(api_timeout: Duration) -> Self {
        Self {
            streaks: Arc::default(),
            gap: 2 * (api_timeout + MAX_WATCH_BACKOFF),
        }
    }

    /// The process's own, shared by every watch it runs: made by the first call of this or
    /// of [`WatchHealth::init_process`] (the runner calls that first, with `--api-timeout`).
    pub fn process() -> &'static WatchHealth {
        PROCESS.get_or_init(|| WatchHealth::new(DEFAULT_API_TIMEOUT))
    }

    /// Makes [`WatchHealth::process`] with the process's `api_timeout`; a later call, or
    /// one after the first use, changes nothing.
    pub fn init_process(api_timeout: Duration) -> &'static WatchHealth {
        PROCESS.get_or_init(|| WatchHealth::new(api_timeout))
    }

    /// Longest silence between two failures of one streak.
    pub fn gap(&self) -> Duration {
        self.gap
    }

    /// Records a failure of `watch` (logged by the caller). A `410 Expired` is none: the
    /// watcher lists anew at once, as the API intends.
    pub fn failed(&self, watch: &str, error: &kube::runtime::watcher::Error) {
        if let kube::runtime::watcher::Error::WatchError(status) = error
            && status.code == 410
        {
            return;
        }
        self.failed_at(watch, error, Instant::now());
    }

    /// Records that `watch` works again (an event arrived): its streak ends.
    pub fn succeeded(&self, watch: &str) {
        let mut streaks = self.streaks.lock().unwrap_or_else(PoisonError::into_inner);
        streaks.remove(watch);
    }

    /// [`WatchHealth::failed`] or [`WatchHealth::succeeded`] for what a watch stream
    /// yields.
    pub fn observe<T>(&self, watch: &str, event: &Result<T, kube::runtime::watcher::Error>) {
        match event {
            Ok(_) => self.succeeded(watch),
            Err(error) => self.failed(watch, error),
        }
    }

    fn failed_at(&self, watch: &str, error: &dyn Display, now: Instant) {
        let mut streaks = self.streaks.lock().unwrap_or_else(PoisonError::into_inner);
        let last_error = error.to_string();
        match streaks.get_mut(watch) {
            Some(streak) if now.saturating_duration_since(streak.last) <= self.gap => {
                streak.last = now;
                streak.failures += 1;
                streak.last_error = last_error;
            }
            _ => {
                streaks.insert(
                    watch.to_owned(),
                    Streak {
                        first: now,
                        last: now,
                        failures: 1,
                        last_error,
                    },
                );
            }
        }
    }

    /// The watch whose current streak has lasted `timeout` or longer, if any (the longest).
    pub fn stalled(&self, timeout: Duration) -> Option<Stall> {
        self.stalled_at(timeout, Instant::now())
    }

    fn stalled_at(&self, timeout: Duration, now: Instant) -> Option<Stall> {
        let streaks = self.streaks.lock().unwrap_or_else(PoisonError::into_inner);
        streaks
            .iter()
            // Still failing (a failure within the gap), and failing for the whole timeout:
            // from the first failure to the latest, not to now.
            .filter(|(_, s)| now.saturating_duration_since(s.last) <= self.gap)
            .filter(|(_, s)| s.last.saturating_duration_since(s.first) >= timeout)
            .map(|(watch, s)| Stall {
                watch: watch.clone(),
                failing_for: now.saturating_duration_since(s.first),
                failures: s.failures,
                last_error: s.last_error.clone(),
            })
            .filter(|stall| stall.failing_for >= timeout)
            .max_by_key(|stall| stall.failing_for)
    }
}

/// Returns the first stall of `health` that lasts `timeout`, looking every few seconds;
/// never returns once `stop` is cancelled (it then waits forever, so a `select!` with the
/// work it guards ends with the work).
pub async fn watchdog(health: &WatchHealth, timeout: Duration, stop: &CancellationToken) -> Stall {
    loop {
        tokio::select! {
            () = tokio::time::sleep(CHECK_EVERY) => {}
            () = stop.cancelled() => std::future::pending::<()>().await,
        }
        if let Some(stall) = health.stalled(timeout) {
            return stall;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const API_TIMEOUT: Duration = Duration::from_secs(30);

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn failures_close_together_are_one_streak_that_stalls() {
        let health = WatchHealth::new(API_TIMEOUT);
        let t0 = Instant::now();
        for n in 0..5 {
            health.failed_at("Database", &"request timed out", t0 + secs(n * 60));
        }
        let stall = health
            .stalled_at(secs(180), t0 + secs(240))
            .expect("failing for 240 s");
        assert_eq!(stall.watch, "Database");
        assert_eq!(stall.failures, 5);
        assert_eq!(stall.failing_for, secs(240));
        assert_eq!(stall.last_error, "request timed out");
        assert_eq!(health.stalled_at(secs(300), t0 + secs(240)), None);
    }

    /// Issue 35's regression test: one failure (a 429 while a CRD's storage starts), then
    /// nothing. Before the fix the streak counted up to now and stalled at the timeout,
    /// ending the process 90 s after a watch that had recovered at once.
    #[test]
    fn one_failure_then_nothing_never_stalls() {
        let health = WatchHealth::new(API_TIMEOUT);
        let t0 = Instant::now();
        health.failed_at("database-controller", &"storage is (re)initializing", t0);
        for after in [90, 95, 110, 119, 180] {
            assert_eq!(
                health.stalled_at(secs(90), t0 + secs(after)),
                None,
                "{after}"
            );
        }
        // Failures that keep coming for the timeout do stall.
        health.failed_at("database-controller", &"request timed out", t0 + secs(50));
        health.failed_at("database-controller", &"request timed out", t0 + secs(95));
        let stall = health.stalled_at(secs(90), t0 + secs(100)).unwrap();
        assert_eq!(stall.failures, 3);
    }

    #[test]
    fn a_silence_longer_than_the_gap_ends_a_streak() {
        let health = WatchHealth::new(API_TIMEOUT);
        let gap = health.gap();
        assert_eq!(gap, secs(120));
        let t0 = Instant::now();
        // A short outage long ago, then the watch works (reports nothing)...
        health.failed_at("Secret", &"connection refused", t0);
        health.failed_at("Secret", &"connection refused", t0 + secs(10));
        assert_eq!(
            health.stalled_at(secs(5), t0 + secs(10) + gap + secs(1)),
            None
        );
        // ...and a new failure starts a new streak, not one reaching back to t0.
        let later = t0 + secs(600);
        health.failed_at("Secret", &"connection refused", later);
        assert_eq!(health.stalled_at(secs(60), later + secs(30)), None);
    }

    #[test]
    fn each_watch_has_its_own_streak() {
        let health = WatchHealth::new(API_TIMEOUT);
        let t0 = Instant::now();
        health.failed_at("Namespace", &"forbidden", t0);
        for n in 0..4 {
            health.failed_at("Database", &"request timed out", t0 + secs(50 + n * 50));
        }
        // 130 s after its first failure: longer than the gap, so a streak of its own.
        health.failed_at("Namespace", &"forbidden", t0 + secs(130));
        let stall = health.stalled_at(secs(60), t0 + secs(200)).unwrap();
        // Namespace: 70 s; Database: 150 s, the longer one.
        assert_eq!(stall.watch, "Database");
        assert_eq!(stall.failing_for, secs(150));
    }

    #[test]
    fn an_expired_watch_is_no_failure_and_an_event_ends_a_streak() {
        use kube::core::Status;
        use kube::runtime::watcher::Error;
        let health = WatchHealth::new(API_TIMEOUT);
        let expired = Error::WatchError(Box::new(
            Status::failure("too old", "Expired").with_code(410),
        ));
        health.failed("Migration", &expired);
        assert!(health.streaks.lock().unwrap().is_empty());
        let refused = Error::WatchError(Box::new(
            Status::failure("storage is (re)initializing", "TooManyRequests").with_code(429),
        ));
        health.failed("Migration", &refused);
        assert_eq!(health.streaks.lock().unwrap()["Migration"].failures, 1);
        health.observe::<()>("Migration", &Ok(()));
        assert!(health.streaks.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_watchdog_returns_a_stall_and_nothing_after_stop() {
        let health = WatchHealth::new(API_TIMEOUT);
        let stop = CancellationToken::new();
        health.failed_at("Database", &"request timed out", Instant::now());
        let feeder = {
            let health = health.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(secs(40)).await;
                    health.failed_at("Database", &"request timed out", Instant::now());
                }
            })
        };
        let stall = watchdog(&health, secs(120), &stop).await;
        assert_eq!(stall.watch, "Database");
        assert!(stall.failing_for >= secs(120), "{stall:?}");
        stop.cancel();
        let after_stop = tokio::time::timeout(secs(600), watchdog(&health, secs(1), &stop)).await;
        assert!(after_stop.is_err(), "no stall is reported once stopped");
        feeder.abort();
    }
}
