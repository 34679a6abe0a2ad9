//! What deleting a Backup does to its artifact, and the database-controller's
//! `deletionPolicy: Snapshot` completed by a real final Backup.

use std::time::Duration;

use dbops_api::{Backup, BackupPhase};
use dbops_e2e::harness::backup::{
    FINALIZER, READY, Setup, database_uid, phase, sha256_of, verify_artifact,
};
use dbops_e2e::harness::object::InBed;
use dbops_e2e::wait::Want;
use kube::api::DeleteParams;
use serde_json::json;

/// (d) Deleting a Backup with deletionPolicy Delete removes its artifact and manifest
/// (behind a finalizer); Retain leaves them.
#[tokio::test]
async fn deletion_policy_decides_what_happens_to_the_artifact() {
    let s = Setup::new("bk-delete").await;
    s.create_pgbench_database("app", 1).await;
    s.create_backup("gone", "app", json!({"deletionPolicy": "Delete"}))
        .await;
    s.create_backup("kept", "app", json!({"deletionPolicy": "Retain"}))
        .await;
    let gone = s.wait_completed("gone", READY).await;
    let kept = s.wait_completed("kept", READY).await;
    assert!(
        gone.metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == FINALIZER),
        "Delete needs the finalizer {FINALIZER}"
    );
    assert!(
        !kept
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == FINALIZER)
    );
    let (gone_artifact, gone_manifest) = s.artifact_paths(&gone);
    let (kept_artifact, kept_manifest) = s.artifact_paths(&kept);
    for p in [
        &gone_artifact,
        &gone_manifest,
        &kept_artifact,
        &kept_manifest,
    ] {
        assert!(p.is_file(), "{} is missing", p.display());
    }

    for b in [&gone, &kept] {
        s.backups()
            .delete(
                b.metadata.name.as_deref().unwrap(),
                &DeleteParams::default(),
            )
            .await
            .unwrap();
    }
    s.wait_object_gone(s.backups(), &gone, READY).await;
    s.wait_object_gone(s.backups(), &kept, READY).await;
    assert!(
        !gone_artifact.exists() && !gone_manifest.exists(),
        "Delete removes both"
    );
    assert!(
        kept_artifact.is_file() && kept_manifest.is_file(),
        "Retain keeps both"
    );
    assert_eq!(
        sha256_of(&kept_artifact),
        kept.status.unwrap().checksum.unwrap()
    );
}

/// The database-controller's `deletionPolicy: Snapshot`, end to end: deleting the
/// Database creates `<name>-final-<uid>`, the backup-controller completes it, and only then is
/// the database dropped and the Database gone; the artifact stays.
#[tokio::test]
async fn a_snapshot_policy_database_is_backed_up_before_it_is_dropped() {
    let s = Setup::new("bk-snapshot").await;
    let db = s.create_database("snap", "Snapshot").await;
    s.pgbench("snap", 1).await;
    let final_name = dbops_e2e::fixtures::delete_for_final_snapshot(&s.b.client, &db, READY)
        .await
        .unwrap();
    assert!(final_name.starts_with("snap-final-"), "{final_name}");
    let backup = s.wait_completed(&final_name, READY).await;
    assert_eq!(
        database_uid(&backup),
        db.metadata.uid.as_deref(),
        "the final Backup says which Database it dumped"
    );
    let toc = verify_artifact(&s, &backup);
    assert!(toc.contains("TABLE DATA public pgbench_accounts"), "{toc}");
    s.wait_object_gone(s.databases(), &db, READY).await;
    s.pg.assert_dropped("snap").await;

    // The final Backup outlives its Database and stays Completed.
    let after = s.backups().get(&final_name).await.unwrap();
    assert_eq!(phase(&after), Some(BackupPhase::Completed));
    let (artifact, manifest) = s.artifact_paths(&after);
    assert!(artifact.is_file() && manifest.is_file());
    dbops_e2e::wait::holds_for(
        "the final Backup stays Completed after its Database is gone",
        Duration::from_secs(6),
        || async { Ok(phase(&s.backups().get(&final_name).await?)) },
        |p| *p == Some(BackupPhase::Completed),
    )
    .await
    .unwrap();
}

/// Issue 10, item 1: a final snapshot is provably of the Database being deleted. Database
/// `orders` (deletionPolicy Snapshot) lives three times under one name and databaseName:
/// the first life is snapshotted and dropped; the second, with a table of its own, gets a
/// final snapshot of its own (the first life's Completed one is not trusted) that holds
/// the second life's table before its database is dropped; the third finds a Backup made
/// by hand under its final snapshot's name, which is not trusted either
/// (FinalSnapshotConflict, a Warning Event, the database kept) until it is removed.
#[tokio::test]
async fn a_final_snapshot_is_of_the_database_being_deleted_never_an_earlier_one() {
    let s = Setup::new("bk-lives").await;
    let mut finals: Vec<String> = Vec::new();
    for (life, table) in [(1, "first_life"), (2, "second_life")] {
        let db = s.create_database("orders", "Snapshot").await;
        let uid = db.metadata.uid.clone().unwrap();
        s.exec_as_superuser(
            "orders",
            &format!(
                "CREATE TABLE {table} (x int); INSERT INTO {table} SELECT generate_series(1, 100)"
            ),
        )
        .await;
        let name = dbops_e2e::fixtures::delete_for_final_snapshot(&s.b.client, &db, READY)
            .await
            .unwrap();
        assert!(
            !finals.contains(&name),
            "life {life} took {name}, the name of an earlier life's final snapshot"
        );
        let backup = s.wait_completed(&name, READY).await;
        assert_eq!(database_uid(&backup), Some(uid.as_str()));
        let toc = verify_artifact(&s, &backup);
        assert!(
            toc.contains(&format!("TABLE DATA public {table}")),
            "life {life}'s final snapshot lacks its table {table}:\n{toc}"
        );
        s.wait_gone(s.databases(), "orders", &uid, READY).await;
        assert!(!s.pg.database_exists("orders").await.unwrap());
        finals.push(name);
    }

    // Life 3: someone made a Backup of it, by hand, under its final snapshot's name.
    let db = s.create_database("orders", "Snapshot").await;
    let uid = db.metadata.uid.clone().unwrap();
    let name = format!("orders-final-{}", &uid.replace('-', "")[..8]);
    s.create_backup(&name, "orders", json!({})).await;
    s.wait_completed(&name, READY).await;
    s.databases()
        .delete("orders", &DeleteParams::default())
        .await
        .unwrap();
    let conflict = s
        .wait_database(
            "orders",
            Want::progressing("FinalSnapshotConflict").any_generation(),
            READY,
        )
        .await;
    let message = dbops_e2e::wait::describe_database(&s.databases(), "orders").await;
    assert!(message.contains(&name), "{message}");
    assert!(conflict.metadata.deletion_timestamp.is_some());
    dbops_e2e::wait::holds_for(
        "database orders is kept while only a foreign Backup has the final snapshot's name",
        Duration::from_secs(8),
        || async { s.pg.database_exists("orders").await },
        |exists| *exists,
    )
    .await
    .unwrap();
    let events = s.warning_reasons("orders").await;
    assert!(
        events.contains(&"FinalSnapshotConflict".to_string()),
        "{events:?}"
    );

    // The impostor removed, the controller takes its own final snapshot, then drops.
    let impostor = s.backups().get(&name).await.unwrap();
    s.backups()
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    s.wait_object_gone(s.backups(), &impostor, READY).await;
    let own = s
        .wait_backup(&name, "made again as the final snapshot", READY, |b| {
            b.metadata.uid != impostor.metadata.uid && phase(b) == Some(BackupPhase::Completed)
        })
        .await;
    assert_eq!(database_uid(&own), Some(uid.as_str()));
    s.wait_gone(s.databases(), "orders", &uid, READY).await;
    assert!(!s.pg.database_exists("orders").await.unwrap());
}

/// `expireAfter` with `deletionPolicy: Snapshot` (issue 38): the expired Database gets
/// its final Backup, Completed, before its database is dropped and it is gone.
#[tokio::test]
async fn an_expired_snapshot_policy_database_is_backed_up_before_it_is_dropped() {
    let s = Setup::new("bk-expire-snap").await;
    s.create_database_spec(
        "brief",
        dbops_e2e::harness::backup::ADMIN_SECRET,
        json!({"deletionPolicy": "Snapshot", "expireAfter": "30s"}),
    )
    .await;
    let db = s.wait_database_ready("brief").await;
    s.pgbench("brief", 1).await;
    s.wait_object_gone(s.databases(), &db, Duration::from_secs(180))
        .await;
    s.pg.assert_dropped("brief").await;
    let finals: Vec<Backup> = s
        .backups()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|b| {
            b.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("brief-final-"))
        })
        .collect();
    assert_eq!(finals.len(), 1, "one final Backup");
    assert_eq!(phase(&finals[0]), Some(BackupPhase::Completed));
    assert_eq!(database_uid(&finals[0]), db.metadata.uid.as_deref());
    let toc = verify_artifact(&s, &finals[0]);
    assert!(toc.contains("TABLE DATA public pgbench_accounts"), "{toc}");
}
