//! The scheduled Backup to create for a slot (verified when the schedule says so).

use dbops_api::names::annotation::{DATABASE_UID, SCHEDULED_AT};
use dbops_api::names::label::{MANAGED_BY, SCHEDULE_OF};
use dbops_api::{
    Backup, BackupDeletionPolicy, BackupSpec, Database, DatabaseRef, ScheduledBackupsOnDeletion,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use crate::schedule::plan::Take;

/// The scheduled Backup of `db` for the slot `take`: labelled for retention, pinned to
/// the Database's UID, its artifact deleted with it; owned by the Database (garbage
/// collected with it) only when `onDatabaseDeletion` is Delete.
pub fn desired_backup(db: &Database, take: &Take) -> Backup {
    let database = db.name_any();
    let mut annotations = std::collections::BTreeMap::from([
        (SCHEDULED_AT.to_string(), take.slot.to_string()),
        (DATABASE_UID.to_string(), db.uid().unwrap_or_default()),
    ]);
    annotations.extend(creator_trace_context());
    let mut backup = Backup::new(
        &take.name,
        BackupSpec {
            database_ref: DatabaseRef::to(database.clone()),
            deletion_policy: BackupDeletionPolicy::Delete,
            max_retries: 3,
            verify: db.spec.backup.as_ref().is_some_and(|b| b.verify),
        },
    );
    backup.metadata = ObjectMeta {
        name: Some(take.name.clone()),
        namespace: db.namespace(),
        labels: Some(std::collections::BTreeMap::from([
            (SCHEDULE_OF.to_string(), database),
            (MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string()),
        ])),
        annotations: Some(annotations),
        owner_references: deleted_with(db)
            .then(|| database_owner(db))
            .flatten()
            .map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    backup
}

/// Whether the Database's scheduled Backups go with it (`onDatabaseDeletion: Delete`).
pub fn deleted_with(db: &Database) -> bool {
    db.spec
        .backup
        .as_ref()
        .is_some_and(|b| b.on_database_deletion == ScheduledBackupsOnDeletion::Delete)
}

/// The owner reference that makes garbage collection delete a scheduled Backup with its
/// Database; like a CronJob's Jobs, a foreground deletion of the Database waits for them.
pub fn database_owner(db: &Database) -> Option<OwnerReference> {
    db.controller_owner_ref(&()).map(|o| OwnerReference {
        block_owner_deletion: Some(true),
        ..o
    })
}

/// The annotation that carries the creating reconcile's W3C trace context
/// (`dbops.dev/traceparent`) to the Backup, so that its dump continues the scheduler's
/// trace; none when tracing is off.
fn creator_trace_context() -> Option<(String, String)> {
    dbops_shared::telemetry::trace_annotation()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::scheduled::Scheduled;
    use crate::schedule::testing::at;

    fn scheduled_database(on_deletion: Option<&str>) -> Database {
        let mut backup = serde_json::json!({"schedule": "* * * * *"});
        if let Some(policy) = on_deletion {
            backup["onDatabaseDeletion"] = policy.into();
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "ns", "uid": "db-uid"},
            "spec": {"serverRef": {"name": "pg"},
                     "backup": backup}
        }))
        .unwrap()
    }

    fn take() -> Take {
        Take {
            slot: at("2026-11-22T16:03:00Z"),
            name: "orders-202611221603".into(),
            skipped: 0,
        }
    }

    #[test]
    fn the_scheduled_backup_is_labelled_pinned_and_outlives_its_database() {
        let db = scheduled_database(None);
        let take = take();
        let b = desired_backup(&db, &take);
        assert_eq!(b.metadata.name.as_deref(), Some("orders-202611221603"));
        assert_eq!(b.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(b.spec.database_ref.name, "orders");
        assert_eq!(b.spec.deletion_policy, BackupDeletionPolicy::Delete);
        assert!(!b.spec.verify, "not verified unless the schedule says so");
        assert_eq!(
            b.labels().get(SCHEDULE_OF).map(String::as_str),
            Some("orders")
        );
        assert_eq!(
            b.labels()
                .get("app.kubernetes.io/managed-by")
                .map(String::as_str),
            Some("dbops")
        );
        assert_eq!(
            b.annotations().get(SCHEDULED_AT).map(String::as_str),
            Some("2026-11-22T16:03:00Z")
        );
        assert_eq!(
            b.annotations().get(DATABASE_UID).map(String::as_str),
            Some("db-uid")
        );
        assert!(
            b.owner_references().is_empty(),
            "by default a scheduled Backup is not garbage collected with its Database"
        );
        // The plan reads the slot back from the annotation.
        let mut stored = b.clone();
        stored.metadata.uid = Some("b-uid".into());
        let seen = Scheduled::of(&stored, Some("db-uid"));
        assert_eq!(
            (seen.slot, seen.phase, seen.deleting, seen.owned_by_database),
            (take.slot, None, false, false)
        );
    }

    #[test]
    fn with_on_database_deletion_delete_the_scheduled_backup_is_owned() {
        let db = scheduled_database(Some("Delete"));
        let b = desired_backup(&db, &take());
        let owner = &b.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Database", "db-uid")
        );
        assert_eq!(
            (owner.controller, owner.block_owner_deletion),
            (Some(true), Some(true))
        );
        let mut stored = b.clone();
        stored.metadata.uid = Some("b-uid".into());
        assert!(Scheduled::of(&stored, Some("db-uid")).owned_by_database);
        assert!(!Scheduled::of(&stored, Some("other-uid")).owned_by_database);
    }

    #[test]
    fn a_schedule_that_verifies_makes_backups_that_verify() {
        let mut db = scheduled_database(None);
        if let Some(backup) = db.spec.backup.as_mut() {
            backup.verify = true;
        }
        assert!(desired_backup(&db, &take()).spec.verify);
    }
}
