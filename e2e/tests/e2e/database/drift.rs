//! Changes made behind the controller's back: a deleted or edited Secret, a dropped
//! database, and a Migration in flight that holds off drift repair and deletion.

use std::str::FromStr;
use std::time::Duration;

use dbops_e2e::fixtures::{manifest, merge_patch};
use dbops_e2e::harness::database::{
    ADMIN_SECRET, CONTROLLER_USER, READY, RESYNC, SecretView, Setup, has_finalizer, login,
    not_ready, value,
};
use dbops_e2e::wait::{Want, describe_database, eventually, holds_for};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rand::distr::{Alphanumeric, SampleString};
use serde_json::json;

/// 6. The connection Secret: deleted → re-created with a rotated password; a key edited
/// → restored, the password rotated and the edited value useless.
#[tokio::test]
async fn the_connection_secret_is_restored_and_the_password_rotated() {
    let s = Setup::new("db-secret").await;
    s.create_ready("app", json!({})).await;
    let port = s.pg.port();
    let secrets = s.secrets();
    let first = s.connection_secret("app").await;
    let first_uid = first.metadata.uid.clone().unwrap();
    let p1 = value(&first, "password");
    assert!(
        login(port, "app", &p1, "app").await.unwrap(),
        "the first password works"
    );

    // Deleted: a new Secret, a new password that works, the old one no more.
    secrets
        .delete("app-connection", &DeleteParams::default())
        .await
        .unwrap();
    let second = eventually(
        "Secret app-connection re-created",
        READY,
        || async { Ok(secrets.get_opt("app-connection").await?.map(SecretView)) },
        |s| {
            s.as_ref()
                .is_some_and(|s| s.0.metadata.uid.as_deref() != Some(&first_uid))
        },
    )
    .await
    .unwrap()
    .0;
    let p2 = value(&second, "password");
    assert!(
        p2 != p1,
        "the password was not rotated after the Secret was lost"
    );
    s.wait_login(
        "app",
        &p2,
        "app",
        "login with the re-created Secret's password",
    )
    .await;
    assert!(
        !login(port, "app", &p1, "app").await.unwrap(),
        "the lost password still works"
    );
    assert_eq!(
        value(&second, "PGPASSWORD"),
        p2,
        "PGPASSWORD differs from password"
    );

    // The password key edited by hand.
    let edited = format!(
        "edited-{}",
        Alphanumeric.sample_string(&mut rand::rng(), 12)
    );
    merge_patch(
        &secrets,
        "app-connection",
        json!({"stringData": {"password": edited, "host": "tampered.example"}}),
    )
    .await
    .unwrap();
    let third = eventually(
        "Secret app-connection repaired after an edit",
        READY,
        || async { Ok(secrets.get("app-connection").await.map(SecretView)?) },
        |s| {
            let data = s.0.data.as_ref();
            let get = |k: &str| data.and_then(|d| d.get(k)).map(|v| v.0.clone());
            get("password").is_some_and(|p| p != edited.as_bytes())
                && get("host").as_deref() == Some(b"127.0.0.1".as_slice())
        },
    )
    .await
    .0;
    let p3 = value(&third, "password");
    assert!(
        value(&third, "PGPASSWORD") == p3,
        "PGPASSWORD differs from password"
    );
    assert_eq!(value(&third, "PGHOST"), "127.0.0.1");
    s.wait_login(
        "app",
        &p3,
        "app",
        "login with the repaired Secret's password",
    )
    .await;
    assert!(
        !login(port, "app", &edited, "app").await.unwrap(),
        "the edited value became the role's password"
    );
    let uri = tokio_postgres::Config::from_str(&value(&third, "uri")).unwrap();
    assert!(
        uri.get_password() == Some(p3.as_bytes()),
        "uri has a stale password"
    );
}

/// 8. A database dropped behind the controller's back is reported, never re-created.
#[tokio::test]
async fn a_vanished_database_is_reported_and_not_recreated() {
    let s = Setup::new("db-missing").await;
    let db = s.create_ready("ghost", json!({})).await;
    assert!(db.status.as_ref().unwrap().provider_id.is_some());

    s.pg.drop_database_force("ghost").await.unwrap();
    let missing = s.wait("ghost", not_ready("DatabaseMissing"), READY).await;
    let degraded = missing
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded");
    if degraded.is_none_or(|c| c.status != "True") {
        // Written in a second status update, perhaps.
        s.wait(
            "ghost",
            Want::new("Degraded", "True", None),
            Duration::from_secs(15),
        )
        .await;
    }
    let event = eventually(
        "a Warning Event DatabaseMissing about Database ghost",
        Duration::from_secs(30),
        || async {
            Ok(s.events_for("ghost")
                .await
                .into_iter()
                .map(|e| {
                    (
                        e.type_,
                        e.reason,
                        e.reporting_component,
                        e.source.and_then(|src| src.component),
                    )
                })
                .collect::<Vec<_>>())
        },
        |events| {
            events.iter().any(|(t, r, _, _)| {
                t.as_deref() == Some("Warning") && r.as_deref() == Some("DatabaseMissing")
            })
        },
    )
    .await;
    assert!(
        event
            .iter()
            .any(|(_, r, rc, src)| r.as_deref() == Some("DatabaseMissing")
                && (rc.as_deref() == Some(CONTROLLER_USER)
                    || src.as_deref() == Some(CONTROLLER_USER))),
        "the DatabaseMissing Event is not reported by {CONTROLLER_USER}: {event:?}"
    );

    holds_for(
        "database ghost stays absent over two resyncs",
        RESYNC * 2 + Duration::from_secs(2),
        || async { s.pg.database_exists("ghost").await },
        |exists| !*exists,
    )
    .await
    .unwrap();
    let db = s.databases().get("ghost").await.unwrap();
    assert_eq!(
        db.status.as_ref().and_then(|st| st.phase),
        Some(dbops_api::DatabasePhase::Degraded)
    );
    assert!(
        dbops_e2e::wait::database_has(&db, not_ready("DatabaseMissing")),
        "still reported missing: {}",
        describe_database(&s.databases(), "ghost").await
    );
}

/// 11. A Migration of the Database in flight: MigrationInProgress, its freeze (connection
/// limit) is not repaired as drift, and deletion waits until the Migration has ended.
#[tokio::test]
async fn a_running_migration_holds_off_drift_repair_and_deletion() {
    let s = Setup::new("db-migrating").await;
    let db = s
        .create_ready("moving", json!({"deletionPolicy": "Retain"}))
        .await;
    assert!(!has_finalizer(&db), "Retain needs no finalizer yet");

    // No migration-controller runs: the Migration is only there (to an unreachable target).
    s.create_server(
        "nowhere",
        json!({"port": 1, "adminSecretRef": {"name": ADMIN_SECRET}}),
    )
    .await;
    let migrations: Api<dbops_api::Migration> = Api::namespaced(s.b.client.clone(), s.ns());
    let migration: dbops_api::Migration = manifest(
        "move-it",
        json!({"databaseRef": {"name": "moving"},
               "target": {"serverRef": {"name": s.server("nowhere")}}}),
    )
    .unwrap();
    migrations
        .create(&PostParams::default(), &migration)
        .await
        .unwrap();
    let db = s
        .wait(
            "moving",
            Want::new("MigrationInProgress", "True", Some("MigrationRunning")),
            READY,
        )
        .await;
    assert!(
        has_finalizer(&db),
        "a running Migration holds deletion with the finalizer"
    );

    // What a FreezeSource step does: not drift while the Migration runs.
    s.pg.connect_as_superuser()
        .await
        .unwrap()
        .batch_execute("ALTER DATABASE moving CONNECTION LIMIT 0")
        .await
        .unwrap();
    let pg = &s.pg;
    holds_for(
        "the frozen connection limit stays over two resyncs",
        RESYNC * 2 + Duration::from_secs(1),
        || async { pg.connlimit("moving").await },
        |limit| *limit == Some(0),
    )
    .await
    .unwrap();

    s.delete("moving").await;
    let dbs = s.databases();
    holds_for(
        "deletion waits for the Migration",
        RESYNC * 2,
        || async { dbs.get_opt("moving").await.map_err(anyhow::Error::from) },
        |d| d.is_some(),
    )
    .await
    .unwrap();

    // The Migration ends: deletion (Retain) completes and the database stays.
    migrations
        .patch_status(
            "move-it",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    s.wait_gone(&db, READY).await;
    assert!(s.pg.database_exists("moving").await.unwrap());
}
