//! Why a Backup reconcile or one attempt at a Backup did not succeed, in the shared
//! vocabulary of permanent or retry ([`ErrorKind`]) and the Backup's typed reasons
//! ([`BackupReason`]).

use dbops_api::reasons::{BackupReason, ProcessReason, SharedReason};
use dbops_shared::backup_store::StoreError;
use dbops_shared::controller::{ErrorKind, ReconcileError, retry_of};
use dbops_shared::postgres::PgError;

use crate::dump::DumpError;

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
            Error::Store(e) => retry_of(store_reason(e).class()),
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => ProcessReason::KubernetesApiError.as_str(),
            Error::Store(e) => store_reason(e).as_str(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why one attempt produced no artifact: a reason and a message for humans (never a
/// secret). Whether retrying can help is the reason's class
/// (`dbops_shared::controller::retry_of`): a `Failed` reason fails the Backup at once, a
/// `Retried` one is retried up to `maxRetries`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: BackupReason,
    pub message: String,
}

impl Failure {
    pub fn new(reason: BackupReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }

    /// What happens next, from the reason's class alone.
    pub fn kind(&self) -> ErrorKind {
        retry_of(self.reason.class())
    }

    pub fn is_permanent(&self) -> bool {
        self.kind() == ErrorKind::Permanent
    }
}

/// The Backup reason of a reason of the shared crate (a server's, PostgreSQL's, the
/// pick of a pg_dump): every one the backup-controller meets is a [`BackupReason`] (the
/// tests below hold them); another would be reported as `otherwise`.
pub fn backup_reason(shared: SharedReason, otherwise: BackupReason) -> BackupReason {
    shared.to().unwrap_or_else(|| {
        tracing::warn!(
            reason = shared.as_str(),
            "not a Backup condition reason; reported as {otherwise}"
        );
        otherwise
    })
}

fn store_reason(e: &StoreError) -> BackupReason {
    match e {
        StoreError::Io { .. } | StoreError::Remote { .. } => BackupReason::StoreUnavailable,
        StoreError::Refused { .. } => BackupReason::StoreRefused,
        StoreError::Misconfigured { .. } => BackupReason::StoreMisconfigured,
        StoreError::NotFound(_) => BackupReason::ArtifactNotFound,
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Self::new(store_reason(&e), e.to_string())
    }
}

/// Authentication, TLS and a right the admin lacks fail the Backup at once (their class
/// is `Failed`); the rest are retried.
impl From<PgError> for Failure {
    fn from(e: PgError) -> Self {
        Self::new(
            backup_reason(e.reason(), BackupReason::SqlError),
            e.to_string(),
        )
    }
}

impl From<DumpError> for Failure {
    fn from(e: DumpError) -> Self {
        match e {
            DumpError::Store(e) => e.into(),
            e => Self::new(e.reason(), e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::server::ServerError;

    #[test]
    fn the_shared_reasons_a_backup_meets_are_backup_reasons() {
        let server = [ServerError::NotFound("pg".into()), ServerError::NotSynced];
        for e in server {
            assert!(e.reason().to::<BackupReason>().is_some(), "{}", e.reason());
        }
        let met = [
            SharedReason::CertificateNotTrusted,
            SharedReason::HostnameMismatch,
            SharedReason::ServerWithoutTLS,
            SharedReason::ServerUnreachable,
            SharedReason::AuthenticationFailed,
            SharedReason::LockTimeout,
            SharedReason::StatementTimeout,
            SharedReason::SqlError,
            SharedReason::AdminLacksPrivilege,
            SharedReason::PgDumpTooOld,
            SharedReason::AdminSecretNotFound,
            SharedReason::AdminSecretInvalid,
            SharedReason::CASecretNotFound,
            SharedReason::CASecretInvalid,
            SharedReason::CacheNotSynced,
        ];
        for r in met {
            assert_eq!(
                backup_reason(r, BackupReason::DumpFailed).as_str(),
                r.as_str()
            );
        }
        assert_eq!(
            backup_reason(SharedReason::NamespaceNotAllowed, BackupReason::DumpFailed),
            BackupReason::DumpFailed
        );
    }

    /// A failure fails the Backup at once exactly when its reason's class is `Failed`
    /// (authentication, TLS, a right the admin lacks, a store that refuses), and is
    /// retried when it is `Retried`.
    #[test]
    fn a_failures_fate_is_its_reasons_class() {
        for r in BackupReason::ALL {
            let f = Failure::new(*r, "m");
            assert_eq!(
                f.is_permanent(),
                r.class() != dbops_api::ReasonClass::Retried,
                "{r}"
            );
        }
        for permanent in [
            BackupReason::AuthenticationFailed,
            BackupReason::ServerWithoutTLS,
            BackupReason::AdminLacksPrivilege,
            BackupReason::StoreRefused,
            BackupReason::PgDumpTooOld,
            BackupReason::DatabaseNotFound,
        ] {
            assert!(Failure::new(permanent, "m").is_permanent(), "{permanent}");
        }
        for retried in [
            BackupReason::ServerUnreachable,
            BackupReason::StoreUnavailable,
            BackupReason::ServerNotFound,
            BackupReason::ClientProgramFailed,
        ] {
            assert!(!Failure::new(retried, "m").is_permanent(), "{retried}");
        }
    }
}
