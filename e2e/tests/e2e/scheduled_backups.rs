//! Scheduled Backups against the real test bed, in real time (`* * * * *`: every
//! minute): the first slot's Backup; a converged schedule that writes nothing; one
//! catch-up Backup after the backup-controller was down across two slots, none for the
//! skipped slot; retention deleting the older Completed Backup and its artifact; and two
//! backup-controller processes without leader election creating one Backup per slot.
//!
//! Each test has its own namespace, PostgreSQL server, store directory, database-
//! controller and backup-controller(s) (watching only that namespace, resync 5 s,
//! backoff 1 s..5 s). They wait for the wall clock to pass minute boundaries, so each
//! takes two to four minutes, mostly idle (libtest starts tests in name order: these
//! start near the end of the suite).

use std::collections::BTreeSet;
use std::time::Duration;

use dbops_api::BackupPhase;
use dbops_e2e::fixtures::merge_patch_spec;
use dbops_e2e::harness::schedule::{
    FIRST_SLOT, MINUTE, READY, Scheduled, World, minute_of, name_for, scheduler_metric,
    until_shortly_before, wait_for_clock,
};
use dbops_e2e::wait::{eventually, holds_for};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use serde_json::json;

/// The first slot gets its Backup, owned by the Database; a reconcile of the converged
/// schedule writes nothing; after the backup-controller was down across two slots, one
/// catch-up Backup is created for the latest slot and none for the skipped one (an
/// Event counts it); once the catch-up completes, retention (keepLast 1) deletes the
/// first Backup and its artifact.
#[tokio::test]
async fn after_downtime_one_catch_up_backup_then_retention_prunes_the_older_one() {
    const USER: &str = "dbops-backup-controller";
    let mut w = World::new("sched-catchup").await;
    w.start_backup_controller(USER);
    let db = w.create_database("orders", 1).await;
    let created = db.creation_timestamp().unwrap().0;

    // 1. The first slot after the Database was created.
    let all = w
        .wait_scheduled("orders", "a first Backup", FIRST_SLOT, |all| {
            !all.is_empty()
        })
        .await;
    let first = &all[0];
    assert!(
        first.slot() >= created,
        "{first:?} is for a slot before the Database existed ({created})"
    );
    assert_eq!(first.name(), name_for("orders", first.slot()));
    assert!(
        first.0.owner_references().is_empty(),
        "a scheduled Backup outlives its Database unless onDatabaseDeletion is Delete"
    );
    assert_eq!(
        first.0.annotations().get("dbops.dev/database-uid"),
        db.uid().as_ref(),
        "a scheduled Backup is pinned to its Database's UID"
    );
    assert_eq!(
        first
            .0
            .labels()
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("dbops")
    );
    assert_eq!(
        first.0.spec.deletion_policy,
        dbops_api::BackupDeletionPolicy::Delete
    );
    let first = w.wait_completed(&first.name()).await;
    let first_files = w.artifact_paths(&first);
    for f in &first_files {
        assert!(f.is_file(), "{} is missing", f.display());
    }

    // 2. Converged: a reconcile (forced by a spec change) makes no API write. (The
    //    Backup's own "Completed" Event, written just after its status, comes first.)
    let first_name = first.name_any();
    eventually(
        "the Completed Event of the first Backup",
        READY,
        || w.events(&first_name, "Completed"),
        |events| !events.is_empty(),
    )
    .await;
    let replica = &w.replicas[USER];
    let reconciled = scheduler_metric(replica, "dbops_reconciles_total", r#"outcome="success""#);
    let before = w.writes(USER);
    merge_patch_spec(&w.databases(), "orders", json!({"connectionLimit": 7}))
        .await
        .unwrap();
    eventually(
        "the scheduler to reconcile the changed Database",
        READY,
        || async {
            Ok(scheduler_metric(
                replica,
                "dbops_reconciles_total",
                r#"outcome="success""#,
            ))
        },
        |n| *n > reconciled,
    )
    .await;
    let after = w.writes(USER);
    eprintln!(
        "API writes of the backup-controller during a reconcile of the converged schedule: {}",
        after.len() - before.len()
    );
    let all = w.scheduled("orders").await.unwrap();
    if all.len() == 1 {
        // (A new slot may have begun meanwhile on a slow machine; then it wrote a Backup.)
        assert_eq!(after, before, "the converged schedule wrote to the API");
    }

    // 3. Down across two slots.
    w.kill_backup_controller(USER);
    let before: Vec<Scheduled> = w.scheduled("orders").await.unwrap();
    let last = before.iter().map(Scheduled::slot).max().unwrap();
    wait_for_clock(last + MINUTE * 2 + SignedDuration::from_secs(2)).await;
    let restarted_at = Timestamp::now();
    w.start_backup_controller(USER);

    // 4. One catch-up Backup, for the latest slot; none for the skipped one.
    let all = w
        .wait_scheduled("orders", "a catch-up Backup", READY, |all| {
            all.iter().any(|b| b.slot() > last)
        })
        .await;
    let new: Vec<&Scheduled> = all.iter().filter(|b| b.slot() > last).collect();
    assert_eq!(new.len(), 1, "one catch-up Backup only: {all:?}");
    let catch_up = new[0].name();
    let slot = new[0].slot();
    assert_eq!(
        slot,
        minute_of(restarted_at),
        "the catch-up is for the latest slot: {all:?}"
    );
    assert_eq!(catch_up, name_for("orders", slot));
    let skipped = name_for("orders", last + MINUTE);
    assert!(
        all.iter().all(|b| b.name() != skipped),
        "{skipped} was created: {all:?}"
    );
    // It stays the only one until shortly before the next slot.
    let next_slot = slot + MINUTE;
    let window = until_shortly_before(next_slot, Duration::from_secs(5));
    holds_for(
        "one catch-up Backup",
        window,
        || w.scheduled("orders"),
        |all| all.iter().filter(|b| b.slot() > last).count() == 1,
    )
    .await
    .unwrap();
    let slots_skipped = slot.duration_since(last).as_secs() / 60 - 1;
    let notes = eventually(
        "a SlotsSkipped Event on the Database",
        READY,
        || w.event_notes("orders", "SlotsSkipped"),
        |notes| !notes.is_empty(),
    )
    .await;
    let plural = if slots_skipped == 1 { "" } else { "s" };
    assert!(
        notes.iter().any(
            |n| n.contains(&format!("skipped {slots_skipped} slot{plural} "))
                && n.contains(&catch_up)
        ),
        "{notes:?}"
    );

    // 5. It completes; retention keeps it and deletes the first Backup and its artifact.
    let catch_up = w.wait_completed(&catch_up).await;
    w.wait_gone(&first).await;
    for f in &first_files {
        assert!(!f.exists(), "{} is still in the store", f.display());
    }
    for f in w.artifact_paths(&catch_up) {
        assert!(f.is_file(), "{} is missing", f.display());
    }
    let notes = w.event_notes("orders", "BackupPruned").await.unwrap();
    assert!(
        notes.iter().any(|n| n.contains(&first.name_any())),
        "{notes:?}"
    );
}

/// Two backup-controller processes without leader election, both running across two
/// slots: each slot gets exactly one Backup, created once (the other replica's create is
/// refused as AlreadyExists or not tried), and neither scheduler storms with errors.
#[tokio::test]
async fn two_replicas_create_one_backup_per_slot() {
    const USERS: [&str; 2] = ["dbops-backup-controller-a", "dbops-backup-controller-b"];
    let mut w = World::new("sched-replicas").await;
    for user in USERS {
        w.start_backup_controller(user);
    }
    w.create_database("orders", 2).await;
    // The CEL rule checks each field's range (minute 61 is refused by the API server now);
    // February 31st passes it and never comes: the scheduler's to refuse.
    w.create_database_with("bad", "0 0 31 2 *", 1).await;

    let all = w
        .wait_scheduled("orders", "a first Backup", FIRST_SLOT, |all| {
            !all.is_empty()
        })
        .await;
    let first = all[0].slot();
    let second = first + MINUTE;
    let all = w
        .wait_scheduled("orders", "the next slot's Backup", FIRST_SLOT, |all| {
            all.iter().any(|b| b.slot() == second)
        })
        .await;
    let slots: Vec<Timestamp> = all.iter().map(Scheduled::slot).collect();
    assert_eq!(slots, [first, second], "one Backup per slot: {all:?}");
    for b in &all {
        assert_eq!(b.name(), name_for("orders", b.slot()));
    }
    // Hold on until shortly before the slot after: still one Backup per slot.
    let window = until_shortly_before(second + MINUTE, Duration::from_secs(10));
    holds_for(
        "one Backup per slot",
        window,
        || w.scheduled("orders"),
        |all| {
            let distinct: BTreeSet<Timestamp> = all.iter().map(Scheduled::slot).collect();
            distinct.len() == all.len() && all.len() == 2
        },
    )
    .await
    .unwrap();

    // Both replicas also run the Backups (without leader election, which is what the
    // Lease is for): the slots' Backups still complete.
    for b in &all {
        w.wait_completed(&b.name()).await;
    }

    // Each Backup was created exactly once, by one replica or the other.
    let creates: Vec<String> = USERS
        .iter()
        .flat_map(|u| w.writes(u))
        .filter(|w| w.contains(" create backups "))
        .collect();
    let created: Vec<&String> = creates.iter().filter(|w| w.ends_with("-> 201")).collect();
    assert_eq!(
        created.len(),
        2,
        "successful creates of Backups: {creates:#?}"
    );
    eprintln!(
        "Backup creates: {} succeeded, {} refused (AlreadyExists)",
        created.len(),
        creates.iter().filter(|w| w.ends_with("-> 409")).count()
    );

    // The invalid schedule: a Warning Event, no Backup.
    let events = w.events("bad", "InvalidSchedule").await.unwrap();
    assert!(
        events
            .iter()
            .any(|(type_, note)| type_ == "Warning" && note.contains("0 0 31 2 *")),
        "{events:?}"
    );
    assert!(w.scheduled("bad").await.unwrap().is_empty());

    // No error storm, no hot loop in either scheduler.
    for user in USERS {
        let replica = &w.replicas[user];
        let errors = scheduler_metric(replica, "dbops_reconcile_errors_total", "");
        let invalid = scheduler_metric(
            replica,
            "dbops_reconcile_errors_total",
            r#"reason="InvalidSchedule""#,
        );
        let reconciles = scheduler_metric(replica, "dbops_reconciles_total", "");
        eprintln!(
            "{user}: backup-scheduler reconciles {reconciles}, errors {errors} ({invalid} InvalidSchedule)"
        );
        assert!(
            (1.0..=2.0).contains(&invalid),
            "{user}: the invalid schedule failed {invalid} reconciles, not once per generation"
        );
        assert!(errors - invalid <= 2.0, "{user}: {errors} scheduler errors");
        assert!(
            reconciles <= 40.0,
            "{user}: {reconciles} scheduler reconciles in ~2 minutes"
        );
    }
}

/// Issue 10, item 4: deleting a Database (any deletionPolicy; Delete here) leaves its
/// scheduled Backups and their artifacts, the copies a user needs most right after a
/// mistaken delete, and nothing prunes them once it is gone; `onDatabaseDeletion: Delete`
/// opts in to deleting them with it.
#[tokio::test]
async fn deleting_a_database_keeps_its_scheduled_backups_unless_asked() {
    let mut w = World::new("sch-outlive").await;
    w.start_backup_controller("dbops-backup-controller");
    for (name, on_deletion) in [("keep", None), ("drop", Some("Delete"))] {
        let mut backup = json!({"schedule": "* * * * *", "retention": {"keepLast": 1}});
        if let Some(policy) = on_deletion {
            backup["onDatabaseDeletion"] = policy.into();
        }
        w.create_database_spec(name, json!({"deletionPolicy": "Delete", "backup": backup}))
            .await;
    }
    let mut databases = Vec::new();
    let mut completed = Vec::new();
    for name in ["keep", "drop"] {
        databases.push(w.wait_provisioned(name).await);
        let first = w
            .wait_scheduled(name, "a first Backup", FIRST_SLOT, |all| !all.is_empty())
            .await;
        completed.push(w.wait_completed(&first[0].name()).await);
    }
    for db in &databases {
        w.databases()
            .delete(&db.name_any(), &Default::default())
            .await
            .unwrap();
    }
    for db in &databases {
        let gone =
            dbops_e2e::wait::deleted(w.databases(), &db.name_any(), &db.uid().unwrap(), READY)
                .await;
        assert!(gone.is_ok(), "Database {} still exists", db.name_any());
    }

    // Retain (the default): every scheduled Backup of "keep" stays Completed with its
    // artifact, over several resyncs and past the next slot, without a Database.
    let kept = &completed[0];
    let kept_count = w.scheduled("keep").await.unwrap().len();
    holds_for(
        "the scheduled Backups of the deleted Database keep stay, Completed",
        Duration::from_secs(15),
        || async {
            let all = w.scheduled("keep").await?;
            Ok(all
                .iter()
                .map(|b| (b.name(), b.phase()))
                .collect::<Vec<_>>())
        },
        |all| {
            all.len() == kept_count
                && all.iter().any(|(name, phase)| {
                    *name == kept.name_any() && *phase == Some(BackupPhase::Completed)
                })
        },
    )
    .await
    .unwrap();
    for path in w.artifact_paths(kept) {
        assert!(path.is_file(), "{} was removed", path.display());
    }

    // Delete: the scheduled Backups of "drop" went with it, and their artifacts too.
    let dropped = &completed[1];
    w.wait_gone(dropped).await;
    let [artifact, manifest] = w.artifact_paths(dropped);
    eventually(
        "the artifact of drop's scheduled Backup removed",
        READY,
        || async { Ok((artifact.exists(), manifest.exists())) },
        |exists| *exists == (false, false),
    )
    .await;
    w.wait_scheduled("drop", "none left", READY, |all| all.is_empty())
        .await;
}
