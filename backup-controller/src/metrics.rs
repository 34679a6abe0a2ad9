//! The backup-controller's own metrics of completed and verified Backups
//! ([`BackupMetrics`]), registered on the process's registry at its start
//! (`dbops_shared::metrics::Metrics::register`):
//!
//! - `dbops_backup_bytes_total`: bytes of completed backup artifacts;
//! - `dbops_backup_duration_seconds`: time from a Backup's start to its completion;
//! - `dbops_backup_last_success_timestamp_seconds{namespace, database}`: when the last
//!   Backup of a Database completed (Unix time);
//! - the schedule's interval and the verifications' results and ages.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
};

use dbops_shared::metrics::Registry;
use dbops_shared::register_metrics as register;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackupLabels {
    namespace: String,
    database: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerificationLabels {
    result: String,
}

/// Upper bounds (seconds) of the backup duration buckets: seconds to hours.
const BACKUP_BUCKETS: [f64; 11] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
];

/// The backup-controller's metrics of completed Backups.
#[derive(Debug, Clone)]
pub struct BackupMetrics {
    bytes: Counter,
    duration: Histogram,
    last_success: Family<BackupLabels, Gauge>,
    schedule_interval: Family<BackupLabels, Gauge>,
    last_verified: Family<BackupLabels, Gauge>,
    verification_max_age: Family<BackupLabels, Gauge>,
    verifications: Family<VerificationLabels, Counter>,
}

impl BackupMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            bytes: Counter::default(),
            duration: Histogram::new(BACKUP_BUCKETS),
            last_success: Family::default(),
            schedule_interval: Family::default(),
            last_verified: Family::default(),
            verification_max_age: Family::default(),
            verifications: Family::default(),
        };
        register! { registry;
            "backup_schedule_interval_seconds" => metrics.schedule_interval,
                "Seconds between two slots of a Database's backup schedule (Databases with spec.backup)";
            "backup" in Bytes => metrics.bytes,
                "Bytes of completed backup artifacts";
            "backup_duration" in Seconds => metrics.duration,
                "Time from a Backup's start to its completion";
            "backup_last_success_timestamp_seconds" => metrics.last_success,
                "When the last Backup of a Database completed, in seconds since the Unix epoch";
            "backup_last_verified_timestamp_seconds" => metrics.last_verified,
                "When a Backup of a Database last passed its verification (for a Database whose schedule verifies and none passed yet: when the Database was created), in seconds since the Unix epoch";
            "backup_verification_max_age_seconds" => metrics.verification_max_age,
                "How long a Database whose schedule verifies may go without a passed verification (--verification-max-age)";
            "backup_verifications" => metrics.verifications,
                "Verifications of Backups that ended, by result (Passed, Failed, Error)";
        }
        metrics
    }

    /// The interval of Database `namespace/database`'s backup schedule, for the alert on
    /// a last success older than the schedule allows.
    pub fn set_schedule_interval(&self, namespace: &str, database: &str, seconds: i64) {
        self.schedule_interval
            .get_or_create(&BackupLabels {
                namespace: namespace.to_owned(),
                database: database.to_owned(),
            })
            .set(seconds);
    }

    /// Database `namespace/database` has no schedule any more (or is being deleted): its
    /// series go.
    pub fn forget_schedule(&self, namespace: &str, database: &str) {
        let labels = BackupLabels {
            namespace: namespace.to_owned(),
            database: database.to_owned(),
        };
        self.schedule_interval.remove(&labels);
        self.last_success.remove(&labels);
        self.forget_verification(namespace, database);
    }

    /// Database `namespace/database`'s schedule verifies: its alert compares the last
    /// passed verification (at least `since_unix`, the Database's creation) with
    /// `max_age_seconds`.
    pub fn expect_verification(
        &self,
        namespace: &str,
        database: &str,
        max_age_seconds: i64,
        since_unix: i64,
    ) {
        let labels = BackupLabels {
            namespace: namespace.to_owned(),
            database: database.to_owned(),
        };
        self.verification_max_age
            .get_or_create(&labels)
            .set(max_age_seconds);
        self.record_verified(namespace, database, since_unix);
    }

    /// Database `namespace/database`'s schedule no longer verifies: its verification
    /// series go.
    pub fn forget_verification(&self, namespace: &str, database: &str) {
        let labels = BackupLabels {
            namespace: namespace.to_owned(),
            database: database.to_owned(),
        };
        self.verification_max_age.remove(&labels);
        self.last_verified.remove(&labels);
    }

    /// A Backup of Database `namespace/database` passed its verification at `at_unix`
    /// (kept only when newer than what is recorded).
    pub fn record_verified(&self, namespace: &str, database: &str, at_unix: i64) {
        let gauge = self.last_verified.get_or_create(&BackupLabels {
            namespace: namespace.to_owned(),
            database: database.to_owned(),
        });
        if gauge.get() < at_unix {
            gauge.set(at_unix);
        }
    }

    /// A verification ended with `result`.
    pub fn record_verification(&self, result: &str) {
        self.verifications
            .get_or_create(&VerificationLabels {
                result: result.to_owned(),
            })
            .inc();
    }

    /// Records a completed Backup of Database `namespace/database`: `bytes` long, taking
    /// `seconds`, completed at `completed_unix` (seconds since the epoch).
    pub fn record_completed(
        &self,
        namespace: &str,
        database: &str,
        bytes: u64,
        seconds: f64,
        completed_unix: i64,
    ) {
        self.bytes.inc_by(bytes);
        self.duration.observe(seconds);
        self.last_success
            .get_or_create(&BackupLabels {
                namespace: namespace.to_owned(),
                database: database.to_owned(),
            })
            .set(completed_unix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::metrics::Metrics;

    #[test]
    fn completed_backups_are_measured_on_the_process_registry() {
        let metrics = Metrics::new("backup-controller");
        let backups = metrics.register(BackupMetrics::register);
        backups.record_completed("ns", "orders", 1234, 2.0, 1_700_000_000);
        let text = metrics.encode().unwrap();
        assert!(text.contains("dbops_backup_bytes_total 1234"), "{text}");
        assert!(
            text.contains("dbops_backup_duration_seconds_count 1"),
            "{text}"
        );
        assert!(text.contains(
            r#"dbops_backup_last_success_timestamp_seconds{namespace="ns",database="orders"} 1700000000"#
        ), "{text}");
        let other = Metrics::new("database-controller").encode().unwrap();
        assert!(!other.contains("dbops_backup_bytes"), "{other}");
    }
}
