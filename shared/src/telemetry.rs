//! Logs and traces: a tracing subscriber filtered by `--log-filter`, writing text or JSON
//! lines to stderr and, when `--otlp-endpoint` is set, exporting spans over OTLP/gRPC
//! (for example to Jaeger). The W3C TraceContext propagator is installed globally.

use std::time::Duration;

use opentelemetry::{
    global,
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

/// Installs the global subscriber. Must run inside the Tokio runtime when an OTLP endpoint
/// is set (the gRPC client runs on it).
pub fn init(
    service_name: &'static str,
    args: &CommonArgs,
) -> Result<TelemetryGuard, TelemetryError> {
    let filter = EnvFilter::try_new(&args.log_filter)?;
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
