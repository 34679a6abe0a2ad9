//! The Database a Backup refers to (same namespace), and whether pg_dump can dump it now.

use dbops_api::names::{annotation, label};
use dbops_api::reasons::BackupReason;
use dbops_api::{Backup, Database, DatabaseDeletionPolicy, condition};
use dbops_shared::controller::Context;
use kube::ResourceExt;
use kube::api::Api;

use crate::error::{Failure, Result};
use crate::state::State;

/// What became of the Database a Backup refers to.
pub enum Dereferenced {
    Ready(Box<Database>),
    /// It does not exist: the Backup fails at once.
    Missing(Failure),
    /// It exists and is not Ready: the Backup waits.
    NotReady(String),
}

/// The Database to back up (same namespace), if it exists and is Ready.
pub async fn dereference(backup: &Backup, ctx: &Context<State>) -> Result<Dereferenced> {
    let namespace = backup.namespace().unwrap_or_default();
    let name = &backup.spec.database_ref.name;
    let databases: Api<Database> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(db) = databases.get_opt(name).await? else {
        return Ok(Dereferenced::Missing(Failure::new(
            BackupReason::DatabaseNotFound,
            format!("Database {namespace}/{name} does not exist"),
        )));
    };
    if let Some(wanted) = backup.annotations().get(annotation::DATABASE_UID)
        && db.uid().as_ref() != Some(wanted)
    {
        return Ok(Dereferenced::Missing(Failure::new(
            BackupReason::DatabaseReplaced,
            format!(
                "Backup is for the Database {namespace}/{name} with UID {wanted}, but the Database of that name now has UID {}: it was deleted and created again, and is not dumped in its place",
                db.uid().unwrap_or_default()
            ),
        )));
    }
    let final_snapshot = db
        .uid()
        .is_some_and(|uid| backup.labels().get(label::FINAL_SNAPSHOT_OF) == Some(&uid));
    Ok(if can_be_dumped(&db, final_snapshot) {
        Dereferenced::Ready(Box::new(db))
    } else {
        Dereferenced::NotReady(format!(
            "waiting for Database {namespace}/{name} to be Ready"
        ))
    })
}

/// Whether the Database's database exists in PostgreSQL for pg_dump: it is Ready, or it
/// is being deleted with `deletionPolicy: Snapshot` (its controller reports
/// Ready=False/Deleting then, and keeps the database until the final Backup is Ready)
/// after it was provisioned, or at all when this Backup is its final snapshot: the
/// database-controller asks for one only when the server holds a whole database of that
/// Database's, even one whose provisioning it never recorded.
fn can_be_dumped(db: &Database, final_snapshot: bool) -> bool {
    let Some(status) = db.status.as_ref() else {
        return false;
    };
    let ready = dbops_shared::conditions::is_true(&status.conditions, condition::READY);
    let awaiting_final_snapshot = db.metadata.deletion_timestamp.is_some()
        && db.spec.deletion_policy == DatabaseDeletionPolicy::Snapshot
        && (status.provider_id.is_some() || final_snapshot);
    ready || awaiting_final_snapshot
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn database(policy: &str, deleting: bool, ready: &str, provisioned: bool) -> Database {
        let mut db: Database = serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "ns"},
            "spec": {"serverRef": {"name": "pg"}, "deletionPolicy": policy},
            "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "X",
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        }))
        .unwrap();
        if deleting {
            db.metadata.deletion_timestamp = Some(dbops_shared::conditions::now());
        }
        if provisioned && let Some(s) = db.status.as_mut() {
            s.provider_id = Some("h:5432/1".into());
        }
        db
    }

    #[test]
    fn a_ready_database_or_one_awaiting_its_final_snapshot_can_be_dumped() {
        // (deletionPolicy, being deleted, Ready, provisioning recorded, a final snapshot
        // asked for, can be dumped)
        for (policy, deleting, ready, provisioned, final_snapshot, dumped) in [
            ("Retain", false, "True", true, false, true),
            ("Retain", false, "False", true, false, false),
            ("Snapshot", true, "False", true, false, true),
            ("Snapshot", true, "False", false, false, false),
            ("Delete", true, "False", true, false, false),
            // Its final snapshot is dumped even when its provisioning was never recorded
            // (the database-controller asks for one only when the database is whole)...
            ("Snapshot", true, "False", false, true, true),
            // ...and only while it is being deleted with that policy.
            ("Snapshot", false, "False", false, true, false),
            ("Delete", true, "False", false, true, false),
        ] {
            let db = database(policy, deleting, ready, provisioned);
            assert_eq!(
                can_be_dumped(&db, final_snapshot),
                dumped,
                "{policy}, deleting {deleting}, Ready={ready}, provisioned {provisioned}, \
                 final snapshot {final_snapshot}"
            );
        }
    }
}
