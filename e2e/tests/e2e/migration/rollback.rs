//! What rolls a Migration back and what that leaves: a name conflict at Preflight, a failed
//! Snapshot, the target stopped after the freeze or down during the copy, a second
//! Migration refused and a deleted one, an extension schema on the target.

use dbops_api::{Migration, MigrationPhase, MigrationStep, StepState};
use dbops_e2e::harness::migration::{
    READY, SAGA, Setup, assert_failed, assert_has_event, assert_step, condition, phase_of,
    step_state,
};
use dbops_e2e::harness::object::InBed;
use dbops_e2e::wait::ObjectView;
use dbops_e2e::wait::wait_for;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;

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
    // The finalizer goes right after the status that says RolledBack.
    let migrations: Api<Migration> = Api::namespaced(s.b.client.clone(), s.ns());
    wait_for(
        "the finalizer gone at the end",
        READY,
        || async { Ok(migrations.get("app-move").await?.finalizers().to_vec()) },
        |finalizers| finalizers.is_empty(),
    )
    .await
    .unwrap();
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
    let m = s
        .migrate("app-move", "app", json!({}), MigrationPhase::RolledBack)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::Snapshot));
    assert_failed(&m, "SnapshotFailed");
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
    s.create_migration("app-move", "app", json!({})).await;
    s.run_until_exit_at("ProvisionTarget:started");
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
    assert_failed(&m, "ServerUnreachable");
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
    s.create_migration("app-move", "app", json!({})).await;
    s.run_until_exit_at("CopyData:started");
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

/// (5) A second Migration of a Database with an active one is refused with a condition;
/// deleting the active one (parked for approval) rolls it back before it goes.
#[tokio::test]
async fn a_second_migration_is_refused_and_a_deleted_one_rolls_back() {
    let mut s = Setup::new("mig-second").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.migrate(
        "first",
        "app",
        json!({"cutover": "Manual"}),
        MigrationPhase::AwaitingApproval,
    )
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
    s.run_until_exit_at("ProvisionTarget:done");
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
