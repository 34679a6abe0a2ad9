//! Why a Database or DatabaseUser reconcile did not converge, and what happens next.
//!
//! Every failure carries a typed reason ([`Why`]); the reason's class alone decides
//! whether the controller retries with backoff (`dbops_shared::controller::retry_of`,
//! the rule of every controller), so the status it shows (`Retrying`, a step on the
//! way, or waiting for a change) and what it does agree.

use dbops_api::reasons::{DatabaseReason, DatabaseUserReason, Reason, ReasonClass, SharedReason};
use dbops_shared::controller::{ErrorKind, ReconcileError, retry_of};
use dbops_shared::postgres::PgError;

use crate::template::TemplateError;

/// The reason a failure is shown as: the Database's, or the DatabaseUser's when the
/// user controller raised it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    Database(DatabaseReason),
    User(DatabaseUserReason),
}

impl Why {
    /// The CamelCase string written in status.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Database(r) => r.as_str(),
            Why::User(r) => r.as_str(),
        }
    }

    /// How the controllers treat it.
    pub fn class(self) -> ReasonClass {
        match self {
            Why::Database(r) => r.class(),
            Why::User(r) => r.class(),
        }
    }

    /// A reason of the shared crate as the Database's (every one a Database meets is
    /// one, tested below); `InternalError` if one ever is not.
    pub fn shared(reason: SharedReason) -> Self {
        Why::Database(reason.to().unwrap_or(DatabaseReason::InternalError))
    }
}

impl From<DatabaseReason> for Why {
    fn from(r: DatabaseReason) -> Self {
        Why::Database(r)
    }
}

impl From<DatabaseUserReason> for Why {
    fn from(r: DatabaseUserReason) -> Self {
        Why::User(r)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `KubernetesApiError`.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The reason [`PgError::reason`] names.
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// Reported in status with its reason.
    #[error("{message}")]
    Reported { reason: Why, message: String },
    /// Reported in status; looked at again after `again` as well as on a change: a step
    /// that waits its turn (a clone's queue, its source becoming Ready).
    #[error("{message}")]
    Waiting {
        reason: Why,
        message: String,
        again: std::time::Duration,
    },
    /// `InternalError`.
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

impl Error {
    /// A failure shown with `reason`; what happens next is its class's.
    pub fn reported(reason: impl Into<Why>, message: impl Into<String>) -> Self {
        Error::Reported {
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// The reason this error is shown as; `None` for the two that are no status
    /// (a superseded reconcile, a routine check put off).
    pub fn why(&self) -> Option<Why> {
        Some(match self {
            Error::Kube(_) => Why::Database(DatabaseReason::KubernetesApiError),
            Error::Postgres(e) => Why::shared(e.reason()),
            Error::Reported { reason, .. } | Error::Waiting { reason, .. } => *reason,
            Error::Internal(_) => Why::Database(DatabaseReason::InternalError),
            Error::Superseded(_) | Error::Deferred => return None,
        })
    }

    /// The Database reason of this error. Every reason the controller and the shared
    /// crate give a Database is one (tested below); `InternalError` if one ever is not.
    pub fn database_reason(&self) -> DatabaseReason {
        match self.why() {
            Some(Why::Database(r)) => r,
            Some(Why::User(r)) => r.to().unwrap_or(DatabaseReason::InternalError),
            None => DatabaseReason::InternalError,
        }
    }

    /// The DatabaseUser reason of this error (a Database's reason the user shares, or
    /// `InternalError`).
    pub fn user_reason(&self) -> DatabaseUserReason {
        match self.why() {
            Some(Why::User(r)) => r,
            Some(Why::Database(r)) => r.to().unwrap_or(DatabaseUserReason::InternalError),
            None => DatabaseUserReason::InternalError,
        }
    }
}

impl ReconcileError for Error {
    /// The one place that decides: the reason's class, by the rule of every controller
    /// ([`retry_of`]). A superseded reconcile is read again; a routine check put off
    /// waits for the resync (the reconcile returns before this is asked).
    fn kind(&self) -> ErrorKind {
        match self.why() {
            Some(why) => retry_of(why.class()),
            None => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Superseded(_) => "Superseded",
            Error::Deferred => "Deferred",
            _ => self.why().map_or("InternalError", Why::as_str),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A `spec.secretTemplate` that does not render: refused, naming the key.
pub(crate) fn template_error(e: TemplateError) -> Error {
    Error::reported(
        DatabaseReason::InvalidSecretTemplate,
        format!("{e}; nothing was written"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert!(
            !from_servers.contains(&DatabaseReason::InternalError),
            "{from_servers:?}"
        );
        // Every reason of the shared crate but the pick of a pg_dump, which the
        // database-controller never makes (a clone's programs are its own reason).
        for r in SharedReason::ALL {
            if *r != SharedReason::PgDumpTooOld {
                assert!(r.to::<DatabaseReason>().is_some(), "{r}");
            }
        }
        let internal = Error::Internal("boom".into());
        assert_eq!(internal.database_reason(), DatabaseReason::InternalError);
    }

    /// The retry is the class's, for every reason of both kinds; the reasons whose
    /// class said "waits" while the controller retried them are `Retried` now, and the
    /// steps on the way wait for the change that ends them.
    #[test]
    fn the_retry_is_the_reasons_class() {
        for r in DatabaseReason::ALL {
            let e = Error::reported(*r, "m");
            assert_eq!(e.kind(), retry_of(r.class()), "{r}");
            assert_eq!(e.database_reason(), *r);
            assert_eq!(ReconcileError::reason(&e), r.as_str());
        }
        for r in DatabaseUserReason::ALL {
            let e = Error::reported(*r, "m");
            assert_eq!(e.kind(), retry_of(r.class()), "{r}");
            assert_eq!(e.user_reason(), *r);
        }
        use DatabaseReason as R;
        use ErrorKind::{Permanent, Transient};
        let expected = [
            (R::KubernetesApiError, Transient),
            (R::AuthenticationFailed, Transient),
            (R::RoleBindingConflict, Transient),
            (R::InternalError, Transient),
            (R::StoreUnavailable, Transient),
            (R::NamespaceNotAllowed, Permanent),
            (R::Cloning, Permanent),
            (R::Restoring, Permanent),
            (R::WaitingForFinalBackup, Permanent),
            (R::AdminLacksPrivilege, Permanent),
            (R::DatabaseMissing, Permanent),
        ];
        for (r, kind) in expected {
            assert_eq!(Error::reported(r, "m").kind(), kind, "{r}");
        }
        assert_eq!(Error::Internal("x".into()).kind(), ErrorKind::Transient);
        assert_eq!(Error::Superseded("x".into()).kind(), ErrorKind::Transient);
        assert_eq!(ReconcileError::reason(&Error::Deferred), "Deferred");
        assert_eq!(Error::Deferred.why(), None);
    }
}
