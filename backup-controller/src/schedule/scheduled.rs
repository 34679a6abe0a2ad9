//! A Database's scheduled Backups as the plan sees them, read from the reflector store.

use dbops_api::names::annotation::{DATABASE_UID, SCHEDULED_AT};
use dbops_api::names::label::SCHEDULE_OF;
use dbops_api::{Backup, BackupPhase, Database};
use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

/// A scheduled Backup as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    pub name: String,
    pub uid: String,
    /// Its slot ([`SCHEDULED_AT`]), or its creation time when the annotation is missing.
    pub slot: Timestamp,
    pub phase: Option<BackupPhase>,
    /// Its deletion has started.
    pub deleting: bool,
    /// It has an owner reference to the Database (garbage collected with it).
    pub owned_by_database: bool,
}

impl Scheduled {
    pub fn of(backup: &Backup, database_uid: Option<&str>) -> Self {
        let slot = backup
            .annotations()
            .get(SCHEDULED_AT)
            .and_then(|s| s.parse::<Timestamp>().ok())
            .or_else(|| backup.creation_timestamp().map(|t| t.0))
            .unwrap_or(Timestamp::UNIX_EPOCH);
        Self {
            name: backup.name_any(),
            uid: backup.uid().unwrap_or_default(),
            slot,
            phase: backup.status.as_ref().and_then(|s| s.phase),
            deleting: backup.metadata.deletion_timestamp.is_some(),
            owned_by_database: database_uid
                .is_some_and(|uid| backup.owner_references().iter().any(|o| o.uid == uid)),
        }
    }

    pub fn finished(&self) -> bool {
        matches!(
            self.phase,
            Some(BackupPhase::Completed | BackupPhase::Failed)
        )
    }
}

/// The scheduled Backups of `db` in the store: the label names it and the annotation
/// `dbops.dev/database-uid` (or an owner reference) carries its UID; a Backup of an
/// earlier Database of the same name is not this one's.
pub fn scheduled_backups(store: &Store<Backup>, db: &Database) -> Vec<Scheduled> {
    let namespace = db.namespace();
    let name = db.name_any();
    let uid = db.uid();
    store
        .state()
        .iter()
        .filter(|b| b.namespace() == namespace)
        .filter(|b| b.labels().get(SCHEDULE_OF) == Some(&name))
        .filter(|b| {
            b.annotations().get(DATABASE_UID) == uid.as_ref()
                || b.owner_references()
                    .iter()
                    .any(|o| Some(&o.uid) == uid.as_ref())
        })
        .map(|b| Scheduled::of(b, uid.as_deref()))
        .collect()
}
