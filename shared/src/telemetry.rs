//! Logs and traces: a tracing subscriber filtered by `--log-filter`, writing text or JSON
//! lines to stderr and, when `--otlp-endpoint` is set, exporting spans over OTLP/gRPC
//! (for example to Jaeger). The W3C TraceContext propagator is installed globally.
//!
//! One trace across controllers: a controller that creates an object for another one
//! writes [`trace_annotation`] (the W3C `traceparent` of its current span) into the new
//! object's annotations; the receiving controller's reconcile span continues that trace
//! ([`remote_parent`], applied by `controller::instrumented_reconcile`).

use std::{collections::HashMap, time::Duration};

use opentelemetry::{
    Context, global,
    propagation::TextMapPropagator,
    trace::{TraceContextExt, TraceId, TracerProvider as _},
};
use opentelemetry_otlp::{ExporterBuildError, SpanExporter, WithExportConfig};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

use crate::cli::{CommonArgs, LogFormat};

/// How long shutdown waits for the last spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid --log-filter: {0}")]
    Filter(#[from] tracing_subscriber::filter::ParseError),
    #[error("failed to build the OTLP span exporter: {0}")]
    Exporter(#[from] ExporterBuildError),
    #[error("a global tracing subscriber is already installed: {0}")]
    AlreadyInstalled(#[from] tracing_subscriber::util::TryInitError),
}

/// Keeps the span exporter alive; dropping it exports the spans still buffered.
#[must_use = "dropping the guard stops trace export"]
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT)
        {
            // The subscriber may already be gone; stderr is the one place left.
            eprintln!("failed to flush traces on shutdown: {error}");
        }
    }
}

/// tokio-postgres logs, at `debug` and through the `log` crate (which this subscriber
/// receives), every statement it sends as written (a `CREATE SUBSCRIPTION`'s connection
/// string with the replication role's password, SCRAM verifiers) and every bound
/// parameter: it is held to `info` whenever the filter would let anything past that.
const POSTGRES_CLIENT_CAP: &str = "tokio_postgres=info";

/// `--log-filter`, with [`POSTGRES_CLIENT_CAP`] when the filter enables `debug` anywhere.
pub fn log_filter(spec: &str) -> Result<EnvFilter, TelemetryError> {
    let filter = EnvFilter::try_new(spec)?;
    if filter
        .max_level_hint()
        .is_some_and(|max| max > tracing_subscriber::filter::LevelFilter::INFO)
    {
        return Ok(filter.add_directive(POSTGRES_CLIENT_CAP.parse()?));
    }
    Ok(filter)
}

/// Installs the global subscriber. Must run inside the Tokio runtime when an OTLP endpoint
/// is set (the gRPC client runs on it).
pub fn init(
    service_name: &'static str,
    args: &CommonArgs,
) -> Result<TelemetryGuard, TelemetryError> {
    let filter = log_filter(&args.log_filter)?;
    let fmt_layer = match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };

    global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = match &args.otlp_endpoint {
        Some(endpoint) => Some(tracer_provider(service_name, endpoint)?),
        None => None,
    };
    let otel_layer = provider
        .as_ref()
        .map(|provider| tracing_opentelemetry::layer().with_tracer(provider.tracer(service_name)));

    tracing_subscriber::registry()
        .with(fmt_layer)
        .with(otel_layer)
        .with(filter)
        .try_init()?;
    if provider.is_some() {
        tracing::info!("exporting traces over OTLP/gRPC");
    }
    Ok(TelemetryGuard { provider })
}

fn tracer_provider(
    service_name: &'static str,
    endpoint: &str,
) -> Result<SdkTracerProvider, ExporterBuildError> {
    let exporter = SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service_name).build())
        .build();
    global::set_tracer_provider(provider.clone());
    Ok(provider)
}

/// The OpenTelemetry trace id of the current span, when traces are exported.
pub fn current_trace_id() -> Option<String> {
    let context = tracing::Span::current().context();
    let trace_id = context.span().span_context().trace_id();
    (trace_id != TraceId::INVALID).then(|| trace_id.to_string())
}

/// The annotation that carries the W3C trace context from the controller that created an
/// object to the one that reconciles it.
pub const TRACEPARENT_ANNOTATION: &str = "dbops.dev/traceparent";

/// The W3C header name of the trace context.
const TRACEPARENT: &str = "traceparent";

/// `(dbops.dev/traceparent, <traceparent of the current span>)`, to add to the annotations
/// of an object created for another controller; `None` when traces are not exported.
pub fn trace_annotation() -> Option<(String, String)> {
    traceparent_of(&tracing::Span::current().context())
        .map(|value| (TRACEPARENT_ANNOTATION.to_owned(), value))
}

/// The `traceparent` of `context`, when it holds a valid span.
fn traceparent_of(context: &Context) -> Option<String> {
    if !context.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(context, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The remote parent named by a `dbops.dev/traceparent` annotation value; `None` when the
/// value is not a valid W3C traceparent.
pub fn remote_parent(traceparent: &str) -> Option<Context> {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    let context = TraceContextPropagator::new().extract(&carrier);
    context.span().span_context().is_valid().then_some(context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_postgres_client_never_logs_statements_whatever_the_filter() {
        use tracing_subscriber::layer::SubscriberExt;
        let enabled = |spec: &str| {
            let subscriber = tracing_subscriber::registry().with(log_filter(spec).unwrap());
            tracing::subscriber::with_default(subscriber, || {
                (
                    tracing::enabled!(target: "tokio_postgres::simple_query", tracing::Level::DEBUG),
                    tracing::enabled!(target: "tokio_postgres::connection", tracing::Level::INFO),
                    tracing::enabled!(target: "kube_client", tracing::Level::DEBUG),
                )
            })
        };
        assert_eq!(enabled("debug"), (false, true, true));
        assert_eq!(enabled("info,tokio_postgres=trace"), (false, true, false));
        assert_eq!(enabled("info"), (false, true, false));
        assert_eq!(enabled("warn"), (false, false, false));
    }

    #[test]
    fn a_valid_traceparent_is_a_remote_parent_and_round_trips() {
        let value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parent = remote_parent(value).unwrap();
        assert!(parent.span().span_context().is_remote());
        assert_eq!(traceparent_of(&parent).as_deref(), Some(value));
    }

    #[test]
    fn garbage_is_no_parent() {
        assert!(remote_parent("").is_none());
        assert!(remote_parent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
        assert!(remote_parent("not a traceparent").is_none());
    }

    #[test]
    fn without_an_exporter_there_is_no_annotation() {
        assert!(trace_annotation().is_none());
    }
}
