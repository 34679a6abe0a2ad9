//! Why a Database reconcile did not converge, and what to do about it.

use dbops_api::reasons::DatabaseReason;
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
    /// Reported in status; looked at again after `again`, not with backoff: a step that
    /// waits its turn (a clone's queue, its source becoming Ready).
    #[error("{message}")]
    Waiting {
        reason: &'static str,
        message: String,
        again: std::time::Duration,
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
    /// A routine check put off because its server is busy (`routine`): nothing was read
    /// or written, the status stands, and the Database is looked at again at the resync.
    #[error("routine check put off: the server is busy")]
    Deferred,
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kube(_)
            | Error::Internal(_)
            | Error::Retry { .. }
            | Error::Superseded(_)
            | Error::Deferred => ErrorKind::Transient,
            // A right the admin lacks: no retry gives it (the server's capabilities,
            // when they change, wake its Databases).
            Error::Postgres(e) if e.reason() == DatabaseReason::AdminLacksPrivilege.as_str() => {
                ErrorKind::Permanent
            }
            // TLS failures too: a server's certificate can be fixed without a spec change.
            Error::Postgres(_) => ErrorKind::Transient,
            Error::Blocked { .. } | Error::Waiting { .. } => ErrorKind::Permanent,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => DatabaseReason::KubernetesApiError.as_str(),
            Error::Postgres(e) => e.reason(),
            Error::Blocked { reason, .. }
            | Error::Retry { reason, .. }
            | Error::Waiting { reason, .. } => reason,
            Error::Internal(_) => DatabaseReason::InternalError.as_str(),
            Error::Superseded(_) => "Superseded",
            Error::Deferred => "Deferred",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The Database reason of this error. Every reason the controller and the shared
    /// crate give a Database is one (tested below); `InternalError` if one ever is not.
    pub fn database_reason(&self) -> DatabaseReason {
        DatabaseReason::parse(ReconcileError::reason(self)).unwrap_or(DatabaseReason::InternalError)
    }
}

/// A `spec.secretTemplate` that does not render: refused, naming the key.
pub(crate) fn template_error(e: TemplateError) -> Error {
    Error::Blocked {
        reason: DatabaseReason::InvalidSecretTemplate.as_str(),
        message: format!("{e}; nothing was written"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::postgres::tls::TlsFailure;
    use dbops_shared::server::ServerError;

    #[test]
    fn every_reason_a_database_meets_is_a_database_reason() {
        let from_servers = [
            ServerError::NotFound("pg".into()),
            ServerError::Deleting("pg".into()),
            ServerError::NotSynced,
            ServerError::AdminSecretNotFound {
                server: "pg".into(),
                secret: "s".into(),
            },
        ]
        .map(|e| crate::server_access::server_error(e).database_reason());
        let from_tls = [
            TlsFailure::CertificateNotTrusted,
            TlsFailure::HostnameMismatch,
            TlsFailure::ServerWithoutTls,
        ]
        .map(|f| DatabaseReason::parse(f.reason()));
        assert!(from_tls.iter().all(Option::is_some), "{from_tls:?}");
        assert!(
            !from_servers.contains(&DatabaseReason::InternalError),
            "{from_servers:?}"
        );
        // What PostgreSQL, the extensions' and pg_restore's refusals are named.
        for named in [
            "ServerUnreachable",
            "AuthenticationFailed",
            "LockTimeout",
            "StatementTimeout",
            "SqlError",
            "NamespaceNotAllowed",
            "ExtensionNotAllowed",
            "ExtensionNotAvailable",
            "PgRestoreTooOld",
            "PgRestoreTooNew",
        ] {
            assert!(DatabaseReason::parse(named).is_some(), "{named}");
        }
        let internal = Error::Internal("boom".into());
        assert_eq!(internal.database_reason(), DatabaseReason::InternalError);
    }
}
