//! Why a Database reconcile did not converge, and what to do about it.

use dbops_shared::controller::{ErrorKind, ReconcileError};
use dbops_shared::postgres::PgError;

use crate::template::TemplateError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// Reported in status; retried when the Database or its admin Secret changes.
    #[error("{message}")]
    Blocked {
        reason: &'static str,
        message: String,
    },
    /// Reported in status; retried with backoff.
    #[error("{message}")]
    Retry {
        reason: &'static str,
        message: String,
    },
    #[error("{0}")]
    Internal(String),
    /// The Database this reconcile read is no longer the live object of its name (gone,
    /// created again with another UID, being deleted, or at a new generation): the
    /// reconcile is abandoned, nothing more is written for it (`live::confirm_live`).
    #[error("{0}")]
    Superseded(String),
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kube(_) | Error::Internal(_) | Error::Retry { .. } | Error::Superseded(_) => {
                ErrorKind::Transient
            }
            // TLS failures too: a server's certificate can be fixed without a spec change.
            Error::Postgres(_) => ErrorKind::Transient,
            Error::Blocked { .. } => ErrorKind::Permanent,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::Postgres(e) => e.reason(),
            Error::Blocked { reason, .. } | Error::Retry { reason, .. } => reason,
            Error::Internal(_) => "InternalError",
            Error::Superseded(_) => "Superseded",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A `spec.secretTemplate` that does not render: refused, naming the key.
pub(crate) fn template_error(e: TemplateError) -> Error {
    Error::Blocked {
        reason: "InvalidSecretTemplate",
        message: format!("{e}; nothing was written"),
    }
}
