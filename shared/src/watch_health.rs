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
//! [`WatchHealth`] keeps, per watch, the current *streak* of failures. It learns of them
//! from the client's stack ([`crate::client`]), which sees every request a watcher
//! sends: a watch start (`watch=true`) or a paged list (`limit=`) of a collection
//! belongs to the watch named by [`watch_of`] (the collection's path and selectors). An
//! answer with a 2xx status, a list or a watch that starts, ends the watch's streak,
//! whether or not any object exists (issue 35: a watch that recovered but saw no object
//! reported nothing, so a single 429 of a controller's own watch, while a CRD's storage
//! started, ended the process 90 s later); so does a 429, the server asking to come back
//! later. A timeout, a connection error or any other status (but `410 Expired`, after
//! which the watcher lists anew at once, as the API intends) is a failure; failures no
//! further apart than [`WatchHealth::gap`] belong to one streak, and a silence longer
//! than that ends one too. Once the failures of a streak have kept coming for
//! `--watch-stall-timeout` (from its first failure to its latest), the [`watchdog`] ends
//! the process with [`crate::controller::ControllerError::WatchStalled`], naming the
//! watch, the number of failures and the last one; the Deployment (or the test bed)
//! starts a fresh process, which lists everything anew.

use std::{
    collections::HashMap,
    fmt::Display,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use tokio::time::Instant;

use crate::api_path::{is_collection, is_watch};
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

    /// Records what the API server answered a request of `watch` ([`watch_of`]): a 2xx
    /// status ends its streak, and so does `429 Too Many Requests`: the server is there and
    /// asks the watch to come back later, as after a restart while the storage of a custom
    /// resource initializes (for 40 s here), and a fresh process would be told the same.
    /// `410 Expired` is nothing; any other status is a failure.
    pub fn answered(&self, watch: &str, status: http::StatusCode) {
        if status.is_success() || status == http::StatusCode::TOO_MANY_REQUESTS {
            self.succeeded(watch);
        } else if status != http::StatusCode::GONE {
            self.failed_at(watch, &status, Instant::now());
        }
    }

    /// Records a request of `watch` that got no answer (a timeout, a connection error).
    pub fn unanswered(&self, watch: &str, error: &dyn Display) {
        self.failed_at(watch, error, Instant::now());
    }

    /// Records that `watch` works again: its streak ends.
    pub fn succeeded(&self, watch: &str) {
        let mut streaks = self.streaks.lock().unwrap_or_else(PoisonError::into_inner);
        streaks.remove(watch);
    }

    /// Forgets the streaks of every watch in `namespace`: their watches were stopped.
    pub fn forget_namespace(&self, namespace: &str) {
        let infix = format!("/namespaces/{namespace}/");
        let mut streaks = self.streaks.lock().unwrap_or_else(PoisonError::into_inner);
        streaks.retain(|watch, _| !watch.contains(&infix));
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

/// The watch a request to the Kubernetes API belongs to, if it is a watcher's: a GET of a
/// collection that starts a watch (`watch=true`) or lists a page (`limit=`; reconciles
/// list without one). Named by the collection's path and its selectors, as in
/// `/api/v1/namespaces/t1/secrets labelSelector=app.kubernetes.io/managed-by=dbops`.
pub fn watch_of(method: &http::Method, uri: &http::Uri) -> Option<String> {
    if method != http::Method::GET || !is_collection(uri.path()) {
        return None;
    }
    let (mut watcher, mut selectors) = (is_watch(uri.query()), String::new());
    for (key, value) in form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes()) {
        match &*key {
            "limit" => watcher = true,
            "labelSelector" | "fieldSelector" if !value.is_empty() => {
                selectors.push_str(&format!(" {key}={value}"));
            }
            _ => {}
        }
    }
    watcher.then(|| format!("{}{selectors}", uri.path()))
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
    fn an_answer_ends_a_streak_and_an_expired_list_is_no_failure() {
        use http::StatusCode;
        let health = WatchHealth::new(API_TIMEOUT);
        let watch = "/apis/dbops.dev/v1alpha1/migrations";
        health.answered(watch, StatusCode::GONE);
        assert!(health.streaks.lock().unwrap().is_empty());
        health.answered(watch, StatusCode::SERVICE_UNAVAILABLE);
        health.unanswered(watch, &"request timed out");
        let streak = health.streaks.lock().unwrap()[watch].clone();
        assert_eq!(streak.failures, 2);
        assert_eq!(streak.last_error, "request timed out");
        // Refused for now (storage initializing): the server is there.
        health.answered(watch, StatusCode::TOO_MANY_REQUESTS);
        assert!(health.streaks.lock().unwrap().is_empty());
        // A watch that starts, or a list answered, with no object at all.
        health.unanswered(watch, &"connection refused");
        health.answered(watch, StatusCode::OK);
        assert!(health.streaks.lock().unwrap().is_empty());
    }

    #[test]
    fn a_stopped_namespace_watch_is_forgotten() {
        let health = WatchHealth::new(API_TIMEOUT);
        health.unanswered("/api/v1/namespaces/t1/secrets", &"refused");
        health.unanswered("/api/v1/namespaces/t10/secrets", &"refused");
        health.forget_namespace("t1");
        let streaks = health.streaks.lock().unwrap();
        assert_eq!(
            streaks.keys().collect::<Vec<_>>(),
            ["/api/v1/namespaces/t10/secrets"]
        );
    }

    #[test]
    fn a_watchers_requests_name_their_watch_and_no_other_request_does() {
        let of = |uri: &str| watch_of(&http::Method::GET, &uri.parse().unwrap());
        assert_eq!(
            of("/apis/dbops.dev/v1alpha1/databases?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion=12").as_deref(),
            Some("/apis/dbops.dev/v1alpha1/databases")
        );
        assert_eq!(
            of("/api/v1/namespaces/t1/secrets?&labelSelector=app.kubernetes.io%2Fmanaged-by%3Ddbops&limit=100").as_deref(),
            Some("/api/v1/namespaces/t1/secrets labelSelector=app.kubernetes.io/managed-by=dbops")
        );
        assert_eq!(
            of("/apis/rbac.authorization.k8s.io/v1/rolebindings?fieldSelector=metadata.name%3Ddbops&watch=1").as_deref(),
            Some("/apis/rbac.authorization.k8s.io/v1/rolebindings fieldSelector=metadata.name=dbops")
        );
        assert_eq!(
            of("/api/v1/namespaces?limit=500").as_deref(),
            Some("/api/v1/namespaces")
        );
        // A reconcile's list (no page), an object, a subresource, discovery, a namespace.
        assert_eq!(
            of("/apis/dbops.dev/v1alpha1/namespaces/t1/databases?"),
            None
        );
        assert_eq!(of("/api/v1/namespaces/t1/secrets/orders-connection"), None);
        assert_eq!(
            of("/apis/dbops.dev/v1alpha1/namespaces/t1/databases/a/status?limit=1"),
            None
        );
        assert_eq!(of("/apis/dbops.dev/v1alpha1?limit=1"), None);
        assert_eq!(of("/api/v1/namespaces/t1?watch=true"), None);
        assert_eq!(
            watch_of(
                &http::Method::POST,
                &"/api/v1/namespaces/t1/secrets?limit=1".parse().unwrap()
            ),
            None
        );
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
