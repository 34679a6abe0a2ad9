//! Why a saga step did not finish, sorted by what happens next.

use dbops_shared::controller::{ErrorKind, ReconcileError};
use dbops_shared::postgres::PgError;
use dbops_shared::server::ServerError;

use crate::dump::pipe::CopyError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API failed or refused a write (a 409 means our view was stale):
    /// retried with backoff, and it never counts against a step's attempts.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A PostgreSQL server failed; retried, and counted against the step's attempts.
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// A DatabaseServer of the Migration cannot be used (not found, namespace not allowed,
    /// admin or CA Secret missing or invalid): counted against the step's attempts like a
    /// server failure, and refused for good at Preflight (`steps::preflight`). The
    /// caches not synced yet (`CacheNotSynced`) is only retried with backoff.
    #[error(transparent)]
    Server(#[from] ServerError),
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
    /// conflict on our own status write is not the step failing; nor do caches that have
    /// not synced yet).
    pub fn counts_as_attempt(&self) -> bool {
        match self {
            Error::Kube(_) => false,
            Error::Server(e) => !e.is_transient(),
            _ => true,
        }
    }
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Fatal { .. } => ErrorKind::Permanent,
            _ => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::Postgres(e) => e.reason(),
            Error::Server(e) => e.reason(),
            Error::Copy(e) => e.reason(),
            Error::Fatal { reason, .. } | Error::Transient { reason, .. } => reason,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_keep_their_reason_and_only_unsynced_caches_do_not_count() {
        let missing = Error::from(ServerError::NotFound("pg-17".into()));
        assert_eq!(missing.reason(), "ServerNotFound");
        assert_eq!(missing.kind(), ErrorKind::Transient);
        assert!(missing.counts_as_attempt());
        let secret = Error::from(ServerError::AdminSecretNotFound {
            server: "pg-17".into(),
            secret: "dbops-system/pg-17-admin".into(),
        });
        assert_eq!(secret.reason(), "AdminSecretNotFound");
        assert!(secret.counts_as_attempt());
        let unsynced = Error::from(ServerError::NotSynced);
        assert_eq!(unsynced.reason(), "CacheNotSynced");
        assert!(!unsynced.counts_as_attempt());
    }
}
