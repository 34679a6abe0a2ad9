//! [`StoreError`]: why a store operation failed, and whether a retry may cure it.

/// Why a store operation failed. `Io` and `Remote` errors may pass (a full disk, an
/// unmounted volume, a permission fixed by an operator, an S3 endpoint down or
/// throttling): callers retry them. `Refused` and `Misconfigured` need a change of
/// configuration.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("backup store {store}: {what}: {source}")]
    Io {
        store: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The S3 endpoint could not be reached, timed out, failed (5xx) or throttled.
    #[error("backup store {store}: {what}: {message}")]
    Remote {
        store: String,
        what: String,
        message: String,
    },
    /// The S3 endpoint refused the request for good: credentials refused (401/403), the
    /// bucket does not exist, or another client error (4xx).
    #[error("backup store {store}: {what}: {message}")]
    Refused {
        store: String,
        what: String,
        message: String,
    },
    /// The S3 client could not be built from the environment (an invalid endpoint URL,
    /// an `http://` endpoint without `AWS_ALLOW_HTTP=true`, ...).
    #[error("backup store {store} is misconfigured: {message}")]
    Misconfigured { store: String, message: String },
    #[error("{0} does not exist in the backup store")]
    NotFound(String),
}

impl StoreError {
    /// Whether the operation may work later without a configuration change.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Io { .. } | StoreError::Remote { .. })
    }
}
