//! The backup-controller against a real control plane, real PostgreSQL and a real
//! `file://` store: pg_dump of pgbench data into one checksummed artifact per Backup,
//! whatever crashes or retries happen; retries then Failed when the store cannot be
//! written; deletion policies; a missing Database; and the database-controller's
//! `deletionPolicy: Snapshot` completed by a real final Backup.
//!
//! Each test has its own namespace, PostgreSQL server, store directory and both
//! controllers (watching only that namespace, resync 5 s, backoff 1 s..5 s). No test
//! prints a password: logs are redacted before they are shown.

use std::collections::BTreeMap;
use std::time::Duration;

use dbops_api::{Backup, BackupPhase};
use dbops_e2e::fixtures::merge_patch;
use dbops_e2e::s3::S3Server;
use dbops_e2e::wait::ObjectView;
use dbops_e2e::wait::Want;
use dbops_e2e::ControllerProcess;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams};
use serde_json::json;

use dbops_e2e::harness::backup::{
    ADMIN_SECRET, BIG_DUMP, FINALIZER, READY, S3_BUCKET, Setup, attempts, has,
    pg_restore_list, phase, sha256_of, verify_artifact,
};

/// (a) pgbench data is dumped into one artifact whose SHA-256 is in the status and the
/// manifest, and which pg_restore reads; nothing secret reaches the log.
#[tokio::test]
async fn a_backup_of_pgbench_data_completes_with_a_verified_artifact() {
    let s = Setup::new("bk-basic").await;
    s.create_database("bench", "Delete").await;
    s.pgbench("bench", 2).await;
    let created = s.create_backup("bench-1", "bench", json!({})).await;
    let backup = s.wait_completed("bench-1", READY).await;
    assert_eq!(attempts(&backup), 1);
    assert!(has(&backup, Want::new("Progressing", "False", None)));
    assert!(has(&backup, Want::new("Failed", "False", None)));
    assert_eq!(backup.metadata.uid, created.metadata.uid);
    let toc = verify_artifact(&s, &backup);
    for table in [
        "pgbench_accounts",
        "pgbench_branches",
        "pgbench_tellers",
        "pgbench_history",
    ] {
        assert!(
            toc.contains(&format!("TABLE DATA public {table}")),
            "{table} missing from the artifact:\n{toc}"
        );
    }
    let stem = format!("bench-1-{}", backup.metadata.uid.as_deref().unwrap());
    assert_eq!(
        s.store_files(),
        [format!("{stem}.dump"), format!("{stem}.manifest.json")]
    );
    // Retain (the default): no finalizer.
    assert!(
        !backup
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == FINALIZER)
    );

    let raw = std::fs::read_to_string(s.logs.path().join("backup-controller.log")).unwrap();
    assert!(
        !raw.contains(s.pg.superuser_password()),
        "the admin password is in the backup-controller's log"
    );
}

/// (b) SIGKILL mid-dump: the restarted controller starts the Backup over (attempts 2)
/// into the same key; it ends Completed with exactly one artifact.
#[tokio::test]
async fn a_controller_killed_mid_dump_leaves_exactly_one_artifact() {
    let mut s = Setup::new("bk-crash").await;
    s.create_database("big", "Delete").await;
    s.pgbench("big", 50).await;
    s.create_backup("big-1", "big", json!({})).await;

    let running = s.wait_mid_dump("big-1").await;
    assert_eq!(attempts(&running), 1);
    s.kill_backup_controller();
    let after_kill = s.backups().get("big-1").await.unwrap();
    assert_eq!(
        phase(&after_kill),
        Some(BackupPhase::Running),
        "the dump should have been interrupted mid-way; choose a bigger pgbench scale"
    );

    s.start_backup_controller();
    let done = s.wait_completed("big-1", BIG_DUMP).await;
    assert_eq!(attempts(&done), 2, "the interrupted attempt counts");
    verify_artifact(&s, &done);
    let stem = format!("big-1-{}", done.metadata.uid.as_deref().unwrap());
    assert_eq!(
        s.store_files(),
        [format!("{stem}.dump"), format!("{stem}.manifest.json")],
        "exactly one artifact and its manifest, no leftover"
    );
}

/// Two backup-controller replicas running at once (leader election off, as while a
/// deposed leader finishes its dump): an attempt is run by one replica only, the other
/// leaving it alone while its runner renews its hold; when the runner is SIGKILLed
/// mid-dump, the other starts the Backup over once the hold has run out. Every Completed
/// artifact matches its checksum and no partial file is left. (Before `status.runner`
/// the second replica took a Running Backup for an interrupted one and started it over
/// beside the first: two pg_dumps into one partial file, more attempts, and one
/// replica's failed rename could mark a completed Backup Failed.)
#[tokio::test]
async fn two_replicas_run_each_attempt_once_and_take_over_from_a_dead_runner() {
    let mut s = Setup::new("bk-two").await;
    let first = dbops_e2e::controllers::pod_name("backup-controller", s.logs.path());
    let second_logs = s.logs.path().join("second");
    std::fs::create_dir_all(&second_logs).unwrap();
    let pg_dump = dbops_e2e::paths::postgres_bin_dir()
        .unwrap()
        .join("pg_dump");
    let mut args = s.common_args();
    args.extend([
        format!("--backup-store={}", s.store_url),
        format!("--pg-dump={}", pg_dump.display()),
    ]);
    let second_name = "backup-controller-second".to_string();
    let mut second = Some(
        ControllerProcess::start_with_env(
            "backup-controller",
            &s.identities["backup-controller"],
            &second_logs,
            &args,
            &[("POD_NAME".to_string(), second_name.clone())],
        )
        .unwrap(),
    );
    s.create_database("big", "Delete").await;
    s.pgbench("big", 30).await;
    let runner_of = |b: &Backup| {
        b.status
            .as_ref()
            .and_then(|st| st.runner.as_ref())
            .map(|r| r.identity.clone())
    };

    // Both alive: one attempt, one runner, one Started Event.
    s.create_backup("big-1", "big", json!({})).await;
    let done = s.wait_completed("big-1", BIG_DUMP).await;
    assert_eq!(
        attempts(&done),
        1,
        "one attempt by one replica: {:?}",
        ObjectView(done.clone())
    );
    let started: Vec<String> =
        dbops_e2e::fixtures::events_about(&s.b.client, s.ns(), "Backup", "big-1")
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("Started"))
            .filter_map(|e| e.message)
            .collect();
    assert_eq!(started.len(), 1, "Started Events: {started:?}");
    verify_artifact(&s, &done);
    let runner = runner_of(&done);
    assert!(
        runner.as_deref() == Some(first.as_str()) || runner.as_deref() == Some(&second_name),
        "{runner:?}"
    );

    // The runner dies mid-dump: the other replica starts it over after the hold.
    s.create_backup("big-2", "big", json!({})).await;
    let running = s.wait_mid_dump("big-2").await;
    let runner = runner_of(&running).unwrap();
    let survivor = if runner == first {
        s.kill_backup_controller();
        second_name.clone()
    } else {
        let mut c = second.take().unwrap();
        c.process.signal("KILL").unwrap();
        c.process.wait_exit(Duration::from_secs(10)).unwrap();
        first.clone()
    };
    let after_kill = s.backups().get("big-2").await.unwrap();
    assert_eq!(
        phase(&after_kill),
        Some(BackupPhase::Running),
        "the dump should have been interrupted mid-way; choose a bigger pgbench scale"
    );
    let done = s.wait_completed("big-2", BIG_DUMP).await;
    assert_eq!(attempts(&done), 2, "{:?}", ObjectView(done.clone()));
    assert_eq!(runner_of(&done).as_deref(), Some(survivor.as_str()));
    verify_artifact(&s, &done);
    let mut expected: Vec<String> = ["big-1", "big-2"]
        .into_iter()
        .zip([&s.backups().get("big-1").await.unwrap(), &done])
        .flat_map(|(name, b)| {
            let stem = format!("{name}-{}", b.metadata.uid.as_deref().unwrap());
            [format!("{stem}.dump"), format!("{stem}.manifest.json")]
        })
        .collect();
    expected.sort();
    assert_eq!(s.store_files(), expected, "no partial file is left");
    drop(second);
}

/// Issue 12's question "does an outage burn a Backup's retries?": once the outage is
/// known (the DatabaseServer's probe, which maps to its Databases), the Database is not
/// Ready and a Backup created then waits (`Pending`, `WaitingForDatabase`) without spending
/// its retries, and completes in one attempt once the server is back. Only attempts begun
/// before the outage was noticed count (transient failures, as `maxRetries` says).
#[tokio::test]
async fn a_backup_created_in_an_outage_waits_without_spending_retries() {
    let mut s = Setup::new("bk-outage").await;
    s.create_database("app", "Delete").await;
    let server = dbops_e2e::fixtures::server_name(s.ns(), ADMIN_SECRET);
    s.pg.stop().unwrap();
    dbops_e2e::fixtures::server_condition(
        &s.b.client,
        &server,
        Want::new("Ready", "False", Some("ServerUnreachable")),
        Duration::from_secs(120),
    )
    .await
    .unwrap();

    s.create_backup("app-1", "app", json!({"maxRetries": 1}))
        .await;
    s.wait_backup("app-1", "waiting for its Database", READY, |b| {
        has(
            b,
            Want::new("Progressing", "True", Some("WaitingForDatabase")),
        )
    })
    .await;
    // Several backoff periods (1 s .. 5 s here): no attempt is made.
    let backups = s.backups();
    dbops_e2e::wait::holds_for(
        "the Backup waits without an attempt",
        Duration::from_secs(15),
        || async { Ok(ObjectView(backups.get("app-1").await?)) },
        |b| {
            phase(&b.0) == Some(BackupPhase::Pending)
                && attempts(&b.0) == 0
                && has(
                    &b.0,
                    Want::new("Progressing", "True", Some("WaitingForDatabase")),
                )
        },
    )
    .await
    .unwrap();

    s.pg.start_again().await.unwrap();
    let done = s.wait_completed("app-1", READY).await;
    assert_eq!(attempts(&done), 1, "{:?}", ObjectView(done.clone()));
    verify_artifact(&s, &done);
}

/// (c) A store that cannot be written (its path goes through a regular file, so even
/// root cannot create it): each attempt fails, is retried with backoff, and after
/// maxRetries retries the Backup is Failed with the store's reason.
#[tokio::test]
async fn an_unwritable_store_is_retried_then_failed() {
    let s = Setup::new("bk-store").await;
    // A store that cannot be written at startup keeps the controller from starting (see
    // backup_store.rs); one that breaks later is an attempt's failure: this namespace's
    // directory in the store is made a regular file.
    std::fs::write(s.store.path().join(s.ns()), b"not a directory").unwrap();
    s.create_database("app", "Delete").await;
    s.create_backup("app-1", "app", json!({"maxRetries": 2}))
        .await;

    let retrying = s
        .wait_backup("app-1", "a retry after a failed attempt", READY, |b| {
            has(b, Want::new("Progressing", "True", Some("Retrying")))
                && has(b, Want::new("Ready", "False", Some("StoreUnavailable")))
        })
        .await;
    assert!(attempts(&retrying) >= 1);
    let failed = s
        .wait_backup("app-1", "Failed", READY, |b| {
            phase(b) == Some(BackupPhase::Failed)
        })
        .await;
    assert_eq!(attempts(&failed), 3, "one attempt and maxRetries=2 retries");
    assert!(
        has(
            &failed,
            Want::new("Failed", "True", Some("StoreUnavailable"))
        ),
        "{:?}",
        ObjectView(failed.clone())
    );
    assert!(has(&failed, Want::new("Progressing", "False", None)));
    assert!(has(
        &failed,
        Want::new("Ready", "False", Some("StoreUnavailable"))
    ));
}

/// (d) Deleting a Backup with deletionPolicy Delete removes its artifact and manifest
/// (behind a finalizer); Retain leaves them.
#[tokio::test]
async fn deletion_policy_decides_what_happens_to_the_artifact() {
    let s = Setup::new("bk-delete").await;
    s.create_database("app", "Delete").await;
    s.pgbench("app", 1).await;
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
    s.wait_gone(
        s.backups(),
        "gone",
        gone.metadata.uid.as_deref().unwrap(),
        READY,
    )
    .await;
    s.wait_gone(
        s.backups(),
        "kept",
        kept.metadata.uid.as_deref().unwrap(),
        READY,
    )
    .await;
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

/// (e) A Backup of a Database that does not exist fails at once, without retries.
#[tokio::test]
async fn a_missing_database_fails_the_backup_at_once() {
    let s = Setup::new("bk-missing").await;
    s.create_backup("orphan", "no-such-db", json!({"maxRetries": 5}))
        .await;
    let failed = s
        .wait_backup("orphan", "Failed", Duration::from_secs(30), |b| {
            phase(b) == Some(BackupPhase::Failed)
        })
        .await;
    assert!(has(
        &failed,
        Want::new("Failed", "True", Some("DatabaseNotFound"))
    ));
    assert!(has(
        &failed,
        Want::new("Ready", "False", Some("DatabaseNotFound"))
    ));
    assert_eq!(attempts(&failed), 0, "no dump was attempted");
    assert!(s.store_files().is_empty());
}

/// The database-controller's `deletionPolicy: Snapshot`, end to end: deleting the
/// Database creates `<name>-final-<uid>`, the backup-controller completes it, and only then is
/// the database dropped and the Database gone; the artifact stays.
#[tokio::test]
async fn a_snapshot_policy_database_is_backed_up_before_it_is_dropped() {
    let s = Setup::new("bk-snapshot").await;
    let db = s.create_database("snap", "Snapshot").await;
    s.pgbench("snap", 1).await;
    let final_name = dbops_e2e::fixtures::delete_for_final_snapshot(
        &s.b.client,
        s.ns(),
        "snap",
        db.metadata.uid.as_deref().unwrap(),
        READY,
    )
    .await
    .unwrap();
    assert!(final_name.starts_with("snap-final-"), "{final_name}");
    let backup = s.wait_completed(&final_name, READY).await;
    assert_eq!(
        backup
            .status
            .as_ref()
            .and_then(|st| st.database_uid.as_deref()),
        db.metadata.uid.as_deref(),
        "the final Backup says which Database it dumped"
    );
    let toc = verify_artifact(&s, &backup);
    assert!(toc.contains("TABLE DATA public pgbench_accounts"), "{toc}");
    s.wait_gone(
        s.databases(),
        "snap",
        db.metadata.uid.as_deref().unwrap(),
        READY,
    )
    .await;
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
        let name = dbops_e2e::fixtures::delete_for_final_snapshot(
            &s.b.client,
            s.ns(),
            "orders",
            &uid,
            READY,
        )
        .await
        .unwrap();
        assert!(
            !finals.contains(&name),
            "life {life} took {name}, the name of an earlier life's final snapshot"
        );
        let backup = s.wait_completed(&name, READY).await;
        assert_eq!(
            backup
                .status
                .as_ref()
                .and_then(|st| st.database_uid.as_deref()),
            Some(uid.as_str())
        );
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
            Want::new("Progressing", "True", Some("FinalSnapshotConflict")).any_generation(),
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
    s.wait_gone(
        s.backups(),
        &name,
        impostor.metadata.uid.as_deref().unwrap(),
        READY,
    )
    .await;
    let own = s
        .wait_backup(&name, "made again as the final snapshot", READY, |b| {
            b.metadata.uid != impostor.metadata.uid && phase(b) == Some(BackupPhase::Completed)
        })
        .await;
    assert_eq!(
        own.status
            .as_ref()
            .and_then(|st| st.database_uid.as_deref()),
        Some(uid.as_str())
    );
    s.wait_gone(s.databases(), "orders", &uid, READY).await;
    assert!(!s.pg.database_exists("orders").await.unwrap());
}

/// A Backup of a Database that is not Ready yet waits (Pending, WaitingForDatabase, no
/// attempt) and runs once the Database turns Ready.
#[tokio::test]
async fn a_backup_waits_for_its_database_to_be_ready() {
    let s = Setup::new("bk-wait").await;
    // Neither the admin Secret nor its DatabaseServer exists yet: the Database cannot be
    // provisioned.
    s.create_database_with("late", "Delete", "late-admin").await;
    s.create_backup("late-1", "late", json!({})).await;
    let waiting = s
        .wait_backup("late-1", "waiting for its Database", READY, |b| {
            has(
                b,
                Want::new("Progressing", "True", Some("WaitingForDatabase")),
            )
        })
        .await;
    assert_eq!(phase(&waiting), Some(BackupPhase::Pending));
    assert_eq!(attempts(&waiting), 0);
    dbops_e2e::wait::holds_for(
        "the Backup keeps waiting while its Database is not Ready",
        Duration::from_secs(6),
        || async { Ok(s.backups().get("late-1").await.map(ObjectView)?) },
        |b| phase(&b.0) == Some(BackupPhase::Pending) && attempts(&b.0) == 0,
    )
    .await
    .unwrap();

    s.create_admin_secret("late-admin").await;
    s.wait_database_ready("late").await;
    let done = s.wait_completed("late-1", READY).await;
    assert_eq!(attempts(&done), 1);
    verify_artifact(&s, &done);
}

/// Two Backups of one server at once: the second waits for the server's dump slot
/// (Pending, WaitingForSlot), never Running beside the first; both complete.
#[tokio::test]
async fn one_dump_per_server_at_a_time() {
    let s = Setup::new("bk-slots").await;
    s.create_database("app", "Delete").await;
    s.pgbench("app", 20).await;
    s.create_backup("first", "app", json!({})).await;
    s.create_backup("second", "app", json!({})).await;

    let backups = s.backups();
    let mut saw_waiting = false;
    let deadline = tokio::time::Instant::now() + READY;
    loop {
        let a = backups.get("first").await.unwrap();
        let b = backups.get("second").await.unwrap();
        assert!(
            !(phase(&a) == Some(BackupPhase::Running) && phase(&b) == Some(BackupPhase::Running)),
            "two dumps of one server ran at once: {:?} {:?}",
            ObjectView(a),
            ObjectView(b)
        );
        saw_waiting |= [&a, &b]
            .iter()
            .any(|x| has(x, Want::new("Progressing", "True", Some("WaitingForSlot"))));
        if [&a, &b]
            .iter()
            .all(|x| phase(x) == Some(BackupPhase::Completed))
        {
            verify_artifact(&s, &a);
            verify_artifact(&s, &b);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "both Backups did not complete within {READY:?}: {:?} {:?}\n{}",
            ObjectView(a),
            ObjectView(b),
            s.log("backup-controller", 6000)
        );
        tokio::time::sleep(dbops_e2e::wait::POLL_INTERVAL).await;
    }
    assert!(
        saw_waiting,
        "neither Backup was seen waiting for the server's slot"
    );
}

/// Refused credentials are permanent: the Backup fails at once (one attempt, no retry)
/// with AuthenticationFailed, and neither password reaches the log or the status.
#[tokio::test]
async fn refused_credentials_fail_the_backup_at_once() {
    let mut s = Setup::new("bk-auth").await;
    s.create_database("app", "Delete").await;
    // The database-controller stops, so the Database stays Ready; then the admin Secret
    // gets a wrong password.
    if let Some(mut c) = s.database_controller.take() {
        c.process.stop().unwrap();
    }
    let wrong = "not-the-password-4f1c9b";
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    merge_patch(
        &secrets,
        ADMIN_SECRET,
        json!({"stringData": {"password": wrong}}),
    )
    .await
    .unwrap();
    s.create_backup("app-1", "app", json!({"maxRetries": 5}))
        .await;
    let failed = s
        .wait_backup("app-1", "Failed", READY, |b| {
            phase(b) == Some(BackupPhase::Failed)
        })
        .await;
    assert!(
        has(
            &failed,
            Want::new("Failed", "True", Some("AuthenticationFailed"))
        ),
        "{:?}",
        ObjectView(failed.clone())
    );
    assert_eq!(attempts(&failed), 1, "a permanent failure is not retried");
    assert!(s.store_files().is_empty(), "{:?}", s.store_files());
    let raw = std::fs::read_to_string(s.logs.path().join("backup-controller.log")).unwrap();
    let status = serde_json::to_string(&failed.status).unwrap();
    for secret in [wrong, s.pg.superuser_password()] {
        assert!(
            !raw.contains(secret),
            "a password is in the backup-controller's log"
        );
        assert!(
            !status.contains(secret),
            "a password is in the Backup's status"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Restore: `spec.restoreFrom` on a new Database (performed by the database-controller).

/// Row counts by table, without owners.
fn counts(tables: &BTreeMap<String, (i64, String)>) -> BTreeMap<String, i64> {
    tables.iter().map(|(t, (n, _))| (t.clone(), *n)).collect()
}

/// pgbench data (and extension pgcrypto) backed up, then restored into a new Database:
/// every table with the same row count, owned by the new Database's role, the extension
/// usable, and the data reachable with the new Secret.
#[tokio::test]
async fn a_backup_restores_into_a_new_database_with_every_row() {
    let s = Setup::new("rs-basic").await;
    s.create_database_with_pgcrypto("source").await;
    s.pgbench("source", 2).await;
    s.create_backup("source-1", "source", json!({})).await;
    s.wait_completed("source-1", READY).await;

    s.create_restored_database("copy", "source-1").await;
    let copy = s.wait_database("copy", Want::provisioned(), BIG_DUMP).await;

    let source = s.tables("source").await;
    let restored = s.tables("copy").await;
    assert_eq!(source.len(), 4, "pgbench makes 4 tables: {source:?}");
    assert_eq!(counts(&restored), counts(&source));
    assert_eq!(source["pgbench_accounts"].0, 200_000);
    // The extension came along (pgcrypto is trusted: the owner role may create it).
    let (client, connection) =
        tokio_postgres::connect(&s.pg.conn_string("copy"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let digest: String = client
        .query_one("SELECT encode(digest('x', 'sha256'), 'hex')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(digest.len(), 64);
    for (table, (_, owner)) in &restored {
        assert_eq!(owner, "copy", "{table} is owned by {owner}");
    }
    // Restored, the database carries the plain ownership mark (no pending restore).
    let uid = copy.metadata.uid.clone().unwrap();
    assert_eq!(
        s.pg.database_comment("copy").await.unwrap(),
        Some(format!("dbops.dev/uid={uid}"))
    );
    // The application's own credentials read the restored rows.
    let secret = Api::<Secret>::namespaced(s.b.client.clone(), s.ns())
        .get("copy-connection")
        .await
        .unwrap();
    let data = secret.data.unwrap_or_default();
    let value = |k: &str| String::from_utf8(data.get(k).unwrap().0.clone()).unwrap();
    let app =
        s.pg.connect(&value("username"), &value("password"), &value("dbname"))
            .await
            .unwrap();
    let n: i64 = app
        .query_one("SELECT count(*) FROM pgbench_branches", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

/// A corrupted artifact (same size, one byte changed) is refused: Ready=False with
/// ChecksumMismatch and a Warning Event, and the new database stays empty.
#[tokio::test]
async fn a_corrupted_artifact_is_refused_and_nothing_is_restored() {
    let s = Setup::new("rs-corrupt").await;
    s.create_database("source", "Delete").await;
    s.pgbench("source", 1).await;
    s.create_backup("source-1", "source", json!({})).await;
    let backup = s.wait_completed("source-1", READY).await;

    let (artifact, _) = s.artifact_paths(&backup);
    let mut bytes = std::fs::read(&artifact).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&artifact, &bytes).unwrap();

    s.create_restored_database("copy", "source-1").await;
    let db = s
        .wait_database(
            "copy",
            Want::new("Ready", "False", Some("ChecksumMismatch")),
            READY,
        )
        .await;
    let ready = db
        .status
        .as_ref()
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Ready"))
        .unwrap();
    assert!(
        ready.message.contains("nothing was restored")
            && ready
                .message
                .contains(backup.status.as_ref().unwrap().checksum.as_deref().unwrap()),
        "{}",
        ready.message
    );
    assert!(
        db.status.as_ref().unwrap().provider_id.is_none(),
        "a database that failed its restore is not reported as provisioned"
    );
    assert!(s.tables("copy").await.is_empty(), "something was restored");

    let events = dbops_e2e::wait::eventually(
        "a ChecksumMismatch Warning Event",
        READY,
        || async {
            let events: Api<k8s_openapi::api::core::v1::Event> =
                Api::namespaced(s.b.client.clone(), s.ns());
            Ok(events.list(&Default::default()).await?.items)
        },
        |events: &Vec<k8s_openapi::api::core::v1::Event>| {
            events.iter().any(|e| {
                e.reason.as_deref() == Some("ChecksumMismatch")
                    && e.type_.as_deref() == Some("Warning")
                    && e.involved_object.name.as_deref() == Some("copy")
            })
        },
    )
    .await;
    assert!(!events.is_empty());
}

/// The database-controller killed while pg_restore runs: after a restart the half-restored
/// database is made anew and restored once, with every row and no duplicate.
#[tokio::test]
async fn a_restore_interrupted_by_a_crash_completes_after_restart() {
    let mut s = Setup::new("rs-crash").await;
    s.create_database("source", "Delete").await;
    s.pgbench("source", 20).await;
    s.create_backup("source-1", "source", json!({})).await;
    s.wait_completed("source-1", BIG_DUMP).await;

    s.create_restored_database("copy", "source-1").await;
    let first = s
        .wait_database(
            "copy",
            Want::new("Progressing", "True", Some("Restoring")),
            BIG_DUMP,
        )
        .await;
    // pg_restore is running (its session is visible on the server): kill the controller.
    let restoring = dbops_e2e::wait::eventually(
        "pg_restore connected to the new database",
        READY,
        || async {
            let c = s.pg.connect_as_superuser().await?;
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = 'copy' AND application_name = 'dbops-database-controller-restore'",
                    &[],
                )
                .await?
                .get(0);
            Ok(n)
        },
        |n| *n > 0,
    )
    .await;
    assert!(restoring > 0);
    let oid_before = s.pg.database_oid("copy").await.unwrap();
    s.kill_database_controller();
    let uid = first.metadata.uid.clone().unwrap();
    assert_eq!(
        s.pg.database_comment("copy").await.unwrap(),
        Some(format!("dbops.dev/uid={uid} dbops.dev/restore=pending")),
        "the database is still marked as waiting for its restore"
    );

    s.start_database_controller();
    s.wait_database("copy", Want::provisioned(), BIG_DUMP).await;
    assert_eq!(
        counts(&s.tables("copy").await),
        counts(&s.tables("source").await)
    );
    assert_eq!(s.pg.count_databases_like("copy%").await.unwrap(), 1);
    assert_ne!(
        s.pg.database_oid("copy").await.unwrap(),
        oid_before,
        "the half-restored database was made anew"
    );
}

// ---------------------------------------------------------------------------------------
// The s3:// store against a real S3-compatible server (s3s-fs, built by e2e/install) on
// loopback. What the store wrote is checked in the server's data directory, where s3s-fs
// keeps each object as a plain file, independently of the client under test.

/// The object keys of a Backup in the bucket: `<prefix>/<ns>/<name>-<uid>.{dump,manifest.json}`.
fn s3_keys_of(s: &Setup, s3_prefix: &str, backup: &Backup) -> (String, String) {
    let stem = format!(
        "{s3_prefix}/{}/{}-{}",
        s.ns(),
        backup.metadata.name.as_deref().unwrap(),
        backup.metadata.uid.as_deref().unwrap()
    );
    (format!("{stem}.dump"), format!("{stem}.manifest.json"))
}

/// (s3-a) A Backup into `s3://bucket/prefix`: the artifact and the manifest are objects
/// under the Backup's key, the status checksum is the SHA-256 of the stored object,
/// pg_restore reads it, and deleting the Backup (deletionPolicy Delete) removes both.
#[tokio::test]
async fn an_s3_backup_is_one_verified_object_that_deletion_removes() {
    let s = Setup::with_s3("bk-s3", "dbops/e2e", None).await;
    let server = s.s3.as_ref().unwrap();
    s.create_database("bench", "Delete").await;
    s.pgbench("bench", 2).await;
    let created = s
        .create_backup("bench-1", "bench", json!({"deletionPolicy": "Delete"}))
        .await;
    let backup = s.wait_completed("bench-1", READY).await;
    assert_eq!(attempts(&backup), 1);
    let (artifact_key, manifest_key) = s3_keys_of(&s, "dbops/e2e", &backup);
    // Beside the store's identity (`<prefix>/.dbops-store-id`, written at startup).
    assert_eq!(
        server.keys(S3_BUCKET, "").unwrap(),
        [
            "dbops/e2e/.dbops-store-id".to_string(),
            artifact_key.clone(),
            manifest_key.clone()
        ],
        "exactly the artifact and its manifest"
    );
    assert_eq!(
        server.unfinished_upload_parts().unwrap(),
        0,
        "no upload left open"
    );

    let status = backup.status.clone().unwrap();
    let artifact = server.object_file(S3_BUCKET, &artifact_key);
    let sum = sha256_of(&artifact);
    assert_eq!(status.checksum.as_deref(), Some(sum.as_str()));
    let size = std::fs::metadata(&artifact).unwrap().len();
    assert_eq!(status.size_bytes, Some(i64::try_from(size).unwrap()));
    assert_eq!(
        status.location.as_deref(),
        Some(format!("s3://{S3_BUCKET}/{artifact_key}").as_str())
    );
    let manifest = server.object_file(S3_BUCKET, &manifest_key);
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(m["checksum"], json!(sum));
    assert_eq!(m["sizeBytes"], json!(size));
    assert_eq!(m["backup"]["uid"], json!(created.metadata.uid));
    let toc = pg_restore_list(&artifact);
    for table in ["pgbench_accounts", "pgbench_branches", "pgbench_tellers"] {
        assert!(toc.contains(table), "{table} is not in the dump:\n{toc}");
    }
    let raw = std::fs::read_to_string(s.logs.path().join("backup-controller.log")).unwrap();
    assert!(
        !raw.contains(server.secret_key()),
        "the S3 secret key is in the backup-controller's log"
    );

    s.backups()
        .delete("bench-1", &DeleteParams::default())
        .await
        .unwrap();
    s.wait_gone(
        s.backups(),
        "bench-1",
        created.metadata.uid.as_deref().unwrap(),
        READY,
    )
    .await;
    assert_eq!(
        server.keys(S3_BUCKET, "").unwrap(),
        ["dbops/e2e/.dbops-store-id"],
        "deletionPolicy Delete removes the artifact and the manifest (not the store's identity)"
    );
}

/// (s3-b) Credentials the S3 server refuses are a configuration error found when the
/// controllers start (issue 10: not ready with the reason, instead of failing later): both
/// answer /readyz 503 naming it, no Backup is attempted, and no secret is logged. (A
/// missing bucket is sorted the same way, see backup_store's unit tests; s3s-fs creates
/// buckets on PUT.)
#[tokio::test]
async fn refused_s3_credentials_keep_the_controllers_not_ready() {
    let wrong = "not-the-s3-secret-key-7c1e";
    let s = Setup::with_s3("bk-s3-auth", "dbops", Some(wrong)).await;
    // Refused credentials are found when the controllers start, not at the first Backup:
    // neither becomes ready, and /readyz says why.
    for (name, controller) in [
        ("backup-controller", s.backup_controller.as_ref().unwrap()),
        (
            "database-controller",
            s.database_controller.as_ref().unwrap(),
        ),
    ] {
        let (code, body) = dbops_e2e::wait::eventually(
            &format!("{name} /readyz names the refused credentials"),
            READY,
            || async { controller.get("/readyz") },
            |(code, body): &(u16, String)| {
                *code == 503 && body.contains("credentials were refused")
            },
        )
        .await;
        assert_eq!(code, 503);
        assert!(body.contains("BackupStore"), "{body}");
        assert!(!body.contains(wrong), "a secret is in /readyz");
    }
    s.create_database_with("app", "Delete", ADMIN_SECRET).await;
    s.create_backup("app-1", "app", json!({"maxRetries": 3}))
        .await;
    dbops_e2e::wait::holds_for(
        "no attempt is made while the store refuses the credentials",
        Duration::from_secs(5),
        || async { Ok(s.backups().get("app-1").await.map(|b| attempts(&b))?) },
        |n| *n == 0,
    )
    .await
    .unwrap();
    let server = s.s3.as_ref().unwrap();
    for log in ["backup-controller.log", "database-controller.log"] {
        let raw = std::fs::read_to_string(s.logs.path().join(log)).unwrap();
        assert!(raw.contains("credentials were refused"), "{log}");
        for secret in [wrong, server.secret_key()] {
            assert!(!raw.contains(secret), "a secret is in {log}");
        }
    }
}

/// (s3-c) The store itself against the server, no controller: a 40 MiB artifact goes up
/// in 16 MiB parts and is invisible until committed; a writer dropped mid-way (an attempt
/// that died) leaves no object and its upload is aborted; a retry overwrites the same key;
/// reads stream back what was written; missing objects are NotFound; delete is
/// idempotent; a wrong secret is refused for good and an unreachable server is transient.
#[tokio::test]
async fn the_s3_store_uploads_in_parts_and_shows_only_committed_artifacts() {
    use dbops_shared::backup_store::{BackupStore, ObjectKey, StoreError};
    use tokio::io::AsyncReadExt;

    let logs = tempfile::tempdir().unwrap();
    let server = S3Server::start("s3s-fs", logs.path()).await.unwrap();
    server.create_bucket(S3_BUCKET).unwrap();
    let url = format!("s3://{S3_BUCKET}/direct");
    let store = url
        .parse::<BackupStore>()
        .unwrap()
        .with_s3_environment(server.env());
    let key = ObjectKey::new("team-a", "orders-1", "0b5c");
    let object = server.object_file(S3_BUCKET, "direct/team-a/orders-1-0b5c.dump");
    let data: Vec<u8> = (0u32..40 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let nothing_visible = || server.keys(S3_BUCKET, "").unwrap().is_empty();

    // An attempt that dies after one part went up: nothing visible, the upload aborted.
    let mut first = store.create_artifact(&key).await.unwrap();
    for chunk in data[..20 << 20].chunks(256 << 10) {
        first.write(chunk).await.unwrap();
    }
    dbops_e2e::wait::eventually(
        "the first part to be uploaded",
        Duration::from_secs(60),
        || async { server.unfinished_upload_parts() },
        |parts| *parts > 0,
    )
    .await;
    assert!(nothing_visible(), "{:?}", server.keys(S3_BUCKET, ""));
    drop(first);
    dbops_e2e::wait::eventually(
        "the dropped writer's upload to be aborted",
        Duration::from_secs(60),
        || async { server.unfinished_upload_parts() },
        |parts| *parts == 0,
    )
    .await;
    assert!(nothing_visible(), "{:?}", server.keys(S3_BUCKET, ""));

    // The retry: three parts, visible once committed, read back as written.
    let mut second = store.create_artifact(&key).await.unwrap();
    for chunk in data.chunks(256 << 10) {
        second.write(chunk).await.unwrap();
    }
    assert!(nothing_visible(), "visible before commit");
    second.commit().await.unwrap();
    let stored = std::fs::read(&object).unwrap();
    assert!(
        stored == data,
        "the stored object differs ({} bytes, {} written)",
        stored.len(),
        data.len()
    );
    assert_eq!(server.unfinished_upload_parts().unwrap(), 0);
    let mut back = Vec::new();
    store
        .open_artifact(&key)
        .await
        .unwrap()
        .read_to_end(&mut back)
        .await
        .unwrap();
    assert!(back == data, "read back {} bytes", back.len());

    store
        .put_manifest(&key, br#"{"checksum":"x"}"#)
        .await
        .unwrap();
    assert_eq!(
        store.get_manifest(&key).await.unwrap(),
        br#"{"checksum":"x"}"#
    );
    assert_eq!(
        server.keys(S3_BUCKET, "").unwrap(),
        [
            "direct/team-a/orders-1-0b5c.dump",
            "direct/team-a/orders-1-0b5c.manifest.json"
        ]
    );

    // A small artifact is one PUT, and overwrites.
    let mut small = store.create_artifact(&key).await.unwrap();
    small.write(b"a small dump").await.unwrap();
    small.commit().await.unwrap();
    assert_eq!(std::fs::read(&object).unwrap(), b"a small dump");

    let other = ObjectKey::new("team-a", "never", "1");
    assert!(matches!(
        store.open_artifact(&other).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.get_manifest(&other).await,
        Err(StoreError::NotFound(_))
    ));
    store.delete(&key).await.unwrap();
    store.delete(&key).await.unwrap(); // already gone: still a success
    assert!(nothing_visible(), "{:?}", server.keys(S3_BUCKET, ""));

    let wrong_secret: Vec<(String, String)> = server
        .env()
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "AWS_SECRET_ACCESS_KEY" => (k, "not-the-secret-key".to_string()),
            _ => (k, v),
        })
        .collect();
    let refused = url
        .parse::<BackupStore>()
        .unwrap()
        .with_s3_environment(wrong_secret);
    let e = refused.put_manifest(&key, b"{}").await.unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    assert!(!e.is_transient(), "{e}");
    assert!(!e.to_string().contains(server.secret_key()), "{e}");
    assert!(nothing_visible());

    drop(server); // stopped: the endpoint no longer answers
    let e = store.get_manifest(&key).await.unwrap_err();
    assert!(matches!(e, StoreError::Remote { .. }), "{e}");
    assert!(e.is_transient(), "{e}");
}

/// Nothing waits without a bound: an application's transaction holding an exclusive lock
/// on a table (which pg_dump needs) and a DBA's open transaction on the database's
/// settings (which a connection-limit change needs). The Backup reports `LockTimeout`
/// naming the table and retries; the Database reports `LockTimeout`; both finish once the
/// locks are released.
#[tokio::test]
async fn held_locks_are_reported_and_work_resumes_when_they_are_released() {
    let mut s = Setup::new("bk-lock").await;
    let bound = std::env::var("DBOPS_TEST_LOCK_TIMEOUT").unwrap_or_else(|_| "2s".into());
    s.extra_args = vec![format!("--lock-timeout={bound}")];
    s.kill_database_controller();
    s.kill_backup_controller();
    s.start_database_controller();
    s.start_backup_controller();
    s.create_database("app", "Retain").await;
    s.exec_as_superuser(
        "app",
        "CREATE TABLE orders (id int PRIMARY KEY); INSERT INTO orders VALUES (1)",
    )
    .await;

    // The application's and the DBA's open transactions.
    let app = s.pg.connect_as_superuser_to("app").await.unwrap();
    app.batch_execute("BEGIN; LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let dba = s.pg.connect_as_superuser().await.unwrap();
    dba.batch_execute("BEGIN; ALTER DATABASE app CONNECTION LIMIT 7")
        .await
        .unwrap();

    s.create_backup("app-locked", "app", json!({"maxRetries": 20}))
        .await;
    merge_patch(
        &s.databases(),
        "app",
        json!({"spec": {"connectionLimit": 5}}),
    )
    .await
    .unwrap();

    // Each says what it waits for, and neither is stuck.
    s.wait_backup(
        "app-locked",
        "a retry after LockTimeout on public.orders",
        READY,
        |b| {
            b.status.as_ref().is_some_and(|st| {
                st.conditions.iter().any(|c| {
                    c.message.contains("LockTimeout") && c.message.contains("public.orders")
                })
            })
        },
    )
    .await;
    s.wait_database(
        "app",
        Want::new("Ready", "False", Some("LockTimeout")),
        READY,
    )
    .await;

    // Released: the Backup completes, the Database converges.
    app.batch_execute("ROLLBACK").await.unwrap();
    dba.batch_execute("ROLLBACK").await.unwrap();
    s.wait_completed("app-locked", READY).await;
    s.wait_database("app", Want::provisioned(), READY).await;
    assert_eq!(s.pg.connlimit("app").await.unwrap(), Some(5));
}
