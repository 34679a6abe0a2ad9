//! The Logical mode of the migration-controller (issue 13) against a real control plane,
//! the three controllers and two real PostgreSQL servers, the source started with
//! `wal_level=logical`: a Database moves under a live writer that follows its connection
//! Secret (every committed write arrives; the longest gap between two successful commits
//! is printed); a Manual cutover waits while replicating with the source writable, and a
//! schema change on the source then rolls the Migration back; `Auto` on a source without
//! `wal_level=logical` falls back to Dump and says why, `Logical` is refused there; a
//! table without a primary key is refused; the controller killed at every step (before
//! and after its effects, and between creating the replication slot and recording it)
//! resumes to one success under a writer; a failure at each step before SwitchTraffic
//! rolls back; an approved Manual cutover keeps the writes accepted while it waited; a
//! slot left by a crash at its creation never outlives the Migration.
//! After every end, no replication slot, publication, subscription or replication role
//! is left on either server.

use std::time::{Duration, Instant};

use dbops_api::{ChosenMode, MigrationPhase, MigrationStep, StepState};
use dbops_e2e::harness::migration::{
    SAGA, SOURCE_ADMIN, Setup, TARGET_ADMIN, assert_each_once, assert_every_commit_in,
    assert_failed, assert_has_event, assert_step, condition, mode_of, step_state, writes_on,
};
use dbops_e2e::harness::migration_logical::{
    Writer, app_with_tables, assert_items_copied, assert_slot_without_subscription,
    assert_source_writable, leftovers, logical_setup, replication_name, secrets,
};
use dbops_e2e::postgres::admin::AdminKind;
use dbops_e2e::wait::wait_for;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;

/// (1) The happy path under a live writer: the Database moves in Logical mode while the
/// writer commits; every committed write is on the target; the writer's longest gap is
/// reported; sequences follow; nothing of the replication is left.
#[tokio::test]
async fn logical_migration_keeps_every_write_and_leaves_nothing_behind() {
    let mut s = logical_setup("logical-happy").await;
    s.start_migration_controller(&[]);
    app_with_tables(&s).await;
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    let writer = Writer::start(secrets, "app-connection".into());
    writer.wait_commits(50, Duration::from_secs(30)).await;
    let started = Instant::now();
    let done = s
        .migrate(
            "app-move",
            "app",
            json!({"mode": "Logical"}),
            MigrationPhase::Succeeded,
        )
        .await;
    let took = started.elapsed();
    // Writes reach the target through the rewritten Secret.
    let (committed, gap, after) = writer.finish_on_target().await;
    println!(
        "logical migration: {} commits, migration {:.1}s, longest gap between two commits {:.3}s (after write {after})",
        committed.len(),
        took.as_secs_f64(),
        gap.as_secs_f64()
    );

    let status = done.status.clone().unwrap();
    assert_eq!(status.mode, Some(ChosenMode::Logical));
    let names: Vec<MigrationStep> = status.steps.iter().map(|s| s.name).collect();
    assert_eq!(names, MigrationStep::LOGICAL);
    for step in &status.steps {
        assert_eq!(step.state, StepState::Succeeded, "{step:?}");
    }
    // Both servers have wal_level=logical: the rows were counted before the freeze, and
    // Verify added up the changes since.
    let message = |step| {
        let found = status.steps.iter().find(|s| s.name == step);
        found.and_then(|s| s.message.clone()).unwrap_or_default()
    };
    // An admin that is not a superuser may not read pg_replication_origin_status on the
    // target: Verify counts in the freeze, and FreezeSource says why.
    let freeze = message(MigrationStep::FreezeSource);
    let verify = message(MigrationStep::Verify);
    if AdminKind::for_tests().counts_before_the_freeze() {
        assert!(
            freeze.contains("the same on both servers at the source's"),
            "{freeze}"
        );
        assert!(
            verify.contains("counted before the freeze") && verify.contains("2 tables"),
            "{verify}"
        );
    } else {
        assert!(
            freeze.contains("Verify counts in the freeze")
                && freeze.contains("pg_replication_origin_status"),
            "{freeze}"
        );
        assert!(
            verify.contains("counted in the freeze") && verify.contains("2 tables"),
            "{verify}"
        );
    }
    let replication = status.replication.clone().unwrap();
    assert_eq!(replication.tables_total, 2);
    assert_eq!(replication.tables_copied, 2);
    assert!(replication.caught_up);
    assert!(
        condition(&done, "ModeChosen").is_some_and(|c| c.status == "True"),
        "{:?}",
        status.conditions
    );

    // Every committed write is on the target, and nothing never attempted.
    assert_every_commit_in(&committed, &writes_on(&s.target).await);
    // The items arrived, and their sequence.
    assert_items_copied(&s.target).await;

    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(leftovers(&s).await, Vec::<String>::new());

    // The subscription's connection string (with the replication login's password) is
    // never in the controller's log; a superuser admin keeps it out of the servers'
    // statement logs too. Another admin may not turn them off (docs/operations.md,
    // Managed PostgreSQL): on a target that logs DDL, as these do, it is in the
    // `CREATE SUBSCRIPTION` line, and nowhere else.
    let log = s.log("migration-controller", 1_000_000);
    assert!(!log.contains("password="), "a conninfo in the log");
    for (pg, is_target) in [(&s.source, false), (&s.target, true)] {
        let ddl = pg.ddl_statements().unwrap();
        let with_conninfo: Vec<&String> = ddl.iter().filter(|l| l.contains("password=")).collect();
        if AdminKind::for_tests() == AdminKind::Superuser || !is_target {
            assert!(with_conninfo.is_empty(), "a conninfo in a server log");
        } else {
            assert!(
                with_conninfo.len() == 1 && with_conninfo[0].contains("CREATE SUBSCRIPTION"),
                "the conninfo once, in CREATE SUBSCRIPTION: {} lines",
                with_conninfo.len()
            );
        }
    }
    let events = s.events_about("Migration", "app-move").await;
    for step in MigrationStep::LOGICAL {
        assert_has_event(&events, &format!("{}Succeeded", step.as_str()));
    }
    assert_has_event(&events, "LogicalModeChosen");
}

/// (2) A source without `wal_level=logical`: `Logical` is refused at Preflight (nothing
/// changed), `Auto` falls back to Dump and says why in a condition and an Event.
#[tokio::test]
async fn without_wal_level_logical_auto_dumps_and_logical_is_refused() {
    let mut s = Setup::with_logical_target("logical-nowal").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    let m = s
        .migrate(
            "app-logical",
            "app",
            json!({"mode": "Logical"}),
            MigrationPhase::RolledBack,
        )
        .await;
    let failed = assert_failed(&m, "WalLevelNotLogical");
    assert!(failed.message.contains("wal_level = logical"), "{failed:?}");
    assert_eq!(
        m.status.as_ref().unwrap().failed_step,
        Some(MigrationStep::Preflight)
    );
    assert_eq!(mode_of(&m), None, "no mode was chosen");
    assert_step(&m, MigrationStep::Snapshot, StepState::Pending);
    assert!(!s.target.database_exists("app").await.unwrap());

    let m = s
        .migrate("app-auto", "app", json!({}), MigrationPhase::Succeeded)
        .await;
    assert_eq!(mode_of(&m), Some(ChosenMode::Dump));
    let chosen = condition(&m, "ModeChosen").unwrap();
    assert_eq!(chosen.status, "False");
    assert_eq!(chosen.reason, "WalLevelNotLogical");
    assert!(
        chosen.message.contains("mode Auto chose Dump"),
        "{chosen:?}"
    );
    let names: Vec<MigrationStep> = m
        .status
        .as_ref()
        .unwrap()
        .steps
        .iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, MigrationStep::DUMP);
    let events = s.events_about("Migration", "app-auto").await;
    let event = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("DumpModeChosen"))
        .expect("a DumpModeChosen Event");
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert!(
        event
            .message
            .as_deref()
            .is_some_and(|n| n.contains("WalLevelNotLogical"))
    );
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
}

/// (3) A table without a primary key or replica identity: `Logical` is refused at
/// Preflight naming it.
#[tokio::test]
async fn a_table_without_a_primary_key_is_refused() {
    let mut s = logical_setup("logical-nopk").await;
    s.start_migration_controller(&[]);
    let c = app_with_tables(&s).await;
    s.source
        .connect(&c.user, &c.password, "app")
        .await
        .unwrap()
        .batch_execute("CREATE TABLE no_pk (v text)")
        .await
        .unwrap();
    let m = s
        .migrate(
            "app-move",
            "app",
            json!({"mode": "Logical"}),
            MigrationPhase::RolledBack,
        )
        .await;
    let failed = assert_failed(&m, "TablesWithoutReplicaIdentity");
    assert!(failed.message.contains("public.no_pk"), "{failed:?}");
    assert!(!s.target.database_exists("app").await.unwrap());
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
}

/// (4) Manual cutover: the Migration waits in AwaitingApproval while replicating, the
/// source writable (a write there arrives on the target); a column added on the source
/// then rolls it back (SchemaChanged) with nothing left on either server.
#[tokio::test]
async fn a_manual_cutover_replicates_until_a_schema_change_rolls_it_back() {
    let mut s = logical_setup("logical-manual").await;
    s.start_migration_controller(&[]);
    let c = app_with_tables(&s).await;
    let m = s
        .migrate(
            "app-move",
            "app",
            json!({"mode": "Logical", "cutover": "Manual"}),
            MigrationPhase::AwaitingApproval,
        )
        .await;
    assert_step(&m, MigrationStep::Replicate, StepState::Succeeded);
    assert_step(&m, MigrationStep::FreezeSource, StepState::Pending);
    // The source is writable, and what is written there arrives on the target.
    let owner = s.source.connect(&c.user, &c.password, "app").await.unwrap();
    owner
        .execute("INSERT INTO writes (n) VALUES (424242)", &[])
        .await
        .expect("the source is writable while the Migration awaits approval");
    let target = s.target.connect_as_superuser_to("app").await.unwrap();
    wait_for(
        "the write to arrive on the target",
        Duration::from_secs(60),
        || async {
            Ok(target
                .query_one("SELECT count(*) FROM writes WHERE n = 424242", &[])
                .await?
                .get::<_, i64>(0))
        },
        |n| *n == 1,
    )
    .await
    .unwrap();
    drop(target);
    assert!(
        leftovers(&s)
            .await
            .iter()
            .any(|l| l.contains("source slot"))
    );

    // A schema change on the source: rolled back, saying why.
    owner
        .batch_execute("ALTER TABLE writes ADD COLUMN extra int")
        .await
        .unwrap();
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let failed = assert_failed(&m, "SchemaChanged");
    assert!(failed.message.contains("writes.extra"), "{failed:?}");
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
    assert!(!s.target.database_exists("app").await.unwrap());
    owner
        .execute("INSERT INTO writes (n) VALUES (1)", &[])
        .await
        .expect("the source stays writable");
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(SOURCE_ADMIN));
}

/// (5) The controller exits at every step of the Logical saga, before the step's effects
/// and after them, and right after CREATE SUBSCRIPTION created the replication slot (its
/// name derived from the Migration's UID, nothing recorded of it yet), while a writer
/// commits through the connection Secret: each new process resumes, and the Migration
/// ends Succeeded once, with every committed write on the target, nothing of the
/// replication left on either server, and no DDL run twice. One of the points is inside
/// FreezeSource's counts, with the subscription paused: the next process enables it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_at_every_logical_step_resumes_to_one_success() {
    let mut s = logical_setup("logical-crash").await;
    app_with_tables(&s).await;
    // The test thread blocks while it waits for each exit; the writer runs on the other.
    let writer = Writer::start(secrets(&s), "app-connection".into());
    writer.wait_commits(50, Duration::from_secs(30)).await;
    s.create_migration("app-move", "app", json!({"mode": "Logical"}))
        .await;
    let mut points = Vec::new();
    for step in MigrationStep::LOGICAL {
        points.push(format!("{}:started", step.as_str()));
        if step == MigrationStep::Replicate {
            points.push("Replicate:slot-created".to_string());
        }
        if step == MigrationStep::FreezeSource {
            // Verify's counts before the freeze have paused the subscription.
            points.push("FreezeSource:subscription-paused".to_string());
        }
        points.push(format!("{}:done", step.as_str()));
    }
    let (mut slot_seen, mut pause_seen) = (false, false);
    for point in &points {
        s.run_until_exit_at(point);
        if point == "Replicate:slot-created" {
            assert_slot_without_subscription(&s, "app-move", &format!("at {point}")).await;
            slot_seen = true;
        }
        if point == "FreezeSource:subscription-paused" {
            // Left disabled by the crash: the next process must enable it again, not
            // take it for one an apply error disabled.
            let m = s.migrations().get("app-move").await.unwrap();
            let enabled: bool = s
                .target
                .connect_as_superuser_to("app")
                .await
                .unwrap()
                .query_one(
                    "SELECT subenabled FROM pg_subscription WHERE subname = $1",
                    &[&replication_name(&m)],
                )
                .await
                .unwrap()
                .get(0);
            assert!(!enabled, "the subscription is paused at {point}");
            pause_seen = true;
        }
    }
    assert!(slot_seen && pause_seen);
    s.start_migration_controller(&[]);
    let m = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    // The writer follows the Secret to the target and commits there.
    let (committed, gap, after) = writer.finish_on_target().await;
    println!(
        "killed at {} points: {} commits, longest gap between two commits {:.3}s (after write {after})",
        points.len(),
        committed.len(),
        gap.as_secs_f64()
    );

    for step in MigrationStep::LOGICAL {
        assert_step(&m, step, StepState::Succeeded);
    }
    assert_every_commit_in(&committed, &writes_on(&s.target).await);
    assert_items_copied(&s.target).await;
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
    // Succeeded once: one process saw the end.
    let events = s.events_about("Migration", "app-move").await;
    let ends: Vec<_> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Succeeded"))
        .collect();
    assert_eq!(ends.len(), 1, "{ends:#?}");
    assert!(ends[0].count.unwrap_or(1) <= 1, "{ends:#?}");
    // Each object was created once, whatever the crashes.
    let source_ddl = s.source.ddl_statements().unwrap();
    let target_ddl = s.target.ddl_statements().unwrap();
    assert_each_once(
        &source_ddl,
        &[
            "CREATE PUBLICATION",
            "DROP PUBLICATION",
            AdminKind::for_tests().freeze_statement(),
        ],
    );
    // The subscription logs in as a replication role of the Migration's, or (an admin that
    // may not make one on this major) as the admin itself.
    let role_made = AdminKind::for_tests().makes_replication_role(15);
    for needle in ["CREATE ROLE \"dbops_mig_", "DROP ROLE \"dbops_mig_"] {
        let n = source_ddl.iter().filter(|l| l.contains(needle)).count();
        assert_eq!(n, usize::from(role_made), "{needle}: {source_ddl:#?}");
    }
    assert_each_once(
        &target_ddl,
        &[
            "CREATE DATABASE \"app\"",
            "CREATE TABLE public.items",
            "DROP SUBSCRIPTION",
        ],
    );
}

/// (6) A step before SwitchTraffic fails for good once its effects are done
/// (`--debug-fail-at`), at each step of the Logical saga in turn, a new Migration of the
/// same Database each time: every step that ran is compensated in reverse order, the
/// Migration ends RolledBack, nothing of it is left on either server (no slot,
/// publication, subscription, replication role, target database or role) and the
/// source is writable with its settings as they were.
#[tokio::test]
async fn a_failure_at_each_step_before_the_switch_rolls_back_and_leaves_nothing() {
    let mut s = logical_setup("logical-rollback").await;
    let c = app_with_tables(&s).await;
    let before_switch: Vec<MigrationStep> = MigrationStep::LOGICAL
        .into_iter()
        .take_while(|st| *st != MigrationStep::SwitchTraffic)
        .collect();
    assert_eq!(before_switch.len(), 7);
    for (i, &failing) in before_switch.iter().enumerate() {
        let name = format!("fail-at-{}", failing.as_str().to_lowercase());
        s.start_migration_controller(&[&format!("--debug-fail-at={}", failing.as_str())]);
        let m = s
            .migrate(
                &name,
                "app",
                json!({"mode": "Logical"}),
                MigrationPhase::RolledBack,
            )
            .await;
        s.stop_migration_controller();
        let status = m.status.clone().unwrap();
        assert_eq!(status.failed_step, Some(failing));
        assert_eq!(status.mode, Some(ChosenMode::Logical));
        assert_failed(&m, "InjectedFailure");
        for (j, &step) in MigrationStep::LOGICAL.iter().enumerate() {
            let want = match j.cmp(&i) {
                std::cmp::Ordering::Less => StepState::Compensated,
                std::cmp::Ordering::Equal => StepState::Failed,
                std::cmp::Ordering::Greater => StepState::Pending,
            };
            assert_eq!(
                step_state(&m, step),
                Some(want),
                "failed at {failing:?}: {step:?}"
            );
        }
        let failed_step = status.steps.iter().find(|st| st.name == failing).unwrap();
        assert!(
            failed_step
                .message
                .as_deref()
                .is_some_and(|msg| msg.contains("compensated:")),
            "{failed_step:?}"
        );
        let after = format!("a failure at {failing:?}");
        assert_eq!(leftovers(&s).await, Vec::<String>::new(), "{after}");
        assert!(!s.target.database_exists("app").await.unwrap(), "{after}");
        assert!(!s.target.role_exists(&c.user).await.unwrap(), "{after}");
        assert_source_writable(&s, &c, -(i as i64) - 1, &after).await;
        let db = s.databases().get("app").await.unwrap();
        assert_eq!(db.spec.server_ref.name, s.server(SOURCE_ADMIN), "{after}");
    }
}

/// (7) A Manual cutover in Logical mode, approved: while the Migration waits in
/// AwaitingApproval the source takes the writer's commits and they arrive on the
/// target; approved, it freezes, catches up and switches; every committed write (those
/// accepted while it waited included) is on the target, and the writer goes on there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_manual_logical_cutover_keeps_the_writes_made_while_it_waited() {
    let mut s = logical_setup("logical-approve").await;
    s.start_migration_controller(&[]);
    app_with_tables(&s).await;
    let writer = Writer::start(secrets(&s), "app-connection".into());
    s.migrate(
        "app-move",
        "app",
        json!({"mode": "Logical", "cutover": "Manual"}),
        MigrationPhase::AwaitingApproval,
    )
    .await;
    let from = writer.committed();
    // 200 commits while the Migration awaits approval.
    writer
        .wait_commits(from + 200, Duration::from_secs(60))
        .await;
    let during = writer.numbers_from(from);
    let m = s.migrations().get("app-move").await.unwrap();
    assert_eq!(
        m.status.as_ref().and_then(|st| st.phase),
        Some(MigrationPhase::AwaitingApproval),
        "still waiting"
    );
    assert_step(&m, MigrationStep::FreezeSource, StepState::Pending);
    let target = s.target.connect_as_superuser_to("app").await.unwrap();
    wait_for(
        "the writes accepted while waiting to arrive on the target",
        Duration::from_secs(60),
        || async {
            Ok(target
                .query_one("SELECT count(*) FROM writes WHERE n = ANY($1)", &[&during])
                .await?
                .get::<_, i64>(0))
        },
        |n| *n == during.len() as i64,
    )
    .await
    .unwrap();
    drop(target);

    let done = s.approve("app-move", MigrationPhase::Succeeded).await;
    let (committed, gap, after) = writer.finish_on_target().await;
    println!(
        "manual logical cutover: {} commits ({} while awaiting approval), longest gap between two commits {:.3}s (after write {after})",
        committed.len(),
        during.len(),
        gap.as_secs_f64()
    );
    for step in MigrationStep::LOGICAL {
        assert_eq!(
            step_state(&done, step),
            Some(StepState::Succeeded),
            "{step:?}"
        );
    }
    let rows = writes_on(&s.target).await;
    assert!(during.iter().all(|n| rows.contains(n)));
    assert_every_commit_in(&committed, &rows);
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
}

/// (8) A crash between creating the replication slot and recording it: the controller
/// exits right after CREATE SUBSCRIPTION made the slot on the source, before the status
/// says anything of it; the Migration is then deleted, and the next process rolls it
/// back by the slot's name alone: no slot (nor anything else) is left. Then the worst
/// case of that window: a slot of the Migration's name without its subscription (as a
/// CREATE SUBSCRIPTION that made the slot and never committed on the target leaves it)
/// is dropped and made again, and the Migration succeeds with nothing left.
#[tokio::test]
async fn a_crash_between_creating_the_slot_and_recording_it_leaves_no_slot() {
    let mut s = logical_setup("logical-slot").await;
    let c = app_with_tables(&s).await;
    s.create_migration("first", "app", json!({"mode": "Logical"}))
        .await;
    s.run_until_exit_at("Replicate:slot-created");
    assert_slot_without_subscription(&s, "first", "after the crash").await;
    s.migrations()
        .delete("first", &kube::api::DeleteParams::default())
        .await
        .unwrap();
    s.start_migration_controller(&[]);
    let api = s.migrations();
    wait_for(
        "Migration first rolled back and gone",
        SAGA,
        || async { Ok(api.get_opt("first").await?.is_none()) },
        |gone| *gone,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", s.log("migration-controller", 8000)));
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
    assert!(!s.target.database_exists("app").await.unwrap());
    assert_source_writable(&s, &c, -1, "the rollback of first").await;
    s.stop_migration_controller();

    // A slot of the Migration's name, and no subscription anywhere.
    s.create_migration("second", "app", json!({"mode": "Logical"}))
        .await;
    s.run_until_exit_at("Replicate:started");
    let m = s.migrations().get("second").await.unwrap();
    let slot = replication_name(&m);
    s.source
        .connect_as_superuser_to("app")
        .await
        .unwrap()
        .query_one(
            "SELECT slot_name::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    s.start_migration_controller(&[]);
    s.wait_phase("second", MigrationPhase::Succeeded, SAGA)
        .await;
    let items = Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM items").await;
    assert_eq!(items, 10_000);
    assert!(writes_on(&s.target).await.contains(&-1));
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
}
