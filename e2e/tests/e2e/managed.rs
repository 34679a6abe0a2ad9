//! Managed PostgreSQL (issue 34): the admin of RDS, Cloud SQL or Azure is not a superuser.
//! The whole suite runs with a managed service's admin *with replication* rights
//! (`AdminKind::for_tests`; the majors tests run the feature round on 13, 15, 17 and 18).
//! Here the *base* admin (no REPLICATION, no `pg_create_subscription`): the server says
//! what it may do, a Logical Migration is refused at Preflight naming the missing right,
//! `Auto` chooses Dump and says why, an extension PostgreSQL does not trust is refused
//! before anything is created, and the rest works.

use dbops_api::{ChosenMode, DatabaseServer, MigrationPhase, MigrationStep};
use dbops_e2e::harness::majors::Majors;
use dbops_e2e::harness::migration::{READY, condition};
use dbops_e2e::postgres::admin::AdminKind;
use dbops_e2e::wait::{Want, wait_for};
use kube::api::Api;
use serde_json::json;

#[tokio::test]
async fn a_base_admin_is_refused_what_it_cannot_do_and_does_the_rest() {
    let m = Majors::start_as("managed-base", &[15, 17], AdminKind::Base).await;
    let servers: Api<DatabaseServer> = Api::all(m.b.client.clone());

    // The server says what its admin may do, and `kubectl get` that it is no superuser.
    for major in [15, 17] {
        let server = wait_for(
            "the DatabaseServer's capabilities",
            READY,
            || async { Ok(servers.get(&m.server(major)).await?) },
            |s: &DatabaseServer| {
                s.status
                    .as_ref()
                    .is_some_and(|st| st.capabilities.is_some())
            },
        )
        .await
        .unwrap();
        let c = server.status.unwrap().capabilities.unwrap();
        assert!(!c.superuser && c.create_role && c.create_database, "{c:?}");
        assert!(!c.replication && !c.create_subscription, "{c:?}");
        assert!(c.signal_backend && c.monitor && c.read_all_data, "{c:?}");
    }
    let columns =
        m.b.kubectl
            .run(&["get", "databaseserver", &m.server(15)], None)
            .unwrap()
            .text();
    assert!(
        columns.contains("SUPERUSER") && columns.contains("false"),
        "{columns}"
    );

    // An extension PostgreSQL does not trust, allowed by the platform team: refused.
    servers
        .patch(
            &m.server(15),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"allowedExtensions": ["file_fdw"]}})),
        )
        .await
        .unwrap();
    dbops_e2e::fixtures::create_database(
        &m.b.client,
        m.ns(),
        "untrusted",
        &dbops_e2e::harness::majors::admin(15),
        json!({"extensions": ["file_fdw"]}),
    )
    .await
    .unwrap();
    let refused = dbops_e2e::wait::database_condition(
        &m.b.client,
        m.ns(),
        "untrusted",
        Want::not_ready("AdminLacksPrivilege"),
        READY,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", m.log("database-controller", 6000)));
    let said = dbops_e2e::wait::condition(&refused, "Ready").unwrap();
    assert!(
        said.message.contains("file_fdw") && said.message.contains("SUPERUSER"),
        "{said:?}"
    );
    assert!(!m.pg(15).database_exists("untrusted").await.unwrap());

    // Logical: refused at Preflight, naming REPLICATION; Auto: Dump, saying why.
    m.create_filled_database("logical", 15).await;
    m.create_filled_database("auto", 15).await;
    let original = m.contents(15, "auto").await;
    m.create_migration("logical-move", "logical", 17, json!({"mode": "Logical"}))
        .await;
    m.create_migration("auto-move", "auto", 17, json!({})).await;
    let logical = m
        .wait_phase("logical-move", MigrationPhase::RolledBack)
        .await;
    let failed = condition(&logical, "Failed").unwrap();
    assert_eq!(failed.reason, "AdminLacksPrivilege", "{failed:?}");
    assert!(
        failed.message.contains("REPLICATION") && failed.message.contains("pg_create_subscription"),
        "names both missing rights: {failed:?}"
    );
    assert_eq!(
        logical.status.as_ref().and_then(|s| s.failed_step),
        Some(MigrationStep::Preflight)
    );
    assert!(!m.pg(17).database_exists("logical").await.unwrap());
    let auto = m.wait_phase("auto-move", MigrationPhase::Succeeded).await;
    assert_eq!(
        auto.status.as_ref().and_then(|s| s.mode),
        Some(ChosenMode::Dump)
    );
    let chosen = condition(&auto, "ModeChosen").unwrap();
    assert_eq!(
        (chosen.status.as_str(), chosen.reason.as_str()),
        ("False", "AdminLacksPrivilege"),
        "{chosen:?}"
    );
    m.assert_filled(17, "auto", 0, &original).await;

    // And the rest: a Backup of the Database the Logical Migration left on 15, restored.
    let kept = m.contents(15, "logical").await;
    m.backup("logical-1", "logical", 15, 15).await;
    m.restore("logicalcopy", "logical-1", 15, &kept).await;
}
