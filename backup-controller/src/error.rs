//! Why a Backup reconcile or one attempt at a Backup did not succeed, in the shared
//! vocabulary of permanent or retry ([`ErrorKind`]) and the Backup's typed reasons
//! ([`BackupReason`]).

use dbops_api::reasons::{BackupReason, ProcessReason};
use dbops_shared::backup_store::StoreError;
use dbops_shared::controller::{ErrorKind, ReconcileError};
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
            Error::Store(e) => store_kind(e),
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

/// Why one attempt produced no artifact: a reason, a message for humans (never a
/// secret), and whether retrying can help: a [`ErrorKind::Permanent`] failure fails the
/// Backup at once, a [`ErrorKind::Transient`] one is retried up to `maxRetries`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: BackupReason,
    pub message: String,
    pub kind: ErrorKind,
}

impl Failure {
    pub fn transient(reason: BackupReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            kind: ErrorKind::Transient,
        }
    }

    pub fn permanent(reason: BackupReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            kind: ErrorKind::Permanent,
        }
    }

    pub fn is_permanent(&self) -> bool {
        self.kind == ErrorKind::Permanent
    }
}

/// The Backup reason a reason of the shared crate names (a server's, PostgreSQL's, the
/// pick of a pg_dump): every one the backup-controller meets is a [`BackupReason`] (the
/// tests below hold them); another would be reported as `otherwise`.
pub fn backup_reason(text: &'static str, otherwise: BackupReason) -> BackupReason {
    BackupReason::parse(text).unwrap_or_else(|| {
        tracing::warn!(
            reason = text,
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

fn store_kind(e: &StoreError) -> ErrorKind {
    if e.is_transient() {
        ErrorKind::Transient
    } else {
        ErrorKind::Permanent
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Self {
            reason: store_reason(&e),
            message: e.to_string(),
            kind: store_kind(&e),
        }
    }
}

impl From<PgError> for Failure {
    fn from(e: PgError) -> Self {
        let kind = match e {
            PgError::AuthenticationFailed { .. } | PgError::Tls { .. } => ErrorKind::Permanent,
            _ if e.reason() == BackupReason::AdminLacksPrivilege.as_str() => ErrorKind::Permanent,
            _ => ErrorKind::Transient,
        };
        Self {
            reason: backup_reason(e.reason(), BackupReason::SqlError),
            message: e.to_string(),
            kind,
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
                kind: if e.is_permanent() {
                    ErrorKind::Permanent
                } else {
                    ErrorKind::Transient
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::postgres::tls::TlsFailure;
    use dbops_shared::server::ServerError;

    #[test]
    fn the_shared_reasons_a_backup_meets_are_backup_reasons() {
        let server = [ServerError::NotFound("pg".into()), ServerError::NotSynced];
        for e in server {
            assert!(BackupReason::parse(e.reason()).is_some(), "{}", e.reason());
        }
        for tls in [
            TlsFailure::CertificateNotTrusted,
            TlsFailure::HostnameMismatch,
            TlsFailure::ServerWithoutTls,
        ] {
            assert_eq!(
                backup_reason(tls.reason(), BackupReason::SqlError).as_str(),
                tls.reason()
            );
        }
        for text in [
            "ServerUnreachable",
            "AuthenticationFailed",
            "LockTimeout",
            "StatementTimeout",
            "SqlError",
            "PgDumpTooOld",
            "AdminSecretNotFound",
            "AdminSecretInvalid",
            "CASecretNotFound",
            "CASecretInvalid",
            "CacheNotSynced",
        ] {
            assert_eq!(backup_reason(text, BackupReason::DumpFailed).as_str(), text);
        }
        assert_eq!(
            backup_reason("Elsewhere", BackupReason::DumpFailed),
            BackupReason::DumpFailed
        );
    }
}
