//! Why a scheduler reconcile did not finish, and the Database names it refuses.

use std::time::Duration;

use dbops_api::reasons::ProcessReason;
use dbops_shared::controller::{ErrorKind, ReconcileError, retry_of};

use dbops_api::names::label::SCHEDULE_OF;

/// The longest Database name a schedule accepts: it is the value of the label
/// [`SCHEDULE_OF`], and label values have at most 63 characters.
pub const MAX_DATABASE_NAME: usize = 63;
/// The longest object name (a DNS subdomain).
pub const MAX_OBJECT_NAME: usize = 253;
/// How long a reconcile waits for the store of scheduled Backups to sync first.
pub const STORE_SYNC: Duration = Duration::from_secs(30);

/// Why a scheduler reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("spec.backup.schedule {schedule:?}: {reason}")]
    InvalidSchedule { schedule: String, reason: String },
    #[error(
        "Database name {name:?} is {len} characters long; scheduled backups need at most {MAX_DATABASE_NAME} (it is the value of the label {SCHEDULE_OF})"
    )]
    NameTooLong { name: String, len: usize },
    #[error("the store of scheduled Backups has not synced within {STORE_SYNC:?}")]
    StoreNotSynced,
}

impl Error {
    /// The reason it is shown as (an Event, the metrics).
    pub fn why(&self) -> ProcessReason {
        match self {
            Error::Kube(_) => ProcessReason::KubernetesApiError,
            Error::InvalidSchedule { .. } => ProcessReason::InvalidSchedule,
            Error::NameTooLong { .. } => ProcessReason::NameTooLong,
            Error::StoreNotSynced => ProcessReason::StoreNotSynced,
        }
    }
}

impl ReconcileError for Error {
    /// The reason's class: a schedule that does not parse or a name too long waits for
    /// the Database to change; the API and the store's sync are retried.
    fn kind(&self) -> ErrorKind {
        retry_of(self.why().class())
    }

    fn reason(&self) -> &'static str {
        self.why().as_str()
    }
}

/// Whether `database` can name scheduled Backups: it is the value of the label
/// [`SCHEDULE_OF`], and `<database>-<YYYYMMDDHHMM>` must be an object name.
pub fn check_name(database: &str) -> Result<(), Error> {
    let len = database.len();
    if len > MAX_DATABASE_NAME || len + "-YYYYMMDDHHMM".len() > MAX_OBJECT_NAME {
        return Err(Error::NameTooLong {
            name: database.to_string(),
            len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_database_names_are_refused() {
        assert!(check_name(&"a".repeat(63)).is_ok());
        let error = check_name(&"a".repeat(64)).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert!(error.to_string().contains("64 characters"), "{error}");
    }
}
