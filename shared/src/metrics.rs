//! Prometheus metrics of one controller process, all prefixed `dbops_`:
//!
//! - `dbops_reconciles_total{controller, outcome}`: finished reconciles (`success`, `error`);
//! - `dbops_reconcile_errors_total{controller, reason}`: failed reconciles by error reason;
//! - `dbops_reconcile_duration_seconds{controller}`: reconcile duration histogram.

use std::{fmt::Write, time::Instant};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder, text::encode},
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::{Registry, Unit},
};

/// Upper bounds (seconds) of the reconcile duration buckets.
const DURATION_BUCKETS: [f64; 11] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The registry of a process and the metrics of its controller.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    controller: ControllerMetrics,
}

impl Metrics {
    /// A registry prefixed `dbops` holding the metrics of `controller`.
    pub fn new(controller: &str) -> Self {
        let mut registry = Registry::with_prefix("dbops");
        let controller = ControllerMetrics::register(&mut registry, controller);
        Self {
            registry,
            controller,
        }
    }

    pub fn controller(&self) -> &ControllerMetrics {
        &self.controller
    }

    /// Everything registered, in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut body = String::new();
        encode(&mut body, &self.registry).map_err(|_| MetricsError::Encode)?;
        Ok(body)
    }
}

/// Why metrics could not be served.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("failed to encode the metrics registry")]
    Encode,
}

/// How a reconcile ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Error => "error",
        }
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    controller: String,
    outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

type HistogramFamily = Family<ControllerLabels, Histogram, fn() -> Histogram>;

/// Reconcile metrics of one controller; the `controller` label is fixed at registration.
#[derive(Debug, Clone)]
pub struct ControllerMetrics {
    controller: String,
    reconciles: Family<OutcomeLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: HistogramFamily,
}

impl ControllerMetrics {
    fn register(registry: &mut Registry, controller: &str) -> Self {
        let metrics = Self {
            controller: controller.to_owned(),
            reconciles: Family::default(),
            errors: Family::default(),
            duration: HistogramFamily::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
        };
        registry.register(
            "reconciles",
            "Finished reconciles by outcome",
            metrics.reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles by error reason",
            metrics.errors.clone(),
        );
        registry.register_with_unit(
            "reconcile_duration",
            "Duration of reconciles",
            Unit::Seconds,
            metrics.duration.clone(),
        );
        metrics
    }

    /// Starts timing a reconcile; the duration is recorded when the timer is dropped.
    pub fn reconcile_timer(&self) -> ReconcileTimer {
        let histogram = self.duration.get_or_create_owned(&ControllerLabels {
            controller: self.controller.clone(),
        });
        ReconcileTimer {
            histogram,
            start: Instant::now(),
        }
    }

    pub fn record_outcome(&self, outcome: Outcome) {
        self.reconciles
            .get_or_create(&OutcomeLabels {
                controller: self.controller.clone(),
                outcome,
            })
            .inc();
    }

    /// Counts a failed reconcile; `reason` is a short CamelCase error category.
    pub fn record_error(&self, reason: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                controller: self.controller.clone(),
                reason: reason.to_owned(),
            })
            .inc();
    }
}

/// Records the time from its creation to its drop in the reconcile duration histogram.
#[derive(Debug)]
pub struct ReconcileTimer {
    histogram: Histogram,
    start: Instant,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_are_counted_and_timed_under_the_dbops_prefix() {
        let metrics = Metrics::new("database-controller");
        {
            let _timer = metrics.controller().reconcile_timer();
            metrics.controller().record_outcome(Outcome::Success);
        }
        metrics.controller().record_outcome(Outcome::Error);
        metrics.controller().record_error("ServerUnavailable");

        let text = metrics.encode().unwrap();
        assert!(text.contains(
            r#"dbops_reconciles_total{controller="database-controller",outcome="success"} 1"#
        ));
        assert!(text.contains(
            r#"dbops_reconciles_total{controller="database-controller",outcome="error"} 1"#
        ));
        assert!(text.contains(
            r#"dbops_reconcile_errors_total{controller="database-controller",reason="ServerUnavailable"} 1"#
        ));
        assert!(text.contains(
            r#"dbops_reconcile_duration_seconds_count{controller="database-controller"} 1"#
        ));
    }
}
