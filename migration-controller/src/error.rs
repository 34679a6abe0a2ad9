//! Why a saga step did not finish, sorted by what happens next.

use dbops_shared::controller::{ErrorKind, ReconcileError};
use dbops_shared::postgres::PgError;

use crate::copy::CopyError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API failed or refused a write (a 409 means our view was stale):
    /// retried with backoff, and it never counts against a step's attempts.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A PostgreSQL server failed; retried, and counted against the step's attempts.
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// pg_dump or pg_restore failed; retried, and counted against the step's attempts.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// The step cannot succeed as things are (a name conflict, an older target, a failed
    /// snapshot, a mismatch after the copy): the saga rolls back at once.
    #[error("{message}")]
    Fatal {
        reason: &'static str,
        message: String,
    },
    /// Something that retrying may cure and that fits no other kind.
    #[error("{message}")]
    Transient {
        reason: &'static str,
        message: String,
    },
}

impl Error {
    pub fn fatal(reason: &'static str, message: impl Into<String>) -> Self {
        Error::Fatal {
            reason,
            message: message.into(),
        }
    }

    pub fn transient(reason: &'static str, message: impl Into<String>) -> Self {
        Error::Transient {
            reason,
            message: message.into(),
        }
    }

    /// Whether the failure counts against the step's attempts (the API's does not: a
    /// conflict on our own status write is not the step failing).
    pub fn counts_as_attempt(&self) -> bool {
        !matches!(self, Error::Kube(_))
    }
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Fatal { .. } => ErrorKind::InvalidSpec,
            _ => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::Postgres(e) => e.reason(),
            Error::Copy(e) => e.reason(),
            Error::Fatal { reason, .. } | Error::Transient { reason, .. } => reason,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
