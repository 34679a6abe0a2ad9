//! The migration-controller against a real control plane, two real PostgreSQL servers
//! (source and target) and the other two controllers as processes: the saga moves a
//! Database with pgbench data while a writer keeps inserting, without losing a write the
//! writer saw committed; failures at Preflight, Snapshot and after the freeze roll back;
//! a controller killed at every step resumes to Succeeded without repeating DDL; Manual
//! cutover waits for approval; a second Migration of the same Database is refused, and
//! deleting an active Migration rolls it back.
//!
//! Each test has its own namespace, two servers, a backup store and the three controllers
//! (watching only that namespace, resync 5 s, backoff 1 s..5 s). No test prints a
//! password: logs are redacted before they are shown.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use dbops_api::{
    Backup, BackupPhase, MigrationPhase, MigrationStep, StepState,
};
use dbops_e2e::fixtures::approve_migration;
use dbops_e2e::tls::TestCa;
use dbops_e2e::wait::ObjectView;
use dbops_e2e::wait::{Want, wait_for};
use dbops_e2e::PgServer;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use dbops_e2e::harness::migration::{
    DEBUG_EXIT, READY, SAGA, SOURCE_ADMIN, Setup, TARGET_ADMIN, Writer,
    assert_each_once, assert_has_event, assert_step, bin, condition, phase_of, step_state,
};

/// (1) The happy path: pgbench data and a writer inserting numbered rows; the writer is
/// stopped by the freeze (loudly: every later attempt fails), every row it saw committed
/// is on the target, and the Database is Ready there with the same connection Secret.
#[tokio::test]
async fn a_database_moves_with_every_committed_write() {
    let mut s = Setup::new("mig-happy").await;
    s.start_migration_controller(&[]);
    // pgcrypto: an extension the owner does not own (created by the database-controller).
    s.create_database_with("app", &["pgcrypto"]).await;
    s.pgbench("app", 1).await;
    let c = s.connection("app").await;
    let owner = s.source.connect(&c.user, &c.password, "app").await.unwrap();
    owner
        .batch_execute(
            "CREATE TABLE writes (n bigint PRIMARY KEY); \
             CREATE TABLE hashed AS SELECT digest('x', 'sha256') AS h; \
             COMMENT ON TABLE writes IS 'numbered rows'",
        )
        .await
        .unwrap();
    drop(owner);

    let writer = Writer::start(s.source.port(), c.clone());
    wait_for(
        "the writer to commit 50 rows",
        Duration::from_secs(30),
        || async { Ok(writer.committed()) },
        |n| *n >= 50,
    )
    .await
    .unwrap();
    s.create_migration("app-move", "app", json!({})).await;
    let done = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let (committed, failed) = writer.finish().await;

    // The freeze stopped the writer, loudly, and for good.
    let first_failure = failed
        .first()
        .map(|(n, _)| *n)
        .expect("the freeze made writes fail");
    assert!(
        committed.iter().all(|n| *n < first_failure),
        "a write succeeded after the freeze: first failure at {first_failure}, last success {:?}",
        committed.last()
    );
    assert!(committed.len() >= 50);

    // Every committed row is on the target, and nothing the writer did not attempt.
    let target_db = s.target.connect_as_superuser_to("app").await.unwrap();
    let rows: BTreeSet<i64> = target_db
        .query("SELECT n FROM writes", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let committed_set: BTreeSet<i64> = committed.iter().copied().collect();
    assert!(
        committed_set.is_subset(&rows),
        "committed rows missing on the target: {:?}",
        committed_set.difference(&rows).take(10).collect::<Vec<_>>()
    );
    assert!(
        rows.iter().all(|n| *n <= first_failure),
        "the target holds rows never attempted before the freeze"
    );
    let accounts: i64 = target_db
        .query_one("SELECT count(*) FROM pgbench_accounts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(accounts, 100_000);
    let owner_of_table: String = target_db
        .query_one(
            "SELECT tableowner::text FROM pg_tables WHERE tablename = 'pgbench_accounts'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        owner_of_table, c.user,
        "objects belong to the Database's owner role"
    );
    let (hashed, comment): (i64, Option<String>) = {
        let row = target_db
            .query_one(
                "SELECT (SELECT count(*) FROM hashed WHERE h = digest('x', 'sha256')), \
                        obj_description('writes'::regclass, 'pg_class')",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        hashed, 1,
        "pgcrypto works on the target and the data matches"
    );
    assert_eq!(
        comment.as_deref(),
        Some("numbered rows"),
        "comments are copied"
    );

    // Every step Succeeded with times; the snapshot Backup Completed.
    let status = done.status.clone().unwrap();
    assert_eq!(status.steps.len(), 8);
    for step in &status.steps {
        assert_eq!(step.state, StepState::Succeeded, "{step:?}");
        assert!(
            step.started_at.is_some() && step.finished_at.is_some(),
            "{step:?}"
        );
    }
    assert!(condition(&done, "Ready").is_some_and(|c| c.status == "True"));
    let snapshot = status.snapshot_ref.clone().unwrap().name;
    let backup = Api::<Backup>::namespaced(s.b.client.clone(), s.ns())
        .get(&snapshot)
        .await
        .unwrap();
    assert_eq!(
        backup.status.as_ref().and_then(|b| b.phase),
        Some(BackupPhase::Completed)
    );

    // The Database is Ready on the target at the switched generation; the Secret (same
    // name) points there and works.
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(
        status.source_server.as_ref().map(|r| r.name.as_str()),
        Some(s.server(SOURCE_ADMIN).as_str()),
        "Preflight recorded the source server"
    );
    let db_status = db.status.clone().unwrap();
    assert!(db_status.observed_generation >= status.switched_generation);
    assert!(dbops_e2e::wait::database_has(
        &db,
        Want::new("Ready", "True", Some("Provisioned"))
    ));
    let after = s.connection("app").await;
    assert_eq!(after.port, s.target.port());
    let app = s
        .target
        .connect(&after.user, &after.password, &after.dbname)
        .await
        .expect("the connection Secret logs in on the target");
    app.execute("INSERT INTO writes (n) VALUES (-1)", &[])
        .await
        .expect("the target is writable for the application");

    // The source is kept frozen (sourceRetention Keep).
    let limit = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT datconnlimit::bigint FROM pg_database WHERE datname = 'app'",
    )
    .await;
    assert_eq!(limit, 0);

    // An Event per step, and the step durations in the metrics.
    let events = s.events_about("Migration", "app-move").await;
    for step in MigrationStep::DUMP {
        assert_has_event(&events, &format!("{}Succeeded", step.as_str()));
    }
    let (_, metrics) = s
        .migration_controller
        .as_ref()
        .unwrap()
        .get("/metrics")
        .unwrap();
    for step in MigrationStep::DUMP {
        let line = format!(
            "dbops_migration_step_duration_seconds_count{{step=\"{}\"}} 1",
            step.as_str()
        );
        assert!(metrics.contains(&line), "no {line} in\n{metrics}");
    }
}

/// (2a) A database of that name already on the target: Preflight fails, nothing is
/// changed anywhere, and the Migration ends RolledBack saying why.
#[tokio::test]
async fn a_name_conflict_on_the_target_fails_preflight_and_changes_nothing() {
    let mut s = Setup::new("mig-conflict").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    let admin = s.target.connect_as_superuser().await.unwrap();
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin
        .batch_execute("COMMENT ON DATABASE app IS 'someone else''s'")
        .await
        .unwrap();
    s.create_migration("app-move", "app", json!({})).await;
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, READY)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::Preflight));
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "NameConflict")
    );
    assert!(
        failed.message.contains("already exists"),
        "{}",
        failed.message
    );
    assert!(status.snapshot_ref.is_none(), "no snapshot was taken");
    assert_step(&m, MigrationStep::Snapshot, StepState::Pending);
    // Nothing changed: the foreign database keeps its comment, no role appeared, the
    // source stays writable.
    assert_eq!(
        s.target.database_comment("app").await.unwrap().as_deref(),
        Some("someone else's")
    );
    assert!(!s.target.role_exists("app").await.unwrap());
    let c = s.connection("app").await;
    s.source_writable("app", &c).await.unwrap();
    assert!(
        m.finalizers().is_empty(),
        "the finalizer is gone at the end"
    );
}

/// (2b) The snapshot Backup fails (the store cannot be written): RolledBack at Snapshot,
/// the source never frozen, the target untouched.
#[tokio::test]
async fn a_failed_snapshot_rolls_back() {
    let mut s = Setup::new("mig-snapfail").await;
    // The store breaks after the controllers started: this namespace's directory in it
    // is a regular file, so the snapshot's dump cannot be written.
    std::fs::write(s.store.path().join(s.ns()), b"not a directory").unwrap();
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-move", "app", json!({})).await;
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::Snapshot));
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "SnapshotFailed", "{failed:?}");
    assert!(status.freeze.is_none(), "the source was never frozen");
    assert_step(&m, MigrationStep::FreezeSource, StepState::Pending);
    let c = s.connection("app").await;
    s.source_writable("app", &c).await.unwrap();
    s.target.assert_dropped("app").await;
    let events = s.events_about("Migration", "app-move").await;
    assert_has_event(&events, "RolledBack");
}

/// (2c) The target goes away after the freeze: ProvisionTarget fails its attempts, the
/// rollback unfreezes exactly what was frozen, and the target (once back) is clean.
#[tokio::test]
async fn the_target_stopped_after_the_freeze_rolls_back_and_unfreezes() {
    let mut s = Setup::new("mig-tgtdown").await;
    s.create_database("app").await;
    let c = s.connection("app").await;
    // Stop right after ProvisionTarget's record says it began, before it touched anything.
    s.start_migration_controller(&["--debug-exit-at=ProvisionTarget:started"]);
    s.create_migration("app-move", "app", json!({})).await;
    let code = s.wait_migration_controller_exit(SAGA);
    assert_eq!(code, Some(DEBUG_EXIT));
    assert!(
        s.source_writable("app", &c).await.is_err(),
        "the source is frozen at this point"
    );
    s.target.stop().unwrap();
    s.start_migration_controller(&["--step-max-attempts=2"]);
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::ProvisionTarget));
    assert_eq!(condition(&m, "Failed").unwrap().reason, "ServerUnreachable");
    assert_step(&m, MigrationStep::FreezeSource, StepState::Compensated);
    // Exactly what was frozen is undone: the limit and the setting as they were.
    s.source_writable("app", &c).await.unwrap();
    let limit = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT datconnlimit::bigint FROM pg_database WHERE datname = 'app'",
    )
    .await;
    assert_eq!(limit, -1);
    let settings = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = 'app'",
    )
    .await;
    assert_eq!(
        settings, 0,
        "default_transaction_read_only was reset, not set off"
    );
    s.target.start_again().await.unwrap();
    s.target.assert_dropped("app").await;
}

/// (2d) The target goes away after ProvisionTarget created the role and database there:
/// CopyData fails, the rollback unfreezes the source at once although the target's
/// compensation cannot run yet, and completes (target clean) once the target is back.
#[tokio::test]
async fn a_target_down_during_the_copy_holds_up_only_its_own_compensation() {
    let mut s = Setup::new("mig-tgtlate").await;
    s.create_database("app").await;
    let c = s.connection("app").await;
    s.start_migration_controller(&["--debug-exit-at=CopyData:started"]);
    s.create_migration("app-move", "app", json!({})).await;
    assert_eq!(s.wait_migration_controller_exit(SAGA), Some(DEBUG_EXIT));
    assert!(s.target.database_exists("app").await.unwrap());
    s.target.stop().unwrap();
    s.start_migration_controller(&["--step-max-attempts=2", "--breaker-open-for=2s"]);
    let m = s
        .wait_migration(
            "app-move",
            "rolling back with the target's compensation pending",
            SAGA,
            |m| {
                phase_of(m) == Some(MigrationPhase::RollingBack)
                    && step_state(m, MigrationStep::FreezeSource) == Some(StepState::Compensated)
            },
        )
        .await;
    assert_eq!(
        m.status.as_ref().unwrap().failed_step,
        Some(MigrationStep::CopyData)
    );
    assert_eq!(
        step_state(&m, MigrationStep::ProvisionTarget),
        Some(StepState::Succeeded),
        "not compensated while the target is down"
    );
    s.source_writable("app", &c)
        .await
        .expect("the source is writable again while the target is down");

    s.target.start_again().await.unwrap();
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    assert_step(&m, MigrationStep::ProvisionTarget, StepState::Compensated);
    s.assert_back_on_source("app").await;
}

/// (3) The controller exits at every step, after the step's effects and before its record
/// says Succeeded (and at a few step starts); each new process resumes, and in the end
/// the Migration Succeeded with every DDL statement run once.
#[tokio::test]
async fn a_controller_killed_at_every_step_resumes_to_succeeded() {
    let mut s = Setup::new("mig-crash").await;
    s.create_database("app").await;
    s.pgbench("app", 1).await;
    s.create_migration("app-move", "app", json!({"sourceRetention": "Drop"}))
        .await;
    let mut points: Vec<String> = MigrationStep::DUMP
        .iter()
        .map(|step| format!("{}:done", step.as_str()))
        .collect();
    points.insert(4, "CopyData:started".into());
    points.insert(7, "SwitchTraffic:started".into());
    for point in &points {
        s.start_migration_controller(&[&format!("--debug-exit-at={point}")]);
        let code = s.wait_migration_controller_exit(SAGA);
        assert_eq!(code, Some(DEBUG_EXIT), "the process stopped at {point}");
    }
    s.start_migration_controller(&[]);
    let m = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    for step in MigrationStep::DUMP {
        assert_step(&m, step, StepState::Succeeded);
    }
    // Exactly one snapshot, dumped once.
    let backups = Api::<Backup>::namespaced(s.b.client.clone(), s.ns())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(backups.len(), 1);
    assert_eq!(backups[0].status.as_ref().and_then(|b| b.attempts), Some(1));
    // The data is there, once.
    let accounts =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM pgbench_accounts")
            .await;
    assert_eq!(accounts, 100_000);
    // No side effect was repeated: each DDL of the saga ran once.
    let target_ddl = s.target.ddl_statements().unwrap();
    let source_ddl = s.source.ddl_statements().unwrap();
    assert_each_once(
        &target_ddl,
        &[
            "CREATE ROLE \"app\"",
            "CREATE DATABASE \"app\"",
            "CREATE TABLE public.pgbench_accounts",
        ],
    );
    assert_each_once(
        &source_ddl,
        &["CONNECTION LIMIT 0", "DROP DATABASE IF EXISTS \"app\""],
    );
    // sourceRetention Drop: the source database and role are gone; the Database lives on
    // the target.
    s.source.assert_dropped("app").await;
    let c = s.connection("app").await;
    assert_eq!(c.port, s.target.port());
    s.target
        .connect(&c.user, &c.password, &c.dbname)
        .await
        .expect("the Secret logs in on the target");
}

/// (4) Manual cutover: the Migration waits in AwaitingApproval after Verify with the
/// Database untouched; `approved: true` switches it.
#[tokio::test]
async fn a_manual_cutover_waits_for_approval() {
    let mut s = Setup::new("mig-manual").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-move", "app", json!({"cutover": "Manual"}))
        .await;
    let m = s
        .wait_phase("app-move", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    assert_step(&m, MigrationStep::Verify, StepState::Succeeded);
    assert_step(&m, MigrationStep::SwitchTraffic, StepState::Pending);
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(
        db.spec.server_ref.name,
        s.server(SOURCE_ADMIN),
        "not switched yet"
    );
    assert_eq!(s.connection("app").await.port, s.source.port());

    approve_migration(&s.migrations(), "app-move")
        .await
        .unwrap();
    s.wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(s.connection("app").await.port, s.target.port());
}

/// (5) A second Migration of a Database with an active one is refused with a condition;
/// deleting the active one (parked for approval) rolls it back before it goes.
#[tokio::test]
async fn a_second_migration_is_refused_and_a_deleted_one_rolls_back() {
    let mut s = Setup::new("mig-second").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("first", "app", json!({"cutover": "Manual"}))
        .await;
    s.wait_phase("first", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    s.create_migration("second", "app", json!({})).await;
    let second = s.wait_phase("second", MigrationPhase::Failed, READY).await;
    let ready = condition(&second, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "MigrationAlreadyActive")
    );
    assert!(ready.message.contains("first"), "{}", ready.message);
    assert!(
        second.status.as_ref().unwrap().steps.is_empty(),
        "the refused Migration did nothing"
    );
    let first = s.migrations().get("first").await.unwrap();
    assert_eq!(phase_of(&first), Some(MigrationPhase::AwaitingApproval));

    // Deleting the parked Migration rolls it back first: the source is writable again,
    // the target clean, and then the Migration is gone.
    let c = s.connection("app").await;
    assert!(
        s.source_writable("app", &c).await.is_err(),
        "frozen while parked"
    );
    s.migrations()
        .delete("first", &DeleteParams::default())
        .await
        .unwrap();
    let api = s.migrations();
    wait_for(
        "Migration first to be gone",
        SAGA,
        || async { Ok(api.get_opt("first").await?.map(ObjectView)) },
        |m| m.is_none(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", s.log("migration-controller", 8000)));
    s.source_writable("app", &c).await.unwrap();
    s.assert_back_on_source("app").await;
}

/// (6) A whole Migration is one trace in a real Jaeger: the migration-controller's
/// reconciles, the backup-controller's dump of the snapshot Backup, and the
/// database-controller's reconcile after the switch, found through Jaeger's HTTP API by
/// the trace id the Migration carries in `dbops.dev/traceparent`.
#[tokio::test]
async fn a_migration_is_one_trace_across_the_three_controllers() {
    let mut s = Setup::traced("mig-trace").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-move", "app", json!({})).await;
    let m = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let traceparent = m
        .annotations()
        .get("dbops.dev/traceparent")
        .cloned()
        .unwrap_or_else(|| panic!("no dbops.dev/traceparent on the Migration"));
    let trace_id = traceparent.split('-').nth(1).unwrap().to_string();
    let snapshot = Api::<Backup>::namespaced(s.b.client.clone(), s.ns())
        .get("app-move-snapshot")
        .await
        .unwrap();
    assert_eq!(
        snapshot
            .annotations()
            .get("dbops.dev/traceparent")
            .map(|t| t.split('-').nth(1)),
        Some(Some(trace_id.as_str())),
        "the snapshot Backup continues the Migration's trace"
    );

    let services = [
        "dbops-backup-controller",
        "dbops-database-controller",
        "dbops-migration-controller",
    ];
    let jaeger = s.jaeger.as_ref().unwrap();
    // Spans are exported in batches: wait for all three services in the one trace.
    let trace = wait_for(
        "the Migration's trace with spans of all three controllers",
        READY,
        || async { jaeger.trace(&trace_id).map(Some).or_else(|_| Ok(None)) },
        |t| {
            t.as_ref()
                .is_some_and(|t| services.iter().all(|svc| t.services().contains(svc)))
        },
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(trace.services(), services.into());
    let ops = |service: &str, op: &str| {
        trace
            .spans_of(service, op)
            .filter(|sp| sp.tag("object.namespace").as_deref() == Some(s.ns()))
            .count()
    };
    assert!(ops("dbops-migration-controller", "reconcile Migration") >= 3);
    assert!(
        trace
            .spans_of("dbops-backup-controller", "reconcile Backup")
            .any(|sp| sp.tag("object.name").as_deref() == Some("app-move-snapshot")),
        "no reconcile of the snapshot Backup in the trace"
    );
    assert!(
        trace
            .spans_of("dbops-database-controller", "reconcile Database")
            .any(|sp| sp.tag("object.name").as_deref() == Some("app")),
        "no reconcile of the switched Database in the trace"
    );
    // SQL of the saga on both servers is in it, never a password.
    let statements: Vec<String> = trace
        .spans
        .iter()
        .filter_map(|sp| sp.tag("db.statement"))
        .collect();
    assert!(statements.iter().any(|st| st.contains("CREATE DATABASE")));
    for st in &statements {
        assert!(!st.contains("SCRAM-SHA-256$"), "a verifier in a span: {st}");
        assert!(!st.contains(s.source.superuser_password()));
        assert!(!st.contains(s.target.superuser_password()));
    }
}

/// Waits until the Database with `uid` is gone.
async fn wait_database_gone(s: &Setup, name: &str, uid: &str) {
    if let Err(e) = dbops_e2e::wait::deleted(s.databases(), name, uid, SAGA).await {
        panic!(
            "{e:#}:\n{}\n---- database-controller log ----\n{}",
            dbops_e2e::wait::describe_database(&s.databases(), name).await,
            s.log("database-controller", 6000)
        );
    }
}

/// Issue 10, item 3: a Database deleted while its Migration waits for a Manual cutover,
/// then the Migration approved. Before, the Database waited for the Migration and the
/// Migration for the Database (Ready on the target) forever. Now a Migration that has not
/// switched rolls back at once (`DatabaseDeleted`): the source is unfrozen and then
/// dropped by the Database's `deletionPolicy: Delete`, the target is left clean, and
/// neither object is stuck.
#[tokio::test]
async fn deleting_a_database_awaiting_cutover_rolls_its_migration_back() {
    let mut s = Setup::new("mig-del-approve").await;
    s.start_migration_controller(&[]);
    let db = s
        .create_database_spec("app", json!({"deletionPolicy": "Delete"}))
        .await;
    s.create_migration("app-move", "app", json!({"cutover": "Manual"}))
        .await;
    s.wait_phase("app-move", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    s.databases()
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    approve_migration(&s.migrations(), "app-move")
        .await
        .unwrap();
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "DatabaseDeleted", "{}", failed.message);
    wait_database_gone(&s, "app", db.metadata.uid.as_deref().unwrap()).await;
    assert!(
        !s.source.database_exists("app").await.unwrap(),
        "Delete: the source is dropped"
    );
    assert!(
        !s.target.database_exists("app").await.unwrap(),
        "the target is clean"
    );
    assert!(
        !s.target.role_exists("app").await.unwrap(),
        "the target is clean"
    );
}

/// Issue 10, item 3, at every step: the migration-controller stops right after a step's
/// Running record (`--debug-exit-at=<Step>:started`), the Database (deletionPolicy
/// Delete) is deleted, and a new controller process takes over. Before SwitchTraffic has
/// changed the Database's server the Migration rolls back (`DatabaseDeleted`) and the
/// source database is dropped; at Cleanup (switched) it finishes, and the Database's
/// policy drops the database on the target. Both objects end every time.
#[tokio::test]
async fn deleting_a_database_at_any_step_of_its_migration_ends_both() {
    let mut s = Setup::new("mig-del-steps").await;
    for (i, step) in MigrationStep::DUMP.into_iter().enumerate() {
        let name = format!("app{i}");
        let db = s
            .create_database_spec(&name, json!({"deletionPolicy": "Delete"}))
            .await;
        let migration = format!("{name}-move");
        s.create_migration(&migration, &name, json!({})).await;
        let point = format!("{}:started", step.as_str());
        s.start_migration_controller(&[&format!("--debug-exit-at={point}")]);
        let code = s.wait_migration_controller_exit(SAGA);
        assert_eq!(code, Some(DEBUG_EXIT), "the process stopped at {point}");
        s.databases()
            .delete(&name, &DeleteParams::default())
            .await
            .unwrap();
        s.start_migration_controller(&[]);
        let m = s
            .wait_migration(&migration, "an end", SAGA, |m| {
                matches!(
                    phase_of(m),
                    Some(MigrationPhase::RolledBack | MigrationPhase::Succeeded)
                )
            })
            .await;
        wait_database_gone(&s, &name, db.metadata.uid.as_deref().unwrap()).await;
        let switched = step > MigrationStep::SwitchTraffic;
        if switched {
            assert_eq!(
                phase_of(&m),
                Some(MigrationPhase::Succeeded),
                "deleted at {point}"
            );
            assert!(
                !s.target.database_exists(&name).await.unwrap(),
                "deleted at {point}: the policy Delete drops the database where it now lives"
            );
        } else {
            assert_eq!(
                phase_of(&m),
                Some(MigrationPhase::RolledBack),
                "deleted at {point}"
            );
            assert_eq!(
                condition(&m, "Failed").map(|c| c.reason.as_str()),
                Some("DatabaseDeleted"),
                "deleted at {point}"
            );
            assert!(
                !s.source.database_exists(&name).await.unwrap(),
                "deleted at {point}: the source is dropped after the rollback"
            );
            assert!(
                !s.target.database_exists(&name).await.unwrap()
                    && !s.target.role_exists(&name).await.unwrap(),
                "deleted at {point}: the target is clean"
            );
        }
        // Its finalizer is gone too: nothing holds the Migration any more.
        s.wait_migration(&migration, "no finalizer", READY, |m| {
            m.metadata.finalizers.iter().flatten().next().is_none()
        })
        .await;
        s.stop_migration_controller();
    }
}

/// Issue 10, "also found": CopyData decides that an earlier attempt committed by counting
/// user objects in the target database; a schema that belongs to an extension (one
/// ProvisionTarget created) made it skip the copy, and Verify then rolled the Migration
/// back. The controller stops after ProvisionTarget; the target database then gets what
/// such an extension brings, a schema of its own (`ALTER EXTENSION ... ADD SCHEMA`); the
/// next process must still copy every row.
#[tokio::test]
async fn an_extension_schema_on_the_target_does_not_pass_for_copied_data() {
    let mut s = Setup::new("mig-ext-schema").await;
    s.create_database_with("app", &["pgcrypto"]).await;
    s.pgbench("app", 1).await;
    s.create_migration("app-move", "app", json!({})).await;
    s.start_migration_controller(&["--debug-exit-at=ProvisionTarget:done"]);
    assert_eq!(s.wait_migration_controller_exit(SAGA), Some(DEBUG_EXIT));
    let t = s.target.connect_as_superuser_to("app").await.unwrap();
    t.batch_execute("CREATE SCHEMA pgcrypto_own; ALTER EXTENSION pgcrypto ADD SCHEMA pgcrypto_own")
        .await
        .unwrap();
    s.start_migration_controller(&[]);
    let m = s
        .wait_migration("app-move", "an end", SAGA, |m| {
            matches!(
                phase_of(m),
                Some(MigrationPhase::RolledBack | MigrationPhase::Succeeded)
            )
        })
        .await;
    assert_eq!(
        phase_of(&m),
        Some(MigrationPhase::Succeeded),
        "{:?}",
        ObjectView(m.clone())
    );
    let accounts =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM pgbench_accounts")
            .await;
    assert_eq!(accounts, 100_000);
}

/// TLS end to end: with both servers refusing every login without TLS (but the harness's)
/// and `verify-full` against their own CA, a Database is provisioned, backed up (pg_dump
/// reads the CA from a private file), restored (pg_restore likewise) and moved to the other
/// server; the application logs in on the target with the connection Secret alone.
#[tokio::test]
async fn backup_restore_and_migration_work_over_verified_tls() {
    let ca = TestCa::new("dbops-test-ca").unwrap();
    let mut s = Setup::over_tls("mig-tls", &ca).await;
    // The rule is live: a plain TCP login is refused.
    let plain = s.source.connect("dbops_admin", "x", "postgres").await;
    assert!(plain.is_err(), "a plain TCP login must be refused");
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.pgbench("app", 1).await;

    // A Backup over TLS, then a Database restored from it over TLS.
    let backup: Backup = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": "app-tls"},
        "spec": {"databaseRef": {"name": "app"}},
    }))
    .unwrap();
    let backups: Api<Backup> = Api::namespaced(s.b.client.clone(), s.ns());
    backups
        .create(&PostParams::default(), &backup)
        .await
        .unwrap();
    let done = wait_for(
        "Backup app-tls Completed",
        READY,
        || async { Ok(backups.get("app-tls").await?) },
        |b: &Backup| b.status.as_ref().and_then(|st| st.phase) == Some(BackupPhase::Completed),
    )
    .await;
    if let Err(e) = done {
        panic!(
            "{e:#}\n---- backup-controller log ----\n{}",
            s.log("backup-controller", 6000)
        );
    }
    s.create_database_spec(
        "restored",
        json!({"restoreFrom": {"backupRef": {"name": "app-tls"}}}),
    )
    .await;
    let restored = Setup::superuser_scalar_i64(
        &s.source,
        "restored",
        "SELECT count(*) FROM pgbench_accounts",
    )
    .await;
    assert_eq!(restored, 100_000);

    // The Migration, over TLS on both ends.
    s.create_migration("app-move", "app", json!({})).await;
    s.wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let moved =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM pgbench_accounts")
            .await;
    assert_eq!(moved, 100_000);

    // The application on the target: the Secret's keys, its ca.crt as a mounted file.
    assert_eq!(s.connection("app").await.port, s.target.port());
    let secret = Api::<Secret>::namespaced(s.b.client.clone(), s.ns())
        .get("app-connection")
        .await
        .unwrap();
    let data = secret.data.unwrap_or_default();
    let value = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
    assert_eq!(value("sslmode"), "verify-full");
    assert_eq!(value("ca.crt"), ca.pem());
    let mounted = tempfile::tempdir().unwrap();
    std::fs::write(mounted.path().join("ca.crt"), value("ca.crt")).unwrap();
    let out = Command::new(bin("psql"))
        .env_clear()
        .env("PGHOST", value("PGHOST"))
        .env("PGPORT", value("PGPORT"))
        .env("PGUSER", value("PGUSER"))
        .env("PGPASSWORD", value("PGPASSWORD"))
        .env("PGDATABASE", value("PGDATABASE"))
        .env("PGSSLMODE", value("PGSSLMODE"))
        .env("PGSSLROOTCERT", mounted.path().join("ca.crt"))
        .args([
            "-X",
            "-A",
            "-t",
            "-c",
            "SELECT count(*) FROM pgbench_accounts",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the application's verify-full login on the target: {}",
        s.redact(&String::from_utf8_lossy(&out.stderr))
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100000");
}

// ---- Issue 13 groundwork: the Logical mode's Preflight --------------------------------

/// The migration-controller's Logical-mode Preflight, compiled from its source: the
/// controller is a binary without a library target to depend on.
#[path = "../../../migration-controller/src/logical.rs"]
mod logical;

/// Settings that need a restart (`wal_level`, `max_replication_slots`...): written with
/// `ALTER SYSTEM` (postgresql.auto.conf; the harness passes none of them with `-c`), then
/// the server restarted on the same data.
async fn restart_with(pg: &mut PgServer, settings: &[(&str, &str)]) {
    let client = pg.connect_as_superuser().await.unwrap();
    for (name, value) in settings {
        client
            .batch_execute(&format!(
                "ALTER SYSTEM SET {name} = {}",
                dbops_e2e::postgres::quote_literal(value)
            ))
            .await
            .unwrap();
    }
    drop(client);
    pg.stop().unwrap();
    pg.start_again().await.unwrap();
}

/// The Preflight as the controller would run it: the admin's session (a
/// `dbops_shared::postgres::Session`) on the source database.
async fn logical_preflight(pg: &PgServer, dbname: &str) -> Vec<logical::Unmet> {
    use dbops_shared::postgres::{Credentials, Endpoint, Servers};
    let endpoint = Endpoint::new("127.0.0.1", pg.port(), dbops_api::TlsMode::Disable);
    let credentials = Credentials {
        username: "postgres".into(),
        password: pg.superuser_password().into(),
    };
    let session = Servers::new(1, 5, Duration::from_secs(30))
        .connect(&endpoint, &credentials, dbname)
        .await
        .unwrap();
    // A target of 17: what these tests look at is the source.
    let unmet = logical::preflight(&session, 170000, "17").await.unwrap();
    println!(
        "{dbname} on {}: {:?}",
        pg.port(),
        logical::condition(&unmet)
    );
    unmet
}

/// Backends of type walsender on `pg`.
async fn wal_senders(pg: &PgServer) -> i64 {
    pg.connect_as_superuser()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn logical_preflight_names_each_missing_prerequisite() {
    use logical::{Mode, Unmet, auto_mode};
    let (default, logical_server) = tokio::join!(
        PgServer::start("preflight-default"),
        PgServer::start("preflight-logical"),
    );
    let (default, mut pg) = (default.unwrap(), logical_server.unwrap());
    restart_with(
        &mut pg,
        &[
            ("wal_level", "logical"),
            ("max_replication_slots", "1"),
            ("max_wal_senders", "1"),
        ],
    )
    .await;

    // (a) A default server: wal_level replica, and nothing else missing.
    let unmet = logical_preflight(&default, "postgres").await;
    assert_eq!(
        unmet,
        [Unmet::WalLevelNotLogical {
            wal_level: "replica".into()
        }]
    );
    assert!(
        unmet[0]
            .message()
            .contains("ALTER SYSTEM SET wal_level = logical and restart")
    );

    // (b) Tables: no primary key (refused); REPLICA IDENTITY FULL, USING INDEX, a primary
    // key in another schema (accepted); and a large object.
    let admin = pg.connect_as_superuser().await.unwrap();
    for db in ["messy", "clean"] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
    }
    pg.connect_as_superuser_to("messy")
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE keyed (id int PRIMARY KEY); \
             CREATE TABLE no_pk (v text); \
             CREATE TABLE full_identity (v text); \
             ALTER TABLE full_identity REPLICA IDENTITY FULL; \
             CREATE TABLE by_index (id int NOT NULL, v text); \
             CREATE UNIQUE INDEX by_index_id ON by_index (id); \
             ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_id; \
             CREATE SCHEMA other; CREATE TABLE other.keyed (id int PRIMARY KEY); \
             SELECT lo_from_bytea(0, 'a large object')",
        )
        .await
        .unwrap();
    let unmet = logical_preflight(&pg, "messy").await;
    assert_eq!(
        unmet,
        [
            Unmet::TablesWithoutReplicaIdentity {
                tables: vec!["public.no_pk".into()]
            },
            Unmet::LargeObjectsPresent { count: 1 },
        ]
    );
    assert_eq!(
        auto_mode(unmet.clone()),
        Mode::Dump {
            because: unmet.clone()
        }
    );

    // (d) A clean database on the logical server: everything met, Auto picks Logical.
    let clean = pg.connect_as_superuser_to("clean").await.unwrap();
    clean
        .batch_execute("CREATE TABLE keyed (id int PRIMARY KEY, v text)")
        .await
        .unwrap();
    let unmet = logical_preflight(&pg, "clean").await;
    assert_eq!(unmet, []);
    assert_eq!(auto_mode(unmet), Mode::Logical);

    // (c) The only replication slot taken.
    clean
        .query_one(
            "SELECT slot_name::text FROM pg_create_logical_replication_slot('x', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let no_slot = Unmet::NoFreeReplicationSlot { max: 1, in_use: 1 };
    assert_eq!(
        logical_preflight(&pg, "clean").await,
        std::slice::from_ref(&no_slot)
    );

    // (e) The only WAL sender taken too (a physical WAL stream without a slot): both
    // reported at once.
    let wal = tempfile::tempdir().unwrap();
    let mut receiver = tokio::process::Command::new(pg.bin_dir().join("pg_receivewal"))
        .env("PGPASSWORD", pg.superuser_password())
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port().to_string(),
            "-U",
            "postgres",
        ])
        // No --slot: pg_receivewal then streams without one.
        .args(["--no-loop", "--no-password", "-D"])
        .arg(wal.path())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while wal_senders(&pg).await < 1 {
        let exited = receiver.try_wait().unwrap();
        assert!(
            exited.is_none() && std::time::Instant::now() < deadline,
            "pg_receivewal never streamed ({exited:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        logical_preflight(&pg, "clean").await,
        [no_slot, Unmet::NoFreeWalSender { max: 1, active: 1 }]
    );

    // Both given back: the slot dropped, the stream ended; everything met again.
    receiver.kill().await.unwrap();
    while wal_senders(&pg).await > 0 {
        assert!(std::time::Instant::now() < deadline, "the WAL sender stays");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    clean
        .batch_execute("SELECT pg_drop_replication_slot('x')")
        .await
        .unwrap();
    assert_eq!(logical_preflight(&pg, "clean").await, []);
}
