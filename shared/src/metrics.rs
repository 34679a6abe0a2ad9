//! Prometheus metrics of one controller process, all prefixed `dbops_`:
//!
//! - `dbops_reconciles_total{controller, outcome}`: finished reconciles (`success`, `error`);
//! - `dbops_reconcile_errors_total{controller, reason}`: failed reconciles by error reason;
//! - `dbops_reconcile_duration_seconds{controller}`: reconcile duration histogram;
//! - `dbops_resources{controller, kind, condition, status}`: the objects in the
//!   controller's watch store by condition, counted at scrape time;
//! - `dbops_external_requests_total{target, outcome}`: requests to the Kubernetes API
//!   (`kubernetes`: one per HTTP request; outcome `ok`, `client_error`, `server_error`,
//!   `error` when no answer came), PostgreSQL (`postgres`: one per connection and per
//!   statement; `ok`, `error`) and the backup store (`store`: one per operation; `ok`,
//!   `error`);
//! - `dbops_kubernetes_requests_total{verb, resource}`: requests to the Kubernetes API by
//!   verb (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`) and resource
//!   (`databases/status`, `secrets`, `events`): where the API requests per object go;
//! - `dbops_external_request_duration_seconds{target}`: how long each Kubernetes and
//!   PostgreSQL request took, from sending it to its answer (Kubernetes watches left out:
//!   they stay open);
//! - `dbops_queue_wait_seconds{queue}`: how long a request waited before it could be sent:
//!   for a token of `--api-rate-limit` (`api_rate_limit`) or for one of a server's
//!   `--max-sessions-per-server` session slots (`postgres_session`);
//! - `dbops_postgres_session_held_seconds`: how long each session slot was held, from
//!   the slot's grant to the session's return (against the statements' own time in
//!   `dbops_external_request_duration_seconds{target="postgres"}`, what a slot is held
//!   for besides SQL);
//!
//! Each controller registers the families only it has on the same registry, with
//! [`Metrics::register`] and [`register_metrics!`](crate::register_metrics), in its own
//! crate (its `metrics.rs`): the database-controller its Databases' sizes and deferred
//! routine checks, the backup-controller its Backups' bytes, durations and
//! verifications, the migration-controller its saga steps and rollbacks. Nothing here
//! picks families by the controller's name.

use std::{
    collections::BTreeMap,
    fmt::Write,
    sync::{Arc, Mutex, PoisonError},
    time::Instant,
};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
};

/// Upper bounds (seconds) of the reconcile duration buckets.
const DURATION_BUCKETS: [f64; 11] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Registers metric families on a registry, each `"name" [in Unit] => family, "help";`
/// (the unit, `Seconds` or `Bytes`, becomes the name's suffix). The registry keeps a clone
/// of each family: a handle on the same series.
#[macro_export]
macro_rules! register_metrics {
    ($registry:expr; $($name:literal $(in $unit:ident)? => $metric:expr, $help:literal;)*) => {
        $($crate::register_metrics!(@one $registry, $name, $help, $metric $(, $unit)?);)*
    };
    (@one $registry:expr, $name:literal, $help:literal, $metric:expr) => {
        $registry.register($name, $help, $metric.clone())
    };
    (@one $registry:expr, $name:literal, $help:literal, $metric:expr, $unit:ident) => {
        $registry.register_with_unit($name, $help, $crate::metrics::Unit::$unit, $metric.clone())
    };
}

use crate::register_metrics as register;

mod families;
mod requests;

pub use families::Histograms;
pub use prometheus_client::registry::{Registry, Unit};
pub use requests::*;

/// The registry of a process and the metrics of its controller.
#[derive(Debug)]
pub struct Metrics {
    /// Locked to register a controller's own families and for each scrape.
    registry: Arc<Mutex<Registry>>,
    controller: ControllerMetrics,
    resources: Arc<Resources>,
}

impl Metrics {
    /// A registry prefixed `dbops` holding the metrics every controller has, labelled
    /// `controller`.
    pub fn new(controller: &str) -> Self {
        let mut registry = Registry::with_prefix("dbops");
        let controller = ControllerMetrics::register(&mut registry, controller);
        let resources = Arc::new(Resources::default());
        register! { registry;
            "resources" => resources.gauge,
                "Objects in the controller's watch store by condition type and status";
        }
        register! { registry;
            "external_requests" => EXTERNAL_REQUESTS,
                "Requests to the Kubernetes API, PostgreSQL and the backup store, by outcome";
            "kubernetes_requests" => KUBERNETES_REQUESTS,
                "Requests to the Kubernetes API by verb and resource";
            "external_request_duration" in Seconds => EXTERNAL_DURATION,
                "Duration of requests to the Kubernetes API (watches left out), PostgreSQL and the backup store";
            "queue_wait" in Seconds => QUEUE_WAIT,
                "Time a request waited for the API rate limit or for a PostgreSQL session slot";
            "postgres_session_held" in Seconds => SESSION_HELD,
                "Time a PostgreSQL session slot was held, from its grant to the session's return";
        }
        Self {
            registry: Arc::new(Mutex::new(registry)),
            controller,
            resources,
        }
    }

    /// Registers the families only this controller has, with `families` (its crate's
    /// `metrics::register`), and hands back what it returns: the handles the controller
    /// records through. Called at the process's start, so `/metrics` shows them from the
    /// first scrape, on every replica.
    pub fn register<T>(&self, families: impl FnOnce(&mut Registry) -> T) -> T {
        families(&mut self.registry.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The same registry and metric families, labelled `controller`: for a second
    /// controller in the same process (its series appear in the same `/metrics`).
    pub fn for_controller(&self, controller: &str) -> Self {
        Self {
            registry: self.registry.clone(),
            controller: ControllerMetrics {
                controller: controller.to_owned(),
                ..self.controller.clone()
            },
            resources: self.resources.clone(),
        }
    }

    /// Counts, at each scrape, the objects `conditions` lists (one `(type, status)` per
    /// condition of each object) under this controller's label and `kind`.
    pub fn count_resources(
        &self,
        kind: &str,
        conditions: impl Fn() -> Vec<(String, String)> + Send + Sync + 'static,
    ) {
        let source = ResourceSource {
            controller: self.controller.controller.clone(),
            kind: kind.to_owned(),
            conditions: Box::new(conditions),
        };
        self.resources
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(source);
    }

    pub fn controller(&self) -> &ControllerMetrics {
        &self.controller
    }

    /// Everything registered, in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, MetricsError> {
        // One scrape at a time, so the resource counts are never half refreshed.
        let sources = self
            .resources
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.resources.refresh(&sources);
        self.controller.in_flight.refresh();
        let mut body = String::new();
        let registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        encode(&mut body, &registry).map_err(|_| MetricsError::Encode)?;
        drop(registry);
        drop(sources);
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

/// Reconcile metrics of one controller; the `controller` label is fixed at registration.
#[derive(Debug, Clone)]
pub struct ControllerMetrics {
    controller: String,
    reconciles: Family<OutcomeLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: Histograms<ControllerLabels>,
    in_flight: Arc<InFlight>,
}

/// The reconciles running now, for `dbops_reconcile_oldest_in_flight_seconds`: a reconcile
/// stuck on something without a bound shows as a growing age long before it ends.
#[derive(Debug, Default)]
struct InFlight {
    next: std::sync::atomic::AtomicU64,
    running: Mutex<std::collections::HashMap<u64, (String, Instant)>>,
    gauge: Family<ControllerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    known: Mutex<std::collections::BTreeSet<String>>,
}

impl InFlight {
    fn start(&self, controller: &str) -> u64 {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, (controller.to_owned(), Instant::now()));
        // The series exists (at 0) from the first reconcile on.
        self.known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(controller.to_owned());
        id
    }

    fn end(&self, id: u64) {
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }

    /// Sets each controller's gauge to the age of its oldest running reconcile (0: none).
    fn refresh(&self) {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let mut oldest: BTreeMap<&str, f64> = BTreeMap::new();
        for (controller, started) in running.values() {
            let age = started.elapsed().as_secs_f64();
            let entry = oldest.entry(controller.as_str()).or_default();
            *entry = entry.max(age);
        }
        // Every controller seen so far: 0 unless one of its reconciles runs.
        let known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        for controller in known.iter() {
            let age = oldest.get(controller.as_str()).copied().unwrap_or(0.0);
            self.gauge
                .get_or_create(&ControllerLabels {
                    controller: controller.clone(),
                })
                .set(age);
        }
    }
}

impl ControllerMetrics {
    fn register(registry: &mut Registry, controller: &str) -> Self {
        let metrics = Self {
            controller: controller.to_owned(),
            reconciles: Family::default(),
            errors: Family::default(),
            duration: Histograms::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
            in_flight: Arc::new(InFlight::default()),
        };
        register! { registry;
            "reconcile_oldest_in_flight" in Seconds => metrics.in_flight.gauge,
                "Age of the oldest reconcile running now (0 when none runs)";
            "reconciles" => metrics.reconciles,
                "Finished reconciles by outcome";
            "reconcile_errors" => metrics.errors,
                "Failed reconciles by error reason";
            "reconcile_duration" in Seconds => metrics.duration,
                "Duration of reconciles";
        }
        metrics
    }

    /// Starts timing a reconcile; the duration is recorded when the timer is dropped.
    pub fn reconcile_timer(&self) -> ReconcileTimer {
        let histogram = self.duration.get_or_create_owned(&ControllerLabels {
            controller: self.controller.clone(),
        });
        let id = self.in_flight.start(&self.controller);
        ReconcileTimer {
            histogram,
            start: Instant::now(),
            in_flight: self.in_flight.clone(),
            id,
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
    in_flight: Arc<InFlight>,
    id: u64,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
        self.in_flight.end(self.id);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    controller: String,
    kind: String,
    condition: String,
    status: String,
}

/// What one controller counts into `dbops_resources` at each scrape.
struct ResourceSource {
    controller: String,
    kind: String,
    conditions: Box<dyn Fn() -> Vec<(String, String)> + Send + Sync>,
}

/// The `dbops_resources` gauge and the watch stores it is computed from.
#[derive(Default)]
struct Resources {
    gauge: Family<ResourceLabels, Gauge>,
    sources: Mutex<Vec<ResourceSource>>,
}

impl std::fmt::Debug for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resources").finish_non_exhaustive()
    }
}

impl Resources {
    /// Sets the gauge to what the sources hold now; series of vanished conditions go.
    fn refresh(&self, sources: &[ResourceSource]) {
        let mut counts: BTreeMap<(&str, &str, String, String), i64> = BTreeMap::new();
        for source in sources {
            for (condition, status) in (source.conditions)() {
                *counts
                    .entry((&source.controller, &source.kind, condition, status))
                    .or_default() += 1;
            }
        }
        self.gauge.clear();
        for ((controller, kind, condition, status), count) in counts {
            self.gauge
                .get_or_create(&ResourceLabels {
                    controller: controller.to_owned(),
                    kind: kind.to_owned(),
                    condition,
                    status,
                })
                .set(count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_reconcile_in_flight_shows_its_age_and_zero_once_done() {
        let metrics = Metrics::new("database-controller");
        let companion = metrics.for_controller("server-controller");
        let value = |body: &str, controller: &str| -> f64 {
            let prefix =
                format!("dbops_reconcile_oldest_in_flight_seconds{{controller=\"{controller}\"}} ");
            body.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no series for {controller} in:\n{body}"))
        };
        let old = metrics.controller().reconcile_timer();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let _young = metrics.controller().reconcile_timer();
        let other = companion.controller().reconcile_timer();
        drop(other);
        let body = metrics.encode().unwrap();
        assert!(value(&body, "database-controller") >= 0.03, "{body}");
        assert_eq!(value(&body, "server-controller"), 0.0, "{body}");
        drop(old);
        let body = metrics.encode().unwrap();
        assert!(value(&body, "database-controller") < 0.03, "{body}");
    }

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

    #[test]
    fn a_second_controller_shares_the_registry_under_its_own_label() {
        let metrics = Metrics::new("backup-controller");
        let scheduler = metrics.for_controller("backup-scheduler");
        scheduler.controller().record_outcome(Outcome::Success);
        let text = metrics.encode().unwrap();
        assert!(text.contains(
            r#"dbops_reconciles_total{controller="backup-scheduler",outcome="success"} 1"#
        ));
        assert_eq!(text.matches("# TYPE dbops_reconciles counter").count(), 1);
    }

    #[test]
    fn a_controllers_own_families_are_registered_by_it_on_the_same_registry() {
        let metrics = Metrics::new("some-controller");
        let own: Counter = metrics.register(|registry| {
            let own = Counter::default();
            register! { registry;
                "own_things" => own, "Things only this controller counts";
            }
            own
        });
        own.inc();
        let text = metrics.encode().unwrap();
        assert!(text.contains("dbops_own_things_total 1"), "{text}");
        assert!(
            !Metrics::new("another")
                .encode()
                .unwrap()
                .contains("own_things")
        );
    }

    #[test]
    fn resources_are_counted_by_condition_at_scrape_time() {
        let metrics = Metrics::new("database-controller");
        let objects = Arc::new(Mutex::new(vec![("Ready", "True"), ("Ready", "True")]));
        let source = objects.clone();
        metrics.count_resources("Database", move || {
            source
                .lock()
                .unwrap()
                .iter()
                .map(|(c, s)| (c.to_string(), s.to_string()))
                .collect()
        });
        let text = metrics.encode().unwrap();
        assert!(text.contains(
            r#"dbops_resources{controller="database-controller",kind="Database",condition="Ready",status="True"} 2"#
        ), "{text}");
        *objects.lock().unwrap() = vec![("Ready", "False")];
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(r#"condition="Ready",status="False"} 1"#),
            "{text}"
        );
        assert!(!text.contains(r#"status="True""#), "{text}");
    }

    #[test]
    fn external_requests_are_counted() {
        let metrics = Metrics::new("backup-controller");
        record_external_request(Target::Store, "ok");
        let text = metrics.encode().unwrap();
        assert!(text.contains(r#"dbops_external_requests_total{target="store",outcome="ok"}"#));
    }
}
