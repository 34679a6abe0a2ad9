//! Why a Backup reconcile or one attempt at a Backup did not succeed.

use dbops_shared::controller::{ErrorKind, ReconcileError};
use dbops_shared::postgres::PgError;

use crate::dump::DumpError;
use dbops_shared::backup_store::StoreError;

/// A reconcile that could not do its own bookkeeping (an API call, removing an artifact
/// on deletion); retried with the shared per-object backoff. Failures of the dump itself
/// are [`Failure`]s, counted in `status.attempts`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kube(_) => ErrorKind::Transient,
            Error::Store(e) if e.is_transient() => ErrorKind::Transient,
            Error::Store(_) => ErrorKind::Permanent,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::Store(e) => store_reason(e),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why one attempt produced no artifact: a CamelCase reason, a message for humans (never
/// a secret), and whether retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: &'static str,
    pub message: String,
    pub permanent: bool,
}

impl Failure {
    pub fn transient(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            permanent: false,
        }
    }

    pub fn permanent(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            permanent: true,
        }
    }
}

fn store_reason(e: &StoreError) -> &'static str {
    match e {
        StoreError::Io { .. } | StoreError::Remote { .. } => "StoreUnavailable",
        StoreError::Refused { .. } => "StoreRefused",
        StoreError::Misconfigured { .. } => "StoreMisconfigured",
        StoreError::NotFound(_) => "ArtifactNotFound",
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Self {
            reason: store_reason(&e),
            message: e.to_string(),
            permanent: !e.is_transient(),
        }
    }
}

impl From<PgError> for Failure {
    fn from(e: PgError) -> Self {
        let permanent = matches!(
            e,
            PgError::AuthenticationFailed { .. } | PgError::Tls { .. }
        );
        Self {
            reason: e.reason(),
            message: e.to_string(),
            permanent,
        }
    }
}

impl From<DumpError> for Failure {
    fn from(e: DumpError) -> Self {
        match e {
            DumpError::Store(e) => e.into(),
            e => Self {
                reason: e.reason(),
                message: e.to_string(),
                permanent: e.is_permanent(),
            },
        }
    }
}
