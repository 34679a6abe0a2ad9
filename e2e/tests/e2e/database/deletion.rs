//! What each deletion policy leaves: Retain the database and role, Delete nothing, Snapshot
//! a final Backup first.

use std::time::Duration;

use dbops_e2e::harness::database::{
    FINALIZER, READY, RESYNC, SecretView, Setup, connect, has_finalizer, not_ready, value,
};
use dbops_e2e::wait::{Want, eventually, holds_for};
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::json;

/// A test's Setup (namespace `prefix`) and its Database `name` with `deletionPolicy:
/// policy`, provisioned.
async fn with_policy(prefix: &str, name: &str, policy: &str) -> (Setup, dbops_api::Database) {
    let s = Setup::new(prefix).await;
    let db = s
        .create_ready(name, json!({"deletionPolicy": policy}))
        .await;
    (s, db)
}

/// 3a. Retain: the Database goes at once, the database and role stay.
#[tokio::test]
async fn retain_policy_leaves_the_database_and_role() {
    let (s, db) = with_policy("db-retain", "kept", "Retain").await;
    assert!(
        !has_finalizer(&db),
        "Retain needs no finalizer: {:?}",
        db.metadata.finalizers
    );

    s.delete("kept").await;
    s.wait_gone(&db, Duration::from_secs(30)).await;
    assert!(
        s.pg.database_exists("kept").await.unwrap(),
        "database kept was dropped"
    );
    assert!(
        s.pg.role_exists("kept").await.unwrap(),
        "role kept was dropped"
    );
    // The Secret goes with its owner (garbage collector).
    let secrets = s.secrets();
    eventually(
        "the connection Secret garbage-collected",
        READY,
        || async { Ok(secrets.get_opt("kept-connection").await?.map(SecretView)) },
        |s| s.is_none(),
    )
    .await;
}

/// 3b. Delete: sessions terminated, database and role dropped, then the object goes.
#[tokio::test]
async fn delete_policy_drops_the_database_and_role() {
    let (s, db) = with_policy("db-delete", "dropped", "Delete").await;
    assert!(has_finalizer(&db), "Delete needs the finalizer {FINALIZER}");

    // An application session is open: deletion terminates it.
    let secret = s.connection_secret("dropped").await;
    let app = connect(
        "127.0.0.1",
        s.pg.port(),
        &value(&secret, "username"),
        &value(&secret, "password"),
        "dropped",
    )
    .await
    .unwrap();
    app.batch_execute("CREATE TABLE t (n int)").await.unwrap();

    s.delete("dropped").await;
    s.wait_gone(&db, READY).await;
    s.pg.assert_dropped("dropped").await;
    assert!(
        app.simple_query("SELECT 1").await.is_err(),
        "the open session was terminated"
    );
}

/// 3c. Snapshot: a final Backup first; the drop waits until that Backup is Ready.
#[tokio::test]
async fn snapshot_policy_waits_for_the_final_backup_then_drops() {
    let (s, db) = with_policy("db-snapshot", "snap", "Snapshot").await;
    assert!(
        has_finalizer(&db),
        "Snapshot needs the finalizer {FINALIZER}"
    );
    let uid = db.metadata.uid.clone().unwrap();

    s.delete("snap").await;
    let backups = s.backups();
    let final_name = dbops_e2e::fixtures::wait_final_snapshot(&s.b.client, s.ns(), &uid, READY)
        .await
        .unwrap();
    let backup = backups.get(&final_name).await.unwrap();
    let (meta, spec) = (backup.metadata.clone(), backup.spec.clone());
    assert_eq!(spec.database_ref.name, "snap");
    assert_eq!(
        meta.annotations
            .unwrap_or_default()
            .get("dbops.dev/database-uid"),
        Some(&uid),
        "the final Backup is pinned to this Database's UID"
    );
    assert!(
        !meta.owner_references.iter().flatten().any(|o| o.uid == uid),
        "the final Backup must outlive the Database: it is not owned by it"
    );

    // Deletion bumps metadata.generation; whether the status caught up is checked at
    // the end, so that a stale observedGeneration does not hide the rest.
    let waiting = s
        .wait(
            "snap",
            Want::progressing("WaitingForFinalBackup").any_generation(),
            READY,
        )
        .await;
    assert!(waiting.metadata.deletion_timestamp.is_some());
    let generations = (
        waiting.metadata.generation,
        waiting
            .status
            .as_ref()
            .and_then(|st| st.observed_generation),
    );
    // Without a Ready Backup nothing is dropped, over a few resyncs.
    holds_for(
        "database snap exists while the final Backup is not Ready",
        RESYNC * 2 + Duration::from_secs(1),
        || async { s.pg.database_exists("snap").await },
        |e| *e,
    )
    .await
    .unwrap();
    assert!(s.databases().get_opt("snap").await.unwrap().is_some());

    // The backup-controller's part, played by the test.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    backups
        .patch_status(
            &final_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Completed",
                "databaseUID": uid,
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "Completed",
                    "message": "simulated by the e2e test",
                    "lastTransitionTime": now,
                }],
            }})),
        )
        .await
        .unwrap();
    s.wait_gone(&db, READY).await;
    s.pg.assert_dropped("snap").await;
    assert!(
        backups.get_opt(&final_name).await.unwrap().is_some(),
        "the final Backup stays"
    );
    assert_eq!(
        generations.1, generations.0,
        "while WaitingForFinalBackup, status.observedGeneration (left) lags \
         metadata.generation (right, bumped by the deletion)"
    );
}

/// A Snapshot Database deleted before it was ever provisioned has nothing of its own to
/// snapshot: it goes without a final Backup instead of waiting forever for one the
/// backup-controller never makes (it dumps only provisioned databases). Found by the chaos
/// suite: a Database created with `restoreFrom` and deleted mid-restore stayed `Deleting`
/// with its final Backup `Pending/WaitingForDatabase`. A whole database of its own on the
/// server still gets its final Backup first (the Snapshot tests above).
#[tokio::test]
async fn a_snapshot_database_deleted_before_it_was_provisioned_goes_without_a_final_backup() {
    let s = Setup::new("db-snap-early").await;
    let db = s
        .create(
            "early",
            json!({"serverRef": {"name": s.server("nowhere")}, "deletionPolicy": "Snapshot"}),
        )
        .await;
    s.wait("early", not_ready("ServerNotFound"), READY).await;
    s.delete("early").await;
    s.wait_gone(&db, READY).await;
    let backups = s.backups().list(&ListParams::default()).await.unwrap();
    assert!(
        backups.items.is_empty(),
        "no final Backup: {:?}",
        backups
            .items
            .iter()
            .map(|b| b.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    assert!(!s.pg.database_exists("early").await.unwrap());
    let deleted = s
        .events_for("early")
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("Deleted"))
        .and_then(|e| e.message)
        .unwrap_or_default();
    assert!(
        deleted.contains("never provisioned"),
        "the Deleted Event says why there is no final Backup: {deleted:?}"
    );
}
