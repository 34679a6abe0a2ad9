//! Leader election (`--leader-elect`) of the database-controller against the real
//! apiserver and PostgreSQL: two replicas, Databases created over time, the leader
//! SIGKILLed twice and SIGTERMed once. The standby takes over within the Lease duration
//! plus a few seconds (measured and printed), only the Lease holder writes (the audit
//! log, one client-certificate identity per replica), SIGTERM releases the Lease and the
//! standby takes it at once, and every Database ends Ready once, with one role and one
//! database each. A leader frozen (SIGSTOP) past its Lease steps down when it runs again,
//! without a write; a leader cut off from the apiserver steps down before its Lease
//! expires, so before any other replica can lead.
//!
//! The same for the backup-controller (Backups of pgbench data created over time, the
//! leader killed twice, once mid-dump: one checksummed artifact per Backup, nothing
//! partial) and the migration-controller (two Migrations, the leader killed twice during
//! CopyData: both Succeeded, every DDL statement on the target ran once), each beside single
//! replicas of the controllers it needs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dbops_api::{Backup, BackupPhase, Migration, MigrationPhase, MigrationStep};
use dbops_e2e::PgServer;
use dbops_e2e::harness::backup::sha256_of;
use dbops_e2e::harness::leader::{
    LEASE_DURATION, MIGRATION_PGBENCH_SCALE, Proxy, Scenario, TAKEOVER_AFTER_RELEASE,
    TAKEOVER_SLACK, TARGET_ADMIN, WORK, assert_takeovers_in_time, await_takeover, backup_phase,
    current_step, ddl_key, kill_leader, kill_leader_and_measure_takeover, migration_phase, pg_bin,
};
use dbops_e2e::harness::object::InBed;
use dbops_e2e::postgres::admin::AdminKind;
use dbops_e2e::postgres::redact_passwords;
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

#[tokio::test]
async fn a_killed_leader_is_replaced_and_only_the_holder_writes() {
    let mut s = Scenario::new("leader").await;

    // Two replicas: one leads, the other stands by (and says so on /readyz).
    let (_, standby) = s.start_leader_and_standby().await;
    s.create_ready_database().await;
    let (code, body) = s.replicas[standby]
        .process
        .as_ref()
        .unwrap()
        .get("/readyz")
        .unwrap();
    assert_eq!(code, 200, "a standby is ready: {body}");
    assert!(body.contains("standby"), "{body}");

    // Twice: the leader is SIGKILLed, the standby takes over, a fresh replica stands by.
    let mut takeovers = Vec::new();
    for round in 1..=2 {
        takeovers.push(kill_leader_and_measure_takeover(&mut s, round).await);
        s.start_replica().await;
        s.create_ready_database().await;
    }
    for takeover in &takeovers {
        assert!(
            *takeover <= LEASE_DURATION + TAKEOVER_SLACK,
            "takeover after SIGKILL took {takeover:?}: more than the Lease ({LEASE_DURATION:?}) \
             plus {TAKEOVER_SLACK:?}"
        );
    }

    // SIGTERM: the leader stops cleanly and releases the Lease on its way out.
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let leader_identity = s.replicas[leader].identity.clone();
    let termed_at = Instant::now();
    let status = s.stop(leader, "TERM");
    let stopped_in = termed_at.elapsed();
    assert!(
        status.success(),
        "SIGTERM: exit {status}\n{}",
        s.logs_text()
    );
    let after_exit = s.holder().await.unwrap();
    assert!(
        after_exit
            .as_ref()
            .is_none_or(|(holder, _)| *holder != leader_identity),
        "the Lease still names {leader_identity} after it exited on SIGTERM: {after_exit:?}"
    );
    let released_at = Instant::now();
    s.wait_holder(standby, LEASE_DURATION + TAKEOVER_SLACK)
        .await;
    let takeover = released_at.elapsed();
    println!(
        "leader election: SIGTERM of {leader_identity}: exited after {:.1} s with the Lease \
         released; {} took over {:.1} s after the exit",
        stopped_in.as_secs_f64(),
        s.replicas[standby].identity,
        takeover.as_secs_f64()
    );
    assert!(
        takeover <= TAKEOVER_AFTER_RELEASE,
        "a released Lease was taken over {takeover:?} after the exit, not within \
         {TAKEOVER_AFTER_RELEASE:?}\n{}",
        s.logs_text()
    );
    s.create_ready_database().await;

    // Stop everything before counting, so no write happens while the log is read.
    for i in 0..s.replicas.len() {
        if s.replicas[i].process.is_some() {
            s.stop(i, "TERM");
        }
    }

    // Only the holder wrote: each replica's writes (other than to the Lease) fall between
    // its acquisition of the Lease and its end; a replica that never led wrote nothing.
    let writers = s.assert_only_leaders_wrote();
    assert!(
        writers >= 3,
        "three leaders in turn, each provisioning: {writers} wrote"
    );

    s.assert_each_database_ready_once().await;
}

#[tokio::test]
async fn a_frozen_leader_steps_down_without_a_stale_write() {
    let mut s = Scenario::new("leader-frozen").await;
    let (leader, standby) = s.start_leader_and_standby().await;
    let first = s.create_ready_database().await;
    // The leader is idle once the Event that follows the Ready status is written.
    s.wait_provisioned_event(&first).await;

    // SIGSTOP: the leader neither renews nor notices anything; its Lease expires and the
    // standby takes over and provisions what is created meanwhile.
    let frozen = s.replicas[leader].identity.clone();
    let stopped = Instant::now();
    s.freeze(leader);
    // Taken once it is stopped: a write it made just before (a status patch on its way
    // when the signal came) is received before this.
    let frozen_at = Timestamp::now();
    let during = s.create_database().await;
    s.wait_takeover_by(standby).await;
    println!(
        "leader election: {frozen} frozen; {} took over after {:.1} s",
        s.replicas[standby].identity,
        stopped.elapsed().as_secs_f64()
    );
    s.wait_ready(&during).await;
    // Work that the frozen replica's watch delivers the moment it runs again.
    let stale = s.create_database().await;

    // SIGCONT: it steps down at once, writes nothing, and leaves the Lease alone.
    let resumed = Instant::now();
    let resumed_at = Timestamp::now();
    s.signal(leader, "CONT");
    let mut process = s.replicas[leader].process.take().unwrap();
    let status = process.process.wait_exit(Duration::from_secs(10)).unwrap();
    s.replicas[leader].ended = Some(Timestamp::now());
    let log = redact_passwords(&process.process.log_tail(4000));
    println!(
        "leader election: {frozen} resumed and exited ({status}) after {:.1} s",
        resumed.elapsed().as_secs_f64()
    );
    assert!(
        !status.success(),
        "a deposed leader exits with an error, to be restarted as a standby:\n{log}"
    );
    // Whichever notices first: the renew deadline, the Lease read, or the Lease manager.
    assert!(
        ["stepping down", "another holder", "lost leadership"]
            .iter()
            .any(|m| log.contains(m)),
        "{log}"
    );
    s.wait_ready(&stale).await;
    let holder = s.holder().await.unwrap().map(|(h, _)| h);
    assert_eq!(holder.as_ref(), Some(&s.replicas[standby].identity));

    // Nothing from the frozen replica after it was frozen: no object, no Event, no Lease.
    let late: Vec<_> =
        s.b.cp
            .audit_writes(&frozen, None)
            .unwrap()
            .into_iter()
            .filter(|w| w.received > frozen_at)
            .collect();
    assert!(
        late.is_empty(),
        "{frozen} (frozen at {frozen_at}, resumed at {resumed_at}) wrote after it was \
         frozen: {late:#?}"
    );

    for i in 0..s.replicas.len() {
        if s.replicas[i].process.is_some() {
            s.stop(i, "TERM");
        }
    }
    s.assert_each_database_ready_once().await;
}

// Multi-threaded: the proxy must keep forwarding while the test waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_apiserver_steps_down_before_its_lease_expires() {
    let mut s = Scenario::new("leader-cut").await;
    let apiserver_port: u16 =
        s.b.cp
            .server()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap();
    let proxy = Proxy::start(apiserver_port).await;

    // replica-0 reaches the apiserver through the proxy, and leads; replica-1 stands by.
    s.start_replica_via(Some(&proxy.url())).await;
    s.wait_holder(0, Duration::from_secs(30)).await;
    s.start_replica().await;
    let first = s.create_ready_database().await;
    s.wait_provisioned_event(&first).await;

    // The partition: replica-0 can neither renew its Lease nor learn that it lost it.
    let cut_at = Instant::now();
    proxy.cut();
    let leader = s.replicas[0].process.as_ref().unwrap();
    let stepped_down = dbops_e2e::wait::wait_for(
        "the cut-off leader to stop leading",
        LEASE_DURATION + TAKEOVER_SLACK,
        // A process that has exited (its health server gone) leads no more either.
        || async { Ok(leader.get("/readyz").unwrap_or((0, "exited".to_string()))) },
        |(_, body)| !body.contains("(leader)"),
    )
    .await;
    let stepped_down_at = Timestamp::now();
    let step_down = cut_at.elapsed();
    if let Err(e) = stepped_down {
        panic!("{e:#}\n{}", s.logs_text());
    }
    s.wait_holder(1, LEASE_DURATION + TAKEOVER_SLACK).await;
    let takeover = cut_at.elapsed();
    let (cut_off, standby) = (
        s.replicas[0].identity.clone(),
        s.replicas[1].identity.clone(),
    );
    let acquired = s.replicas[1]
        .acquired
        .expect("replica-1 acquired the Lease");
    println!(
        "leader election: {cut_off} cut off; it stopped leading after {:.1} s, {standby} \
         took over after {:.1} s",
        step_down.as_secs_f64(),
        takeover.as_secs_f64()
    );
    assert!(
        stepped_down_at < acquired,
        "{cut_off} stopped leading at {stepped_down_at}, after {standby} acquired the Lease \
         at {acquired}: two leaders at once\n{}",
        s.logs_text()
    );
    let mut process = s.replicas[0].process.take().unwrap();
    let status = process.process.wait_exit(Duration::from_secs(15)).unwrap();
    s.replicas[0].ended = Some(stepped_down_at);
    assert!(!status.success(), "a deposed leader exits with an error");
    let log = redact_passwords(&process.process.log_tail(4000));
    assert!(log.contains("not renewed in time"), "{log}");

    s.create_ready_database().await;
    s.stop(1, "TERM");
    drop(proxy);
    s.assert_each_database_ready_once().await;
}

/// Two backup-controller replicas while Backups of pgbench data are created over time and
/// the leader is SIGKILLed twice (once mid-dump when the dump is slow enough to be seen):
/// every Backup ends Completed with exactly one artifact and manifest whose checksum
/// matches, nothing partial is left, and each replica wrote only while it led.
#[tokio::test]
async fn two_backup_controllers_survive_two_killed_leaders() {
    let mut s = Scenario::for_controller("leader-backup", "backup-controller").await;
    let store_url = s.create_store();
    s.replica_args = vec![
        format!("--backup-store={store_url}"),
        format!("--pg-dump={}", pg_bin("pg_dump").display()),
    ];
    // The database-controller reads the store the backup-controller writes.
    s.start_single(
        "database-controller",
        &[format!("--backup-store={store_url}")],
    )
    .await;
    let db = s.create_ready_database().await;
    s.pgbench(&db, 5).await;

    s.start_replica().await;
    s.start_replica().await;
    let completed = |b: &Backup| backup_phase(b) == Some(BackupPhase::Completed);
    let mut backups: Vec<String> = Vec::new();
    let first = "snap-0".to_string();
    s.create_backup(&first, &db).await;
    s.wait_backup(&first, "Completed", WORK, completed).await;
    backups.push(first);

    let mut takeovers = Vec::new();
    for round in 1..=2 {
        // A Backup being dumped by the leader when it is killed...
        let busy = format!("snap-{}", backups.len());
        s.create_backup(&busy, &db).await;
        let seen = s
            .wait_backup(&busy, "Running or Completed", WORK, |b| {
                matches!(
                    backup_phase(b),
                    Some(BackupPhase::Running | BackupPhase::Completed)
                )
            })
            .await;
        println!(
            "leader election (backup-controller): SIGKILL {round} with {busy} {:?}",
            backup_phase(&seen)
        );
        backups.push(busy);
        // ...and one created while no replica leads.
        let kill = kill_leader(&mut s).await;
        let orphan = format!("snap-{}", backups.len());
        s.create_backup(&orphan, &db).await;
        backups.push(orphan);
        takeovers.push(await_takeover(&mut s, round, kill).await);
    }
    let last = format!("snap-{}", backups.len());
    s.create_backup(&last, &db).await;
    backups.push(last);
    assert_eq!(backups.len(), 6);

    let mut done = Vec::new();
    for name in &backups {
        done.push(s.wait_backup(name, "Completed", WORK, completed).await);
    }
    s.stop_all();
    assert_takeovers_in_time(&takeovers);

    // The store: exactly an artifact and a manifest per Backup, nothing else (no
    // `.partial`), and checksums that match the files.
    let dir = s.store.as_ref().unwrap().path().join(s.ns());
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let mut expected = Vec::new();
    for b in &done {
        let stem = format!(
            "{}-{}",
            b.metadata.name.as_deref().unwrap(),
            b.metadata.uid.as_deref().unwrap()
        );
        let artifact = dir.join(format!("{stem}.dump"));
        let manifest = dir.join(format!("{stem}.manifest.json"));
        let sum = sha256_of(&artifact);
        let status = b.status.as_ref().unwrap();
        assert_eq!(status.checksum.as_deref(), Some(sum.as_str()), "{stem}");
        assert_eq!(
            status.size_bytes,
            Some(i64::try_from(std::fs::metadata(&artifact).unwrap().len()).unwrap())
        );
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
        assert_eq!(m["checksum"], json!(sum), "{stem}");
        assert_eq!(m["backup"]["uid"], json!(b.metadata.uid), "{stem}");
        expected.push(format!("{stem}.dump"));
        expected.push(format!("{stem}.manifest.json"));
    }
    expected.sort();
    assert_eq!(
        files, expected,
        "exactly one artifact and manifest per Backup"
    );

    let writers = s.assert_only_leaders_wrote();
    assert!(
        writers >= 3,
        "three leaders in turn, each backing up: {writers} wrote"
    );
}

/// Two migration-controller replicas while two Migrations of pgbench data run, started
/// a few seconds apart, and the leader is SIGKILLed twice mid-saga: both Migrations
/// succeed, every DDL statement on the target ran once, the source was frozen once per
/// Database, and each replica wrote only while it led.
#[tokio::test]
async fn two_migration_controllers_survive_two_killed_leaders() {
    let mut s = Scenario::for_controller("leader-mig", "migration-controller").await;
    let target = PgServer::start("leader-mig-dst").await.unwrap();
    dbops_e2e::fixtures::create_admin_secret(&s.b.client, s.ns(), TARGET_ADMIN, &target)
        .await
        .unwrap();
    s.target = Some(target);
    let store_url = s.create_store();
    s.replica_args = vec![
        format!("--pg-dump={}", pg_bin("pg_dump").display()),
        format!("--pg-restore={}", pg_bin("pg_restore").display()),
    ];
    s.start_single(
        "database-controller",
        &[format!("--backup-store={store_url}")],
    )
    .await;
    s.start_single(
        "backup-controller",
        &[
            format!("--backup-store={store_url}"),
            format!("--pg-dump={}", pg_bin("pg_dump").display()),
            "--max-concurrent-backups=2".to_string(),
        ],
    )
    .await;
    // Enough data that CopyData (pg_restore) lasts long enough to be seen and killed.
    let mut dbs = Vec::new();
    for _ in 0..2 {
        let db = s.create_ready_database().await;
        s.pgbench(&db, MIGRATION_PGBENCH_SCALE).await;
        dbs.push(db);
    }

    s.start_replica().await;
    s.start_replica().await;
    s.leader().await;

    let terminal = |m: &Migration| {
        matches!(
            migration_phase(m),
            Some(MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::RolledBack)
        )
    };
    let copying = |m: &Migration| {
        current_step(m).is_some_and(|step| step >= MigrationStep::CopyData) || terminal(m)
    };
    let moves: Vec<String> = dbs.iter().map(|db| format!("{db}-move")).collect();
    let mut takeovers = Vec::new();
    // Round 1: the first Migration is copying data when its leader dies; the second is
    // created a moment later, while no replica leads.
    s.create_migration(&moves[0], &dbs[0]).await;
    for (round, name) in moves.iter().enumerate() {
        let round = round + 1;
        let m = s
            .wait_migration(name, "at CopyData or later", WORK, copying)
            .await;
        assert!(
            !terminal(&m),
            "{name} ended ({:?}) before the leader could be killed during it: use more \
             pgbench data",
            migration_phase(&m)
        );
        println!(
            "leader election (migration-controller): SIGKILL {round} with {name} at {:?}",
            current_step(&m)
        );
        let kill = kill_leader(&mut s).await;
        if round == 1 {
            s.create_migration(&moves[1], &dbs[1]).await;
        }
        takeovers.push(await_takeover(&mut s, round, kill).await);
    }
    for name in &moves {
        let m = s.wait_migration(name, "Succeeded", WORK, terminal).await;
        assert_eq!(
            migration_phase(&m),
            Some(MigrationPhase::Succeeded),
            "{name}: {:?}\n{}",
            m.status,
            s.logs_text()
        );
    }
    s.stop_all();
    assert_takeovers_in_time(&takeovers);

    // Every DDL statement on the target ran once (keyed by user@database and text); the
    // role and the database of each Database were created there once.
    let target = s.target.as_ref().unwrap();
    let target_ddl = target.ddl_statements().unwrap();
    // A password is set twice on the target by design: the random one ProvisionTarget
    // gives the role, then the Secret's when the Database arrives (a superuser admin
    // turns statement logging off for both; another admin cannot, so they are logged).
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for line in target_ddl.iter().filter(|l| !l.contains(" PASSWORD '")) {
        *counts.entry(ddl_key(line)).or_default() += 1;
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "DDL run more than once on the target: {repeated:#?}"
    );
    let source_ddl = s.pg.ddl_statements().unwrap();
    for db in &dbs {
        let pg_name = db.replace('-', "_");
        let count = |ddl: &[String], needle: &str| {
            ddl.iter()
                .filter(|l| l.contains(needle) && l.contains(&format!("\"{pg_name}\"")))
                .count()
        };
        assert_eq!(count(&target_ddl, "CREATE ROLE"), 1, "{target_ddl:#?}");
        assert_eq!(count(&target_ddl, "CREATE DATABASE"), 1, "{target_ddl:#?}");
        assert_eq!(
            target_ddl
                .iter()
                .filter(|l| l.contains(&format!("@{pg_name} "))
                    && l.contains("CREATE TABLE public.pgbench_accounts"))
                .count(),
            1,
            "{target_ddl:#?}"
        );
        assert_eq!(
            count(&source_ddl, AdminKind::for_tests().freeze_statement()),
            1,
            "{source_ddl:#?}"
        );
    }

    let writers = s.assert_only_leaders_wrote();
    assert!(
        writers >= 2,
        "the leaders in turn moved the Databases: {writers} wrote"
    );
}
