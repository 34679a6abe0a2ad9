//! One reconcile: its context, its error kinds, its time limit, its span (with the trace
//! continued from the object's creator) and the error policy's per-object backoff.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use dbops_api::{HasConditions, ReasonClass};
use kube::{
    Client, Resource,
    runtime::{controller::Action, events::Reporter},
};
use tracing::{Instrument, field};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    backoff::{Backoff, BackoffKey, BackoffTracker},
    cli::CommonArgs,
    health::HealthState,
    metrics::{Metrics, Outcome},
    telemetry::{TRACEPARENT_ANNOTATION, current_trace_id, remote_parent},
};

/// What the error policy does with a reconcile error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Retrying may help (server or API unavailable): requeue with per-object backoff.
    Transient,
    /// Retrying cannot help until something changes (the spec cannot work as written, a
    /// name is taken, a limit is exceeded): report it and wait for a change (a resync
    /// looks again). Every controller's error says one of these two words.
    Permanent,
}

/// What a controller does after a failure whose reason is of `class`, in every
/// controller: a `Retried` reason is tried again with backoff (a Backup's attempt, a
/// Migration step's, counted against their limits); any other waits for a change (a
/// watch, the resync) or, for a Backup or a Migration, ends it (`Failed`: the Backup
/// fails, the Migration rolls back). Each controller's error derives its kind from its
/// reason through this, so what the status says and what the controller does agree.
pub const fn retry_of(class: ReasonClass) -> ErrorKind {
    match class {
        ReasonClass::Retried => ErrorKind::Transient,
        _ => ErrorKind::Permanent,
    }
}

/// Implemented by each controller's reconcile error enum.
pub trait ReconcileError: std::error::Error + Send + Sync + 'static {
    fn kind(&self) -> ErrorKind;
    /// A short CamelCase label for metrics and traces, for example `ServerUnavailable`.
    fn reason(&self) -> &'static str;
}

/// A reconcile's own error, or the runner's bound on its duration.
#[derive(Debug, thiserror::Error)]
pub enum Bounded<E> {
    #[error(transparent)]
    Reconcile(E),
    #[error("the reconcile did not finish within {0:?} (--reconcile-timeout) and was abandoned")]
    TimedOut(Duration),
}

impl<E: ReconcileError> ReconcileError for Bounded<E> {
    fn kind(&self) -> ErrorKind {
        match self {
            Bounded::Reconcile(e) => e.kind(),
            Bounded::TimedOut(_) => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Bounded::Reconcile(e) => e.reason(),
            Bounded::TimedOut(_) => "ReconcileTimeout",
        }
    }
}

/// `work` with a deadline: past `limit` it is dropped (a child program killed, a
/// session given back; every step resumes from what it recorded) and fails as
/// [`Bounded::TimedOut`], retried with backoff. Not an `async fn`: the returned future
/// holds `work` once (an `async fn` would keep its parameter beside the timeout's copy).
pub fn bounded<E>(
    work: impl Future<Output = Result<Action, E>>,
    limit: Duration,
) -> impl Future<Output = Result<Action, Bounded<E>>> {
    use futures::FutureExt;
    tokio::time::timeout(limit, work).map(move |outcome| match outcome {
        Ok(result) => result.map_err(Bounded::Reconcile),
        Err(_) => {
            tracing::warn!(?limit, "reconcile abandoned at its time limit");
            Err(Bounded::TimedOut(limit))
        }
    })
}

/// For reconcilers that cannot fail.
impl ReconcileError for Infallible {
    fn kind(&self) -> ErrorKind {
        match *self {}
    }

    fn reason(&self) -> &'static str {
        match *self {}
    }
}

/// Everything a reconcile gets besides the object; `state` is the controller's own.
pub struct Context<S> {
    /// For example `database-controller`: the metrics label and the Lease suffix.
    pub controller: &'static str,
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub backoff: BackoffTracker,
    pub health: HealthState,
    /// Who publishes this controller's Events.
    pub reporter: Reporter,
    /// How long a converged object waits before its next reconcile.
    pub resync_interval: Duration,
    pub state: S,
}

/// Who publishes the Events of `controller`: `dbops-<controller>`, instance `POD_NAME`.
pub fn reporter(controller: &str) -> Reporter {
    Reporter {
        controller: format!("dbops-{controller}"),
        instance: std::env::var("POD_NAME").ok(),
    }
}

impl<S> Context<S> {
    pub fn new(
        controller: &'static str,
        client: Client,
        args: &CommonArgs,
        health: HealthState,
        metrics: Arc<Metrics>,
        state: S,
    ) -> Self {
        Self {
            controller,
            client,
            metrics,
            backoff: BackoffTracker::new(Backoff {
                base: args.backoff_base,
                max: args.backoff_max,
            }),
            health,
            reporter: reporter(controller),
            resync_interval: args.resync_interval,
            state,
        }
    }
}

/// Runs one reconcile inside its span (`controller`, `kind`, `object.namespace`,
/// `object.name`, `object.generation`, `outcome`, `error`, `trace_id`), timing it and
/// counting its outcome. A success resets the object's backoff.
///
/// The object fields are `object.*`, not `name`: JSON logs already use `name` for the
/// span's own name.
///
/// An object created (or changed) by another controller carries that controller's trace
/// context in the `dbops.dev/traceparent` annotation
/// ([`crate::telemetry::trace_annotation`]). Until the object is settled (`Ready` or
/// `Failed` is `True` for its current generation), its reconciles continue that trace as
/// children of the annotating span; afterwards (resyncs, cleanup) each reconcile is a trace
/// of its own with a link to it, so one trace never grows without end.
pub async fn instrumented_reconcile<K, S, E>(
    obj: Arc<K>,
    ctx: Arc<Context<S>>,
    work: impl Future<Output = Result<Action, E>>,
) -> Result<Action, E>
where
    K: Resource<DynamicType = ()> + HasConditions,
    E: ReconcileError,
{
    let meta = obj.meta();
    let span = tracing::info_span!(
        "reconcile",
        otel.name = %format_args!("reconcile {}", K::kind(&())),
        otel.status_code = field::Empty,
        controller = ctx.controller,
        kind = %K::kind(&()),
        object.namespace = meta.namespace.as_deref(),
        object.name = meta.name.as_deref(),
        object.generation = meta.generation,
        outcome = field::Empty,
        error = field::Empty,
        trace_id = field::Empty,
        trace.continued = field::Empty,
    );
    // Before the span is first entered: a parent can only be set on a span not yet started.
    if let Some(parent) = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(TRACEPARENT_ANNOTATION))
        .and_then(|value| remote_parent(value))
    {
        use opentelemetry::trace::TraceContextExt;
        if is_settled(obj.as_ref()) {
            span.add_link(parent.span().span_context().clone());
            span.record("trace.continued", "link");
        } else if span.set_parent(parent).is_ok() {
            span.record("trace.continued", "parent");
        }
    }
    async move {
        let span = tracing::Span::current();
        if let Some(trace_id) = current_trace_id() {
            span.record("trace_id", trace_id.as_str());
        }
        let metrics = ctx.metrics.controller();
        let _timer = metrics.reconcile_timer();
        let result = work.await;
        match &result {
            Ok(_) => {
                ctx.backoff.reset(&BackoffKey::for_object(obj.as_ref()));
                metrics.record_outcome(Outcome::Success);
                span.record("outcome", Outcome::Success.as_str());
            }
            Err(error) => {
                metrics.record_outcome(Outcome::Error);
                metrics.record_error(error.reason());
                span.record("outcome", Outcome::Error.as_str());
                span.record("otel.status_code", "ERROR");
                span.record("error", error.reason());
            }
        }
        result
    }
    .instrument(span)
    .await
}

/// `(type, status)` of each condition in the object's `status.conditions`.
pub fn conditions_of<K: HasConditions>(obj: &K) -> Vec<(String, String)> {
    obj.conditions()
        .iter()
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect()
}

/// Whether an object has reached an end state its creator's trace should not follow past:
/// `Ready` or `Failed` is `True` for its current generation (a condition without
/// `observedGeneration` counts as current). A spec change (for example the
/// migration-controller switching a Database's server) makes it unsettled again.
fn is_settled<K: Resource + HasConditions>(obj: &K) -> bool {
    let generation = obj.meta().generation;
    obj.conditions().iter().any(|c| {
        matches!(c.type_.as_str(), "Ready" | "Failed")
            && c.status == "True"
            && (c.observed_generation.is_none() || c.observed_generation == generation)
    })
}

/// Transient errors are retried after the object's next backoff delay; an invalid spec
/// waits for the object to change.
pub fn error_policy<K, S, E>(obj: Arc<K>, error: &E, ctx: Arc<Context<S>>) -> Action
where
    K: Resource,
    E: ReconcileError,
{
    let key = BackoffKey::for_object(obj.as_ref());
    match error.kind() {
        ErrorKind::Transient => {
            let delay = ctx.backoff.next_delay(&key);
            tracing::debug!(object = ?key, ?delay, "retrying after backoff");
            Action::requeue(delay)
        }
        ErrorKind::Permanent => {
            ctx.backoff.reset(&key);
            Action::await_change()
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use http::{Request, Response};
    use kube::{api::ObjectMeta, client::Body};

    use super::*;

    #[derive(Parser)]
    struct TestCli {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[derive(Debug, thiserror::Error)]
    enum TestError {
        #[error("server unavailable")]
        Unavailable,
        #[error("bad spec")]
        BadSpec,
    }

    impl ReconcileError for TestError {
        fn kind(&self) -> ErrorKind {
            match self {
                Self::Unavailable => ErrorKind::Transient,
                Self::BadSpec => ErrorKind::Permanent,
            }
        }

        fn reason(&self) -> &'static str {
            match self {
                Self::Unavailable => "ServerUnavailable",
                Self::BadSpec => "InvalidSpec",
            }
        }
    }

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn context() -> (Arc<Context<()>>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let args = TestCli::parse_from(["test"]).common;
        let ctx = Context::new(
            "test-controller",
            client,
            &args,
            HealthState::new(false),
            Arc::new(Metrics::new("test-controller")),
            (),
        );
        (Arc::new(ctx), handle)
    }

    fn an_object() -> Arc<dbops_api::Backup> {
        let mut backup: dbops_api::Backup = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
            "metadata": {"name": "orders", "namespace": "default", "uid": "uid-1", "generation": 1},
            "spec": {"databaseRef": {"name": "orders"}}
        }))
        .expect("a valid Backup");
        backup.metadata = ObjectMeta {
            name: Some("orders".into()),
            namespace: Some("default".into()),
            uid: Some("uid-1".into()),
            generation: Some(1),
            ..ObjectMeta::default()
        };
        Arc::new(backup)
    }

    /// Asserts that nothing was sent through the mock once every client is dropped.
    async fn assert_no_api_call(ctx: Arc<Context<()>>, mut handle: Handle) {
        drop(ctx);
        let next = tokio::time::timeout(Duration::from_secs(5), handle.next_request()).await;
        assert!(
            matches!(next, Ok(None)),
            "the reconcile wrapper called the API"
        );
    }

    #[tokio::test]
    async fn a_reconcile_past_its_time_limit_is_abandoned_and_retried() {
        let never = std::future::pending::<Result<Action, TestError>>();
        let e = bounded(never, Duration::from_millis(10))
            .await
            .expect_err("a reconcile that never ends is cut");
        assert_eq!(e.reason(), "ReconcileTimeout");
        assert_eq!(e.kind(), ErrorKind::Transient);
        let quick = async { Ok::<_, TestError>(Action::await_change()) };
        assert!(bounded(quick, Duration::from_secs(1)).await.is_ok());
    }

    #[tokio::test]
    async fn the_wrapper_makes_no_api_call_and_counts_a_success() {
        let (ctx, handle) = context();
        let resync = Action::requeue(ctx.resync_interval);
        let action = instrumented_reconcile(an_object(), ctx.clone(), async {
            Ok::<_, Infallible>(Action::requeue(Duration::from_secs(300)))
        })
        .await
        .unwrap();
        assert_eq!(action, resync);
        let text = ctx.metrics.encode().unwrap();
        assert!(text.contains(r#"outcome="success"} 1"#));
        assert_no_api_call(ctx, handle).await;
    }

    #[tokio::test]
    async fn transient_errors_back_off_and_a_success_resets() {
        let (ctx, _handle) = context();
        let obj = an_object();
        let failed = instrumented_reconcile(obj.clone(), ctx.clone(), async {
            Err::<Action, _>(TestError::Unavailable)
        })
        .await;
        let error = failed.unwrap_err();
        // A requeue after the jittered first delay (its value is covered by backoff's tests).
        assert_ne!(
            error_policy(obj.clone(), &error, ctx.clone()),
            Action::await_change()
        );
        assert_eq!(ctx.backoff.len(), 1);

        instrumented_reconcile(obj.clone(), ctx.clone(), async {
            Ok::<_, TestError>(Action::await_change())
        })
        .await
        .unwrap();
        assert!(ctx.backoff.is_empty());
        let text = ctx.metrics.encode().unwrap();
        assert!(text.contains(r#"reason="ServerUnavailable"} 1"#));
    }

    #[tokio::test]
    async fn an_invalid_spec_waits_for_a_change() {
        let (ctx, _handle) = context();
        assert_eq!(
            error_policy(an_object(), &TestError::BadSpec, ctx.clone()),
            Action::await_change()
        );
        assert!(ctx.backoff.is_empty());
    }

    /// Spans of reconciles run under an in-memory OpenTelemetry exporter.
    fn otel_subscriber() -> (
        impl tracing::Subscriber + Send + Sync,
        opentelemetry_sdk::trace::InMemorySpanExporter,
        opentelemetry_sdk::trace::SdkTracerProvider,
    ) {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt;
        let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        (
            tracing_subscriber::registry().with(layer),
            exporter,
            provider,
        )
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn annotated(conditions: serde_json::Value) -> Arc<dbops_api::Backup> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "dbops.dev/v1alpha1",
                "kind": "Backup",
                "metadata": {
                    "name": "orders-final", "namespace": "default", "uid": "uid-2",
                    "generation": 1,
                    "annotations": {TRACEPARENT_ANNOTATION: PARENT},
                },
                "spec": {"databaseRef": {"name": "orders"}},
                "status": {"conditions": conditions},
            }))
            .unwrap(),
        )
    }

    #[tokio::test]
    async fn an_unsettled_object_continues_its_creators_trace_and_passes_it_on() {
        let (subscriber, exporter, provider) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);
        let (ctx, _handle) = context();
        let obj = annotated(serde_json::json!([]));
        let passed_on = Arc::new(std::sync::Mutex::new(None));
        let writer = passed_on.clone();
        instrumented_reconcile(obj, ctx, async move {
            *writer.lock().unwrap() = crate::telemetry::trace_annotation();
            Ok::<_, Infallible>(Action::await_change())
        })
        .await
        .unwrap();
        let passed_on = passed_on.lock().unwrap().take().unwrap();
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let reconcile = spans.iter().find(|s| s.name == "reconcile Backup").unwrap();
        assert_eq!(
            reconcile.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(reconcile.parent_span_id.to_string(), "00f067aa0ba902b7");
        // What this reconcile writes on an object it creates names the reconcile itself.
        assert_eq!(passed_on.0, TRACEPARENT_ANNOTATION);
        assert_eq!(
            passed_on.1,
            format!(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01",
                reconcile.span_context.span_id()
            )
        );
        let attribute = |key: &str| {
            reconcile
                .attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(attribute("controller").as_deref(), Some("test-controller"));
        assert_eq!(attribute("kind").as_deref(), Some("Backup"));
        assert_eq!(attribute("object.name").as_deref(), Some("orders-final"));
        assert_eq!(attribute("object.generation").as_deref(), Some("1"));
        assert_eq!(attribute("outcome").as_deref(), Some("success"));
        assert_eq!(attribute("trace.continued").as_deref(), Some("parent"));
    }

    #[test]
    fn an_object_is_settled_when_ready_or_failed_for_its_generation() {
        let condition = |type_: &str, status: &str, generation: i64| {
            serde_json::json!([{
                "type": type_, "status": status, "reason": "R", "message": "m",
                "observedGeneration": generation,
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }])
        };
        assert!(!is_settled(annotated(serde_json::json!([])).as_ref()));
        assert!(is_settled(
            annotated(condition("Ready", "True", 1)).as_ref()
        ));
        assert!(is_settled(
            annotated(condition("Failed", "True", 1)).as_ref()
        ));
        assert!(!is_settled(
            annotated(condition("Ready", "False", 1)).as_ref()
        ));
        // Ready for an older generation: a spec change is still being worked on.
        let mut changed = (*annotated(condition("Ready", "True", 1))).clone();
        changed.metadata.generation = Some(2);
        assert!(!is_settled(&changed));
    }

    #[tokio::test]
    async fn a_settled_object_starts_its_own_trace_linked_to_its_creator() {
        let (subscriber, exporter, provider) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);
        let (ctx, _handle) = context();
        let obj = annotated(serde_json::json!([{
            "type": "Ready", "status": "True", "reason": "Completed", "message": "done",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]));
        instrumented_reconcile(obj, ctx, async {
            Ok::<_, Infallible>(Action::await_change())
        })
        .await
        .unwrap();
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let reconcile = spans.iter().find(|s| s.name == "reconcile Backup").unwrap();
        assert_ne!(
            reconcile.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let links: Vec<String> = reconcile
            .links
            .iter()
            .map(|l| l.span_context.span_id().to_string())
            .collect();
        assert_eq!(links, ["00f067aa0ba902b7"]);
    }
}
