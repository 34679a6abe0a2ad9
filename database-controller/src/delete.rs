//! Deletion of a Database: what its `deletionPolicy` asks for in PostgreSQL (`Retain`:
//! nothing; `Delete`: drop the database and role it made; `Snapshot`: a final Backup, then
//! drop), then the finalizer goes. Separate from provisioning (`provision`): `reconcile`
//! calls [`cleanup`] once the Database has a `deletionTimestamp`.

use dbops_api::reasons::DatabaseReason;
use dbops_api::{Backup, Database, DatabaseDeletionPolicy};
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use dbops_shared::status::Note;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::controller::Action;
use serde_json::json;

use crate::error::{Error, Result};
use crate::finalizer::{has_finalizer, remove_finalizer};
use crate::server_access::{admin_session, server_error, server_of};
use crate::state::State;
use crate::{sql, status};

/// Deletion: what the policy asks for in PostgreSQL, then the finalizer goes.
pub(crate) async fn cleanup(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    migration: Option<&str>,
) -> Result<Action> {
    ctx.state.verified.forget(&db.uid().unwrap_or_default());
    if !has_finalizer(db) {
        return Ok(Action::await_change());
    }
    if let Some(migration) = migration {
        let waiting = Error::Reported {
            reason: DatabaseReason::MigrationInProgress.into(),
            message: format!(
                "deletion waits for Migration {migration} to end: it rolls back if it has not switched the server yet, and finishes if it has"
            ),
        };
        status::publish_deleting(db, ctx, api, &waiting).await?;
        return Ok(Action::requeue(ctx.resync_interval));
    }
    let namespace = db.namespace().unwrap_or_default();
    ctx.state.directory.synced().await.map_err(server_error)?;
    let mut note = deleted_note(db);
    let outcome = match db.spec.deletion_policy {
        DatabaseDeletionPolicy::Retain => Ok(()),
        DatabaseDeletionPolicy::Delete => drop_owned(db, ctx).await,
        // No Backup can be created in a namespace being deleted: the database is kept,
        // as Retain would, never dropped without its final snapshot, and the platform team
        // hears of it on the DatabaseServer.
        DatabaseDeletionPolicy::Snapshot
            if ctx.state.directory.namespace_terminating(&namespace) =>
        {
            note = kept_unsnapshotted(db, ctx).await;
            Ok(())
        }
        // Deleted before it was ever provisioned: nothing of its own to snapshot (the
        // backup-controller dumps only a provisioned database), so what it made is dropped.
        DatabaseDeletionPolicy::Snapshot if nothing_to_snapshot(db, ctx).await? => {
            note = format!(
                "database {} was never provisioned: no final Backup (nothing of its own to keep); what it had made is dropped",
                db.database_name()
            );
            drop_owned(db, ctx).await
        }
        DatabaseDeletionPolicy::Snapshot => match final_snapshot(db, ctx).await {
            Ok(()) => drop_owned(db, ctx).await,
            Err(Error::Kube(kube::Error::Api(e)))
                if e.code == 403 && e.message.contains("being terminated") =>
            {
                note = kept_unsnapshotted(db, ctx).await;
                Ok(())
            }
            Err(e) => Err(e),
        },
    };
    match outcome {
        Ok(()) => {
            remove_finalizer(db, api).await?;
            ctx.state.statuses.forget(&db.uid().unwrap_or_default());
            status::event(ctx, db, true, "Deleted", &note).await;
            Ok(Action::await_change())
        }
        Err(e) => {
            status::publish_deleting(db, ctx, api, &e).await?;
            // Nothing to retry until something changes (the reason's class says): the
            // watches and the resync notice.
            match e.kind() {
                ErrorKind::Permanent => Ok(Action::requeue(ctx.resync_interval)),
                ErrorKind::Transient => Err(e),
            }
        }
    }
}

fn deleted_note(db: &Database) -> String {
    match db.spec.deletion_policy {
        DatabaseDeletionPolicy::Retain => {
            format!("database {} retained in PostgreSQL", db.database_name())
        }
        _ => format!(
            "database {} and role {} dropped",
            db.database_name(),
            db.owner_role()
        ),
    }
}

/// A Snapshot-policy Database deleted with its namespace: its database is kept, and a
/// Warning Event on its DatabaseServer says so (the namespace and its Events are going).
async fn kept_unsnapshotted(db: &Database, ctx: &Context<State>) -> String {
    let note = format!(
        "Database {}/{} (deletionPolicy Snapshot) was deleted with its namespace, where no final Backup can be made: database {} and role {} are kept on the server (drop them by hand once they are not needed)",
        db.namespace().unwrap_or_default(),
        db.name_any(),
        db.database_name(),
        db.owner_role()
    );
    if let Some(server) = ctx.state.directory.get(&db.spec.server_ref.name) {
        let event = Note::warning("Delete", "KeptWithoutFinalSnapshot", note.clone());
        dbops_shared::status::announce(&ctx.state.recorder, server.as_ref(), &event).await;
    }
    tracing::warn!(database = db.database_name(), "{note}");
    note
}

/// Whether a Snapshot-policy Database being deleted holds nothing a final Backup would
/// keep: it was never provisioned (no `status.providerId`) and its server has no database
/// of its own that is whole: none at all, one half made (created, not marked yet) or half
/// restored (`restore=pending`), or one that is not its own. A database that is whole but
/// whose provisioning was not recorded (a crash after the connection Secret was written)
/// still gets its final Backup.
async fn nothing_to_snapshot(db: &Database, ctx: &Context<State>) -> Result<bool> {
    if status::provider_id(db).is_some() {
        return Ok(false);
    }
    let target = match server_of(&ctx.state.directory, db).await {
        // Refused (namespace, quota) or no such server: nothing was made there.
        Err(Error::Reported { .. }) => return Ok(true),
        other => other?,
    };
    let uid = db.uid().unwrap_or_default();
    let session = admin_session(&ctx.state.servers, &target, "postgres").await?;
    let observed = sql::observe(&session, &db.owner_role(), &db.database_name()).await?;
    Ok(match &observed.database {
        None => true,
        Some(found) => {
            let comment = found.comment.as_deref();
            comment.is_none() || !sql::is_ours(comment, &uid) || sql::is_restore_pending(comment)
        }
    })
}

/// Drops the database and role if (and only if) this Database created them. A Database
/// that never got onto its server (refused, or its server is gone) has nothing there.
async fn drop_owned(db: &Database, ctx: &Context<State>) -> Result<()> {
    let provisioned = db.status.as_ref().is_some_and(|s| s.provider_id.is_some());
    let target = match server_of(&ctx.state.directory, db).await {
        Err(Error::Reported { reason, message }) if !provisioned => {
            tracing::info!(
                reason = reason.as_str(),
                message,
                "nothing to drop: the database was never provisioned"
            );
            return Ok(());
        }
        other => other?,
    };
    let server = target.endpoint.key.clone();
    let uid = db.uid().unwrap_or_default();
    let (database, role) = (db.database_name(), db.owner_role());
    let session = admin_session(&ctx.state.servers, &target, "postgres").await?;
    // The owner's rotation logins (`owner_logins`), marked as this Database's, go before the role.
    let logins = crate::owner_logins::logins(&role);
    let ours = |comment: Option<&str>| sql::is_ours(comment, &uid);
    let dropped = sql::drop_marked(&session, &database, &role, &logins, ours).await?;
    if dropped.database == sql::Fate::LeftAlone {
        tracing::info!(%server, database, "not dropping a database this Database did not create");
    }
    Ok(())
}

/// The name of a Database's final snapshot: `<name>-final-<first 8 characters of its
/// UID>`, so a Database created again under the same name never finds the Backup of an
/// earlier one in its place.
pub fn final_snapshot_name(db: &Database) -> String {
    let uid = db.uid().unwrap_or_default();
    let suffix: String = uid.chars().filter(|c| *c != '-').take(8).collect();
    let name = db.name_any();
    // An object name has at most 253 characters; the suffix takes 15.
    let mut head: String = name.chars().take(253 - 15).collect();
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    format!("{head}-final-{suffix}")
}

/// What the Backup found under a Database's final snapshot name is to its deletion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinalSnapshot {
    /// Made for this deletion and Ready: the dump of this very Database.
    Ready,
    /// Made for this deletion, not finished yet.
    Pending,
    /// Made for this deletion and Failed (the reason is given).
    Failed(String),
    /// Not provably a final snapshot of this Database (why is given): never trusted.
    Foreign(String),
}

/// Judges `backup` as the final snapshot of `db` (pure). It is one only if it names this
/// Database's UID (annotation and label), was created after the deletion began, refers to
/// this Database, and, once Ready, says it dumped this UID (`status.databaseUID`).
pub fn judge_final_snapshot(db: &Database, backup: &Backup) -> FinalSnapshot {
    use dbops_api::names::{annotation, label};
    let uid = db.uid().unwrap_or_default();
    let name = backup.name_any();
    if backup.annotations().get(annotation::DATABASE_UID) != Some(&uid)
        || backup.labels().get(label::FINAL_SNAPSHOT_OF) != Some(&uid)
    {
        return FinalSnapshot::Foreign(format!(
            "Backup {name} was not made as the final snapshot of this Database (UID {uid})"
        ));
    }
    if backup.spec.database_ref.name != db.name_any() {
        return FinalSnapshot::Foreign(format!(
            "Backup {name} refers to Database {}",
            backup.spec.database_ref.name
        ));
    }
    let created = backup.creation_timestamp().map(|t| t.0);
    let deleting = db.metadata.deletion_timestamp.as_ref().map(|t| t.0);
    if let (Some(created), Some(deleting)) = (created, deleting)
        && created < deleting
    {
        return FinalSnapshot::Foreign(format!(
            "Backup {name} was created at {created}, before this Database's deletion began at {deleting}"
        ));
    }
    let status = backup.status.clone().unwrap_or_default();
    if dbops_shared::conditions::is_true(&status.conditions, dbops_api::condition::READY) {
        return match status.database_uid.as_deref() {
            Some(dumped) if dumped == uid => FinalSnapshot::Ready,
            other => FinalSnapshot::Foreign(format!(
                "Backup {name} is Ready but says it dumped the Database with UID {}, not {uid}",
                other.unwrap_or("<none>")
            )),
        };
    }
    match dbops_shared::conditions::get(&status.conditions, dbops_api::condition::FAILED) {
        Some(c) if c.status == "True" => {
            FinalSnapshot::Failed(format!("{}: {}", c.reason, c.message))
        }
        _ => FinalSnapshot::Pending,
    }
}

/// Ensures the final Backup of this deletion exists; Ok once it is Ready. A Backup of
/// that name that is not provably this Database's final snapshot is never trusted: the
/// database is kept and the Database says why.
async fn final_snapshot(db: &Database, ctx: &Context<State>) -> Result<()> {
    use dbops_api::names::{annotation, label};
    let namespace = db.namespace().unwrap_or_default();
    let backups: Api<Backup> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = final_snapshot_name(db);
    let uid = db.uid().unwrap_or_default();
    let backup = match backups.get_opt(&name).await? {
        Some(b) => b,
        None => {
            let mut b: Backup = serde_json::from_value(json!({
                "apiVersion": "dbops.dev/v1alpha1",
                "kind": "Backup",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {label::FINAL_SNAPSHOT_OF: uid},
                    "annotations": {annotation::DATABASE_UID: uid},
                },
                "spec": {"databaseRef": {"name": db.name_any()}, "deletionPolicy": "Retain"},
            }))
            .map_err(|e| Error::Internal(e.to_string()))?;
            // The backup-controller continues this reconcile's trace.
            if let Some((key, value)) = dbops_shared::telemetry::trace_annotation() {
                b.annotations_mut().insert(key, value);
            }
            match backups.create(&PostParams::default(), &b).await {
                Ok(created) => created,
                // Made by an earlier reconcile whose write the cache had not seen.
                Err(kube::Error::Api(e)) if e.code == 409 => backups.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    match judge_final_snapshot(db, &backup) {
        FinalSnapshot::Ready => Ok(()),
        FinalSnapshot::Pending => Err(Error::Reported {
            reason: DatabaseReason::WaitingForFinalBackup.into(),
            message: format!(
                "waiting for the final Backup {name} to be Ready before dropping the database"
            ),
        }),
        FinalSnapshot::Failed(why) => Err(Error::Reported {
            reason: DatabaseReason::WaitingForFinalBackup.into(),
            message: format!(
                "final Backup {name} failed ({why}); the database is kept until a final Backup is Ready (delete Backup {name} to try again)"
            ),
        }),
        FinalSnapshot::Foreign(why) => Err(Error::Reported {
            reason: DatabaseReason::FinalSnapshotConflict.into(),
            message: format!(
                "{why}; it is not trusted as this Database's final snapshot and the database is kept: delete or rename Backup {name} so that a final snapshot of this Database can be taken"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deleting_database(uid: &str) -> Database {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "shop", "uid": uid,
                         "deletionTimestamp": "2026-11-23T10:00:00Z"},
            "spec": {"serverRef": {"name": "pg-main"},
                     "deletionPolicy": "Snapshot"}
        }))
        .unwrap()
    }

    fn final_backup(db_uid: &str, created: &str, status: serde_json::Value) -> Backup {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
            "metadata": {"name": "orders-final-11112222", "namespace": "shop",
                         "creationTimestamp": created,
                         "labels": {"dbops.dev/final-snapshot-of": db_uid},
                         "annotations": {"dbops.dev/database-uid": db_uid}},
            "spec": {"databaseRef": {"name": "orders"}},
            "status": status,
        }))
        .unwrap()
    }

    fn ready(uid: Option<&str>) -> serde_json::Value {
        serde_json::json!({"databaseUID": uid, "conditions": [{"type": "Ready", "status": "True",
            "reason": "Completed", "message": "", "lastTransitionTime": "2026-11-23T10:00:05Z"}]})
    }

    #[test]
    fn the_final_snapshot_name_carries_the_uid_and_stays_an_object_name() {
        let db = deleting_database("1111-2222-3333");
        assert_eq!(final_snapshot_name(&db), "orders-final-11112222");
        let mut long = db.clone();
        long.metadata.name = Some(format!("{}.x", "a".repeat(236)));
        let name = final_snapshot_name(&long);
        assert!(name.len() <= 253, "{}", name.len());
        assert!(name.ends_with("-final-11112222"));
        assert!(!name.contains(".-"), "{name}");
    }

    #[test]
    fn only_a_snapshot_made_for_this_deletion_of_this_database_is_trusted() {
        let db = deleting_database("uid-now");
        let after = "2026-11-23T10:00:01Z";
        assert_eq!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, ready(Some("uid-now")))),
            FinalSnapshot::Ready
        );
        assert_eq!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, serde_json::json!({}))),
            FinalSnapshot::Pending
        );
        // Made by hand under that name, without the marks.
        let mut by_hand = final_backup("uid-now", after, ready(Some("uid-now")));
        by_hand.metadata.annotations = None;
        let foreign = [
            // Left by an earlier Database of the same name.
            final_backup("uid-before", after, ready(Some("uid-before"))),
            // Made before this deletion began.
            final_backup("uid-now", "2026-11-23T09:59:59Z", ready(Some("uid-now"))),
            // Ready, but of another Database (or saying nothing about it).
            final_backup("uid-now", after, ready(Some("uid-other"))),
            final_backup("uid-now", after, ready(None)),
            by_hand,
        ];
        for (i, backup) in foreign.iter().enumerate() {
            let judged = judge_final_snapshot(&db, backup);
            assert!(
                matches!(judged, FinalSnapshot::Foreign(_)),
                "case {i}: {judged:?}"
            );
        }
        let failed = serde_json::json!({"conditions": [{"type": "Failed", "status": "True",
            "reason": "DumpFailed", "message": "boom", "lastTransitionTime": after}]});
        assert!(matches!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, failed)),
            FinalSnapshot::Failed(why) if why.contains("DumpFailed")
        ));
    }
}
