//! Why a saga step did not finish, sorted by what happens next.

use std::process::ExitStatus;

use dbops_api::{MigrationReason, ProcessReason};
use dbops_shared::controller::{ErrorKind, ReconcileError};
use dbops_shared::pg_tools::is_connection_failure;
use dbops_shared::postgres::PgError;
use dbops_shared::server::ServerError;

/// In the one vocabulary of `dbops_shared::controller::ErrorKind`: [`Error::Permanent`]
/// (before SwitchTraffic the saga rolls back at once), every other kind transient
/// (retried with backoff; counted against the step's attempts unless said otherwise).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The step cannot succeed as things are (a name conflict, an older target, a failed
    /// snapshot, a mismatch after the copy): the saga rolls back at once.
    #[error("{message}")]
    Permanent {
        reason: MigrationReason,
        message: String,
    },
    /// Something that retrying may cure and that fits no other kind.
    #[error("{message}")]
    Transient {
        reason: MigrationReason,
        message: String,
    },
    /// The cache of Databases Preflight counts for the target's quota did not fill in
    /// time: retried, and (unlike the servers' caches) counted against the attempts.
    #[error("the cache of Databases has not synced yet")]
    DatabasesNotSynced,
    /// A DatabaseServer of the Migration cannot be used (not found, namespace not allowed,
    /// admin or CA Secret missing or invalid): counted against the step's attempts like a
    /// server failure, and refused for good at Preflight (`steps::preflight`). The
    /// caches not synced yet (`CacheNotSynced`) is only retried with backoff.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// A PostgreSQL server failed; retried, and counted against the step's attempts.
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// pg_dump or pg_restore failed; retried, and counted against the step's attempts.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// The Migration changed since this reconcile read it (or is gone): its status is not
    /// written over a newer one. Retried with backoff from a fresh read; it never counts
    /// against a step's attempts.
    #[error("the Migration changed since it was read; reading it again")]
    Stale,
    /// The Kubernetes API failed or refused a write (a 409 means our view was stale):
    /// retried with backoff, and it never counts against a step's attempts.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

impl Error {
    pub fn permanent(reason: MigrationReason, message: impl Into<String>) -> Self {
        Error::Permanent {
            reason,
            message: message.into(),
        }
    }

    pub fn transient(reason: MigrationReason, message: impl Into<String>) -> Self {
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
            Error::Kube(_) | Error::Stale => false,
            Error::Server(e) => !e.is_transient(),
            _ => true,
        }
    }
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Permanent { .. } => ErrorKind::Permanent,
            _ => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) | Error::Stale => ProcessReason::KubernetesApiError.as_str(),
            Error::DatabasesNotSynced => ServerError::NotSynced.reason(),
            Error::Postgres(e) => e.reason(),
            Error::Server(e) => e.reason(),
            Error::Copy(e) => e.reason().as_str(),
            Error::Permanent { reason, .. } | Error::Transient { reason, .. } => reason.as_str(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The Migration reason of a failure the shared crate names (a server's error, TLS, a
/// client program's or an extension's refusal): each of them is one (tested below);
/// `InternalError` if one ever is not.
pub fn reason_of(text: &str) -> MigrationReason {
    MigrationReason::parse(text).unwrap_or(MigrationReason::InternalError)
}

/// Why the copy (`dump::pipe`: pg_dump into pg_restore) failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("could not run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} failed ({status}): {stderr}")]
    Failed {
        program: &'static str,
        status: ExitStatus,
        stderr: String,
    },
    #[error("waiting for {program}: {source}")]
    Wait {
        program: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl CopyError {
    /// The condition reason.
    pub fn reason(&self) -> MigrationReason {
        match self {
            CopyError::Failed { stderr, .. } if is_connection_failure(stderr) => {
                MigrationReason::ServerUnreachable
            }
            CopyError::Failed {
                program: "pg_dump", ..
            } => MigrationReason::DumpFailed,
            CopyError::Failed { .. } => MigrationReason::RestoreFailed,
            CopyError::Spawn { .. } | CopyError::Wait { .. } => MigrationReason::CopyFailed,
        }
    }
}

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

    #[test]
    fn every_reason_the_shared_crate_gives_a_migration_is_a_migration_reason() {
        use dbops_shared::postgres::tls::TlsFailure;
        let servers = [
            ServerError::NotFound("pg".into()),
            ServerError::Deleting("pg".into()),
            ServerError::NamespaceNotAllowed {
                server: "pg".into(),
                namespace: "shop".into(),
                detail: "labels".into(),
            },
            ServerError::AdminSecretNotFound {
                server: "pg".into(),
                secret: "s".into(),
            },
        ];
        let tls = [
            TlsFailure::CertificateNotTrusted,
            TlsFailure::HostnameMismatch,
            TlsFailure::ServerWithoutTls,
        ];
        let named = [
            "ServerUnreachable",
            "AuthenticationFailed",
            "LockTimeout",
            "StatementTimeout",
            "SqlError",
            "AdminSecretInvalid",
            "CASecretNotFound",
            "CASecretInvalid",
            "ExtensionNotAllowed",
            "ExtensionNotAvailable",
            "PgDumpTooOld",
            "PgRestoreTooOld",
            "PgRestoreTooNew",
        ];
        let texts = servers
            .iter()
            .map(ServerError::reason)
            .chain(tls.into_iter().map(TlsFailure::reason))
            .chain(named);
        for text in texts {
            assert_eq!(reason_of(text).as_str(), text);
        }
        assert_eq!(reason_of("NoSuchReason"), MigrationReason::InternalError);
    }
}
