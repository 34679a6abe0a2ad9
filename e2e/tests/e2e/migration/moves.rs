//! A Database moves: with every committed write of a live writer, through a controller
//! killed at every step, after a Manual cutover's approval, as one trace across the three
//! controllers, and over verified TLS.

use std::process::Command;
use std::time::Duration;

use dbops_api::{Backup, BackupPhase, MigrationPhase, MigrationStep, StepState};
use dbops_e2e::fixtures::create_backup;
use dbops_e2e::harness::migration::{
    READY, SAGA, SOURCE_ADMIN, Setup, TARGET_ADMIN, Writer, assert_each_once,
    assert_every_commit_in, assert_has_event, assert_step, bin, condition, writes_on,
};
use dbops_e2e::postgres::admin::AdminKind;
use dbops_e2e::postgres::scalar;
use dbops_e2e::tls::TestCa;
use dbops_e2e::wait::{Want, wait_for};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;

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
    writer.wait_commits(50, Duration::from_secs(30)).await;
    let done = s
        .migrate("app-move", "app", json!({}), MigrationPhase::Succeeded)
        .await;
    let (committed, failed) = writer.finish().await;

    // The freeze stopped the writer, loudly, and for good.
    let first_failure = failed.map(|f| f.n).expect("the freeze made writes fail");
    assert!(
        committed.iter().all(|n| *n < first_failure),
        "a write succeeded after the freeze: first failure at {first_failure}, last success {:?}",
        committed.last()
    );
    assert!(committed.len() >= 50);
    // Dump mode takes no counts before the freeze: nothing connected to the target's
    // database before ProvisionTarget made it.
    let target_log = std::fs::read_to_string(s.target.log_path()).unwrap();
    assert!(
        !target_log.contains("database \"app\" does not exist"),
        "something reached for the target database before it existed"
    );

    // Every committed row is on the target, and nothing the writer did not attempt.
    let rows = writes_on(&s.target).await;
    assert_every_commit_in(&committed, &rows);
    assert!(
        rows.iter().all(|n| *n <= first_failure),
        "the target holds rows never attempted before the freeze"
    );
    let target_db = s.target.connect_as_superuser_to("app").await.unwrap();
    let accounts: i64 = scalar(&target_db, "SELECT count(*) FROM pgbench_accounts").await;
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
    assert!(dbops_e2e::wait::database_has(&db, Want::provisioned()));
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

    // The source is kept frozen (sourceRetention Keep): its owner may not log in there.
    assert!(s.source.frozen_for("app", "app").await.unwrap());

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
        s.run_until_exit_at(point);
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
        &[
            AdminKind::for_tests().freeze_statement(),
            "DROP DATABASE IF EXISTS \"app\"",
        ],
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
    let m = s
        .migrate(
            "app-move",
            "app",
            json!({"cutover": "Manual"}),
            MigrationPhase::AwaitingApproval,
        )
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

    s.approve("app-move", MigrationPhase::Succeeded).await;
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(s.connection("app").await.port, s.target.port());
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
    let m = s
        .migrate("app-move", "app", json!({}), MigrationPhase::Succeeded)
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
    // Spans are exported in batches: wait for all three services in the one trace, and
    // for the spans asserted below (a busy machine sends the last batches late).
    let ns = s.ns().to_string();
    let trace = wait_for(
        "the Migration's trace with spans of all three controllers",
        READY,
        || async { jaeger.trace(&trace_id).map(Some).or_else(|_| Ok(None)) },
        |t| {
            t.as_ref().is_some_and(|t| {
                services.iter().all(|svc| t.services().contains(svc))
                    && t.spans_of("dbops-migration-controller", "reconcile Migration")
                        .filter(|sp| sp.tag("object.namespace").as_deref() == Some(ns.as_str()))
                        .count()
                        >= 3
                    && t.spans_of("dbops-backup-controller", "reconcile Backup")
                        .any(|sp| sp.tag("object.name").as_deref() == Some("app-move-snapshot"))
                    && t.spans_of("dbops-database-controller", "reconcile Database")
                        .any(|sp| sp.tag("object.name").as_deref() == Some("app"))
            })
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
        assert!(!st.contains(&s.source.test_admin_password()));
        assert!(!st.contains(&s.target.test_admin_password()));
    }
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
    let plain = s
        .source
        .connect(AdminKind::for_tests().role(), "x", "postgres")
        .await;
    assert!(plain.is_err(), "a plain TCP login must be refused");
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.pgbench("app", 1).await;

    // A Backup over TLS, then a Database restored from it over TLS.
    create_backup(&s.b.client, s.ns(), "app-tls", "app", json!({}))
        .await
        .unwrap();
    let backups: Api<Backup> = Api::namespaced(s.b.client.clone(), s.ns());
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
    s.migrate("app-move", "app", json!({}), MigrationPhase::Succeeded)
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
