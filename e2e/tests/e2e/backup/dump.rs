//! A Backup is one pg_dump into one checksummed artifact, whatever crashes: a controller
//! killed mid-dump, two replicas and a dead runner.

use std::time::Duration;

use dbops_api::{Backup, BackupPhase};
use dbops_e2e::ControllerProcess;
use dbops_e2e::harness::backup::{
    BIG_DUMP, FINALIZER, READY, Setup, attempts, has, phase, verify_artifact,
};
use dbops_e2e::wait::ObjectView;
use dbops_e2e::wait::Want;
use serde_json::json;

/// (a) pgbench data is dumped into one artifact whose SHA-256 is in the status and the
/// manifest, and which pg_restore reads; nothing secret reaches the log.
#[tokio::test]
async fn a_backup_of_pgbench_data_completes_with_a_verified_artifact() {
    let s = Setup::new("bk-basic").await;
    s.create_pgbench_database("bench", 2).await;
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
        !raw.contains(&s.pg.test_admin_password()),
        "the admin password is in the backup-controller's log"
    );
}

/// (b) SIGKILL mid-dump: the restarted controller starts the Backup over (attempts 2)
/// into the same key; it ends Completed with exactly one artifact.
#[tokio::test]
async fn a_controller_killed_mid_dump_leaves_exactly_one_artifact() {
    let mut s = Setup::new("bk-crash").await;
    s.create_pgbench_database("big", 50).await;
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
    s.create_pgbench_database("big", 30).await;
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
