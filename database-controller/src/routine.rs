//! Routine checks: the full check a resync asks of a Database whose status already says
//! it is converged (Ready at its generation, its connection Secret current, no rotation
//! due, no Migration). Only PostgreSQL can show drift there and nothing waits on the
//! answer, so a routine check yields to the work that something does wait on (Databases
//! not Ready yet, users, deletions):
//!
//! - it takes one of its server's session slots only if one is free now; when every slot
//!   is busy (or callers wait for one) it is put off to the next resync, and counted in
//!   `dbops_routine_checks_deferred_total`;
//! - a check put off for [`max_deferral`] waits for a slot like any other, so a Database
//!   is checked at least once per `resync + max_deferral` however busy its server is;
//! - `pg_database_size`, a walk over the database's files and most of the check's cost on
//!   the server, is read at most once per [`SIZE_EVERY`]; the checks in between report the
//!   size last read.
//!
//! Nothing here talks to the API or to PostgreSQL.

use std::time::{Duration, Instant};

use dbops_api::{Database, DatabaseStatus, condition};
use dbops_shared::conditions::is_true;
use dbops_shared::memo::Memo;

/// How long a routine check may be put off, at least: longer when the resync is. At a
/// minute, 10,000 Databases with a 10 s resync still made 49,000 forced checks while a
/// burst of creates ran (a slot each, the size read with most); five minutes is the
/// shipped resync.
const MIN_DEFERRAL: Duration = Duration::from_secs(300);

/// How often a Database's size is read at most.
pub const SIZE_EVERY: Duration = Duration::from_secs(60);

/// How long a routine check may be put off for a busy server before it waits for a slot.
pub fn max_deferral(resync: Duration) -> Duration {
    resync.max(MIN_DEFERRAL)
}

/// Whether the status (the latest written) says the Database is converged at its current
/// generation: Ready, and observed at this generation.
pub fn converged(db: &Database, latest: &DatabaseStatus) -> bool {
    latest.observed_generation.is_some()
        && latest.observed_generation == db.metadata.generation
        && is_true(&latest.conditions, condition::READY)
}

/// Per Database: since when its routine check has been put off, and its last size read.
#[derive(Default)]
pub struct Routine {
    deferred_since: Memo<Instant>,
    sizes: Memo<(i64, Instant)>,
}

impl Routine {
    /// Whether the Database's routine check may still be put off (now, with `resync`).
    pub fn may_defer(&self, uid: &str, resync: Duration) -> bool {
        !self
            .deferred_since
            .is(uid, |since| since.elapsed() >= max_deferral(resync))
    }

    /// Notes that the Database's routine check was put off (the first time only counts
    /// for [`Routine::may_defer`]).
    pub fn deferred(&self, uid: &str) {
        if !self.deferred_since.is(uid, |_| true) {
            self.deferred_since.insert(uid, Instant::now());
        }
        crate::metrics::record_routine_check_deferred();
    }

    /// The size last read, if read within [`SIZE_EVERY`]: `None` asks for a reading.
    pub fn recent_size(&self, uid: &str) -> Option<i64> {
        self.sizes
            .get(uid, |(bytes, at)| {
                (at.elapsed() < SIZE_EVERY).then_some(*bytes)
            })
            .flatten()
    }

    /// A full check of the Database ended well: no longer put off; `size`, if it read one.
    pub fn checked(&self, uid: &str, size: Option<i64>) {
        self.deferred_since.forget(uid);
        if let Some(bytes) = size {
            self.sizes.insert(uid, (bytes, Instant::now()));
        }
    }

    /// Forgets the Databases for which `live` does not hold.
    pub fn retain(&self, live: impl Fn(&str) -> bool) {
        self.deferred_since.retain(|uid, _| live(uid));
        self.sizes.retain(|uid, _| live(uid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn ready(status: &str, observed: Option<i64>) -> DatabaseStatus {
        DatabaseStatus {
            observed_generation: observed,
            conditions: vec![Condition {
                type_: condition::READY.into(),
                status: status.into(),
                reason: "Ready".into(),
                message: String::new(),
                last_transition_time: dbops_shared::conditions::now(),
                observed_generation: observed,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn only_a_database_ready_at_its_generation_is_converged() {
        let mut db: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "d", "namespace": "n", "generation": 2},
            "spec": {"serverRef": {"name": "pg-main"}}
        }))
        .expect("a Database");
        assert!(converged(&db, &ready("True", Some(2))));
        assert!(
            !converged(&db, &ready("True", Some(1))),
            "an older generation"
        );
        assert!(!converged(&db, &ready("False", Some(2))), "not Ready");
        assert!(!converged(&db, &ready("Unknown", Some(2))));
        assert!(!converged(&db, &DatabaseStatus::default()), "no status yet");
        db.metadata.generation = None;
        assert!(!converged(&db, &ready("True", None)));
    }

    #[test]
    fn a_check_is_put_off_at_most_max_deferral_after_its_first_deferral() {
        let routine = Routine::default();
        let resync = Duration::from_secs(10);
        assert_eq!(max_deferral(resync), MIN_DEFERRAL);
        assert_eq!(
            max_deferral(Duration::from_secs(300)),
            Duration::from_secs(300)
        );
        assert!(routine.may_defer("u", resync), "never put off yet");
        routine.deferred("u");
        assert!(routine.may_defer("u", resync));
        // The first deferral counts: a later one does not move it.
        routine
            .deferred_since
            .insert("u", Instant::now() - MIN_DEFERRAL);
        routine.deferred("u");
        assert!(!routine.may_defer("u", resync), "put off long enough");
        routine.checked("u", None);
        assert!(routine.may_defer("u", resync), "a check starts over");
    }

    #[test]
    fn a_size_is_reused_only_within_size_every() {
        let routine = Routine::default();
        assert_eq!(routine.recent_size("u"), None);
        routine.checked("u", Some(7));
        assert_eq!(routine.recent_size("u"), Some(7));
        routine.checked("u", None);
        assert_eq!(
            routine.recent_size("u"),
            Some(7),
            "no reading keeps the last"
        );
        routine.sizes.insert("u", (7, Instant::now() - SIZE_EVERY));
        assert_eq!(routine.recent_size("u"), None);
        routine.retain(|_| false);
        routine.checked("v", Some(1));
        routine.retain(|uid| uid == "v");
        assert_eq!(routine.recent_size("v"), Some(1));
    }
}
