//! The `store` span and counter around each store operation.

use super::error::StoreError;

/// Runs one operation on the store (`create_artifact`, `commit`, `put_manifest`,
/// `open_artifact`, `get_manifest`, `delete`, `discard_partial`) inside a `store` span
/// (`store.operation`, `store.location`: the artifact's URL, never a credential) and counts
/// it in `dbops_external_requests_total{target="store"}`. Callers wrap their calls:
/// `traced("put_manifest", store.location(&key), store.put_manifest(&key, &body))`.
pub async fn traced<T>(
    operation: &'static str,
    location: String,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    use tracing::Instrument;
    let span = tracing::info_span!(
        "store",
        otel.name = %format_args!("store {operation}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        store.operation = operation,
        store.location = location.as_str(),
    );
    let result = work.instrument(span.clone()).await;
    let outcome = match &result {
        Ok(_) => "ok",
        Err(_) => {
            span.record("otel.status_code", "ERROR");
            "error"
        }
    };
    crate::metrics::record_external_request(crate::metrics::Target::Store, outcome);
    result
}
