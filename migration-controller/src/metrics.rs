//! The migration-controller's own saga metrics ([`MigrationMetrics`]), registered on the
//! process's registry at its start (`dbops_shared::metrics::Metrics::register`):
//!
//! - `dbops_migration_step_duration_seconds{step}`: time from a saga step's start to its
//!   success (across controller restarts, from the times in the Migration's status);
//! - `dbops_migration_rollbacks_total{failed_step}`: rollbacks started, by failed step.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
};

use dbops_shared::metrics::{Histograms, Registry};
use dbops_shared::register_metrics as register;

/// Upper bounds (seconds) of the migration step duration buckets: a step lasts from
/// milliseconds (Preflight) to an hour (CopyData of a large database).
const STEP_BUCKETS: [f64; 12] = [
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    step: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RollbackLabels {
    failed_step: String,
}

/// The migration saga's metrics.
#[derive(Debug, Clone)]
pub struct MigrationMetrics {
    step_duration: Histograms<StepLabels>,
    rollbacks: Family<RollbackLabels, Counter>,
}

impl MigrationMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            step_duration: Histograms::new_with_constructor(|| Histogram::new(STEP_BUCKETS)),
            rollbacks: Family::default(),
        };
        register! { registry;
            "migration_step_duration" in Seconds => metrics.step_duration,
                "Duration of migration saga steps, from start to success";
            "migration_rollbacks" => metrics.rollbacks,
                "Migration rollbacks started, by the step that failed";
        }
        metrics
    }

    /// Records that `step` succeeded after `seconds`.
    pub fn observe_step(&self, step: &str, seconds: f64) {
        self.step_duration
            .get_or_create(&StepLabels {
                step: step.to_owned(),
            })
            .observe(seconds);
    }

    /// Counts a rollback started because `failed_step` failed.
    pub fn record_rollback(&self, failed_step: &str) {
        self.rollbacks
            .get_or_create(&RollbackLabels {
                failed_step: failed_step.to_owned(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::metrics::Metrics;

    #[test]
    fn saga_steps_and_rollbacks_are_measured_on_the_process_registry() {
        let metrics = Metrics::new("migration-controller");
        let saga = metrics.register(MigrationMetrics::register);
        saga.observe_step("CopyData", 2.0);
        saga.record_rollback("Verify");
        let text = metrics.encode().unwrap();
        assert!(text.contains(r#"dbops_migration_step_duration_seconds_count{step="CopyData"} 1"#));
        assert!(text.contains(r#"dbops_migration_rollbacks_total{failed_step="Verify"} 1"#));
        let other = Metrics::new("database-controller").encode().unwrap();
        assert!(!other.contains("migration_step"), "{other}");
    }
}
