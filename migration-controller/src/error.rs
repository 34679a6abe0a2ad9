//! Why a saga step did not finish, sorted by what happens next.

use std::process::ExitStatus;

use dbops_api::{MigrationReason, ProcessReason, SharedReason};
use dbops_shared::controller::{ErrorKind, ReconcileError, retry_of};
use dbops_shared::pg_tools::is_connection_failure;
use dbops_shared::postgres::PgError;
use dbops_shared::server::ServerError;

/// In the one vocabulary of `dbops_shared::controller::ErrorKind`, decided in one place
/// ([`ReconcileError::kind`]): the Migration reason's class
/// (`dbops_shared::controller::retry_of`). A `Failed` reason is permanent (before
/// SwitchTraffic the saga rolls back at once); a `Retried` one is retried with backoff
/// (counted against the step's attempts unless said otherwise); `Waits` waits for a
/// change (a Database's return wakes its Migrations). The one exception is
/// [`Error::Refused`]: what Preflight refuses for good although a later step would
/// retry it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A step's failure with its reason; what happens next is the reason's class.
    #[error("{message}")]
    Step {
        reason: MigrationReason,
        message: String,
    },
    /// Refused at Preflight, before anything changed, whatever the reason's class: a
    /// server that cannot be used (not found, being deleted, namespace not allowed,
    /// admin or CA Secret missing or invalid), refused credentials or TLS. A later step
    /// retries the same reasons (a Secret rotated mid-Migration); a Migration that has
    /// not started is refused instead, so the user sees it at once.
    #[error("{message}")]
    Refused {
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
    /// A PostgreSQL server failed; counted against the step's attempts.
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
    /// A step's failure with `reason`.
    pub fn step(reason: MigrationReason, message: impl Into<String>) -> Self {
        Error::Step {
            reason,
            message: message.into(),
        }
    }

    /// Refused at Preflight, whatever the class of `reason` ([`Error::Refused`]).
    pub fn refused(reason: MigrationReason, message: impl Into<String>) -> Self {
        Error::Refused {
            reason,
            message: message.into(),
        }
    }

    /// The Migration reason it is shown as; `None` for what is no step's failure (the
    /// API, a stale read), which is retried.
    pub fn migration_reason(&self) -> Option<MigrationReason> {
        match self {
            Error::Step { reason, .. } | Error::Refused { reason, .. } => Some(*reason),
            Error::Postgres(e) => Some(reason_of(e.reason())),
            Error::Server(e) => Some(reason_of(e.reason())),
            Error::Copy(e) => Some(e.reason()),
            Error::DatabasesNotSynced => Some(MigrationReason::CacheNotSynced),
            Error::Stale | Error::Kube(_) => None,
        }
    }

    /// The reason a rollback records for it: its own, or `StepFailed` for what has none
    /// (the API, which never ends a step).
    pub fn rollback_reason(&self) -> MigrationReason {
        self.migration_reason()
            .unwrap_or(MigrationReason::StepFailed)
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
        match (self, self.migration_reason()) {
            (Error::Refused { .. }, _) => ErrorKind::Permanent,
            (_, Some(reason)) => retry_of(reason.class()),
            (_, None) => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) | Error::Stale => ProcessReason::KubernetesApiError.as_str(),
            _ => self
                .migration_reason()
                .map_or("InternalError", MigrationReason::as_str),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The Migration reason of a reason the shared crate gives (a server's error, TLS, a
/// client program's or an extension's refusal): each of them is one (tested below);
/// `InternalError` if one ever is not.
pub fn reason_of(shared: SharedReason) -> MigrationReason {
    shared.to().unwrap_or(MigrationReason::InternalError)
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
        for r in SharedReason::ALL {
            assert_eq!(reason_of(*r).as_str(), r.as_str());
        }
    }

    /// The kind is the reason's class: a `Failed` reason is permanent (the saga rolls
    /// back), a `Retried` one transient; only Preflight's refusals are permanent
    /// whatever their class.
    #[test]
    fn the_kind_is_the_reasons_class_but_for_preflights_refusals() {
        for r in MigrationReason::ALL {
            let e = Error::step(*r, "m");
            assert_eq!(e.kind(), retry_of(r.class()), "{r}");
            assert_eq!(e.reason(), r.as_str());
            assert_eq!(Error::refused(*r, "m").kind(), ErrorKind::Permanent, "{r}");
        }
        assert_eq!(
            Error::step(MigrationReason::VerifyFailed, "m").kind(),
            ErrorKind::Permanent
        );
        assert_eq!(
            Error::step(MigrationReason::SessionsRemain, "m").kind(),
            ErrorKind::Transient
        );
        let missing = Error::from(ServerError::NotFound("pg-17".into()));
        assert_eq!(missing.kind(), ErrorKind::Transient);
        assert_eq!(Error::Stale.kind(), ErrorKind::Transient);
        assert_eq!(Error::DatabasesNotSynced.kind(), ErrorKind::Transient);
    }
}
