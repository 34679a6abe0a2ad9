//! Deleting a Database while it migrates ends both: awaiting cutover, and at any step.

use dbops_api::{MigrationPhase, MigrationStep};
use dbops_e2e::harness::migration::{READY, SAGA, Setup, assert_failed, condition, phase_of};
use dbops_e2e::harness::object::InBed;
use kube::api::DeleteParams;
use serde_json::json;

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
    s.migrate(
        "app-move",
        "app",
        json!({"cutover": "Manual"}),
        MigrationPhase::AwaitingApproval,
    )
    .await;
    s.databases()
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    let m = s.approve("app-move", MigrationPhase::RolledBack).await;
    assert_failed(&m, "DatabaseDeleted");
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
        s.run_until_exit_at(&point);
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
