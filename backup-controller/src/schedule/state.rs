//! The scheduler's own state: the store of scheduled Backups, its Event recorder, and
//! the invalid specs already reported.

use std::collections::HashMap;
use std::sync::Mutex;

use dbops_api::Backup;
use dbops_shared::events::Recorder;
use kube::runtime::reflector::Store;

use crate::metrics::BackupMetrics;

/// The scheduler's own state.
pub struct State {
    /// The Backups that carry the label [`SCHEDULE_OF`](dbops_api::names::label::SCHEDULE_OF), from a reflector.
    pub backups: Store<Backup>,
    pub recorder: Recorder,
    /// `--verification-max-age`: for the metric of Databases whose schedule verifies.
    pub verification_max_age: std::time::Duration,
    /// The controller's own metrics (schedule intervals, verification ages).
    pub metrics: BackupMetrics,
    /// The generation of each Database (by UID) whose invalid spec was already reported.
    warned: Mutex<HashMap<String, Option<i64>>>,
}

impl State {
    pub fn new(backups: Store<Backup>, recorder: Recorder, metrics: BackupMetrics) -> Self {
        Self {
            backups,
            recorder,
            metrics,
            verification_max_age: std::time::Duration::from_secs(8 * 24 * 3600),
            warned: Mutex::new(HashMap::new()),
        }
    }

    /// Whether the invalid spec of this generation is reported for the first time.
    pub fn first_warning(&self, uid: &str, generation: Option<i64>) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        warned.insert(uid.to_string(), generation) != Some(generation)
    }

    pub fn valid_again(&self, uid: &str) {
        let mut warned = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        warned.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::CONTROLLER;
    use kube::runtime::reflector;

    #[tokio::test]
    async fn an_invalid_spec_is_reported_once_per_generation() {
        let (store, _writer) = reflector::store::<Backup>();
        let (service, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let client = kube::Client::new(service, "default");
        let reporter = dbops_shared::controller::reporter(CONTROLLER);
        let metrics = dbops_shared::metrics::Metrics::new(CONTROLLER);
        let metrics = metrics.register(BackupMetrics::register);
        let state = State::new(store, Recorder::new(client, reporter), metrics);
        assert!(state.first_warning("u", Some(1)));
        assert!(!state.first_warning("u", Some(1)));
        assert!(state.first_warning("u", Some(2)));
        state.valid_again("u");
        assert!(state.first_warning("u", Some(2)));
    }
}
