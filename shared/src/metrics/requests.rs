//! The process-wide request metrics every controller records into (external requests by
//! target and outcome, Kubernetes requests by verb and resource, their durations, queue
//! waits, session slots held) and the database-controller's database sizes: statics
//! that [`super::Metrics::new`] registers.

use std::fmt::Write;
use std::sync::LazyLock;

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, histogram::Histogram},
};

/// Where an external request went.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Target {
    Kubernetes,
    Postgres,
    Store,
}

impl Target {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kubernetes => "kubernetes",
            Self::Postgres => "postgres",
            Self::Store => "store",
        }
    }
}

impl EncodeLabelValue for Target {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ExternalLabels {
    target: Target,
    outcome: &'static str,
}

/// One family per process, registered in every [`Metrics`] registry: the PostgreSQL
/// sessions and the backup store count their requests without a handle on the registry.
pub(super) static EXTERNAL_REQUESTS: LazyLock<Family<ExternalLabels, Counter>> =
    LazyLock::new(Family::default);

/// Counts one request to `target` that ended with `outcome` (a short snake_case word:
/// `ok`, `error`, `client_error`, ...).
pub fn record_external_request(target: Target, outcome: &'static str) {
    EXTERNAL_REQUESTS
        .get_or_create(&ExternalLabels { target, outcome })
        .inc();
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KubernetesLabels {
    verb: &'static str,
    resource: String,
}

pub(super) static KUBERNETES_REQUESTS: LazyLock<Family<KubernetesLabels, Counter>> =
    LazyLock::new(Family::default);

/// Counts one request to the Kubernetes API: its verb and its resource (with a
/// subresource, as `databases/status`; never an object's name).
pub fn record_kubernetes_request(verb: &'static str, resource: String) {
    KUBERNETES_REQUESTS
        .get_or_create(&KubernetesLabels { verb, resource })
        .inc();
}

/// Upper bounds (seconds) of the request and wait duration buckets.
const REQUEST_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct TargetLabels {
    target: Target,
}

pub(super) static EXTERNAL_DURATION: LazyLock<Family<TargetLabels, Histogram>> =
    LazyLock::new(|| Family::new_with_constructor(|| Histogram::new(REQUEST_BUCKETS)));

/// Records how long one request to `target` took.
pub fn observe_external_request(target: Target, took: std::time::Duration) {
    EXTERNAL_DURATION
        .get_or_create(&TargetLabels { target })
        .observe(took.as_secs_f64());
}

/// What a request waited for before it was sent.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Queue {
    /// A token of `--api-rate-limit`.
    ApiRateLimit,
    /// A session slot of `--max-sessions-per-server`.
    PostgresSession,
}

impl EncodeLabelValue for Queue {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(match self {
            Self::ApiRateLimit => "api_rate_limit",
            Self::PostgresSession => "postgres_session",
        })
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct QueueLabels {
    queue: Queue,
}

pub(super) static QUEUE_WAIT: LazyLock<Family<QueueLabels, Histogram>> =
    LazyLock::new(|| Family::new_with_constructor(|| Histogram::new(REQUEST_BUCKETS)));

/// Records how long one request waited in `queue`.
pub fn observe_queue_wait(queue: Queue, waited: std::time::Duration) {
    QUEUE_WAIT
        .get_or_create(&QueueLabels { queue })
        .observe(waited.as_secs_f64());
}

pub(super) static SESSION_HELD: LazyLock<Histogram> =
    LazyLock::new(|| Histogram::new(REQUEST_BUCKETS));

/// Records how long one PostgreSQL session slot was held.
pub fn observe_session_held(held: std::time::Duration) {
    SESSION_HELD.observe(held.as_secs_f64());
}
