//! The Logical mode's Preflight (issue 13 groundwork), compiled from the controller's source:
//! each missing prerequisite named.

use std::time::Duration;

use dbops_e2e::PgServer;

/// The migration-controller's Logical-mode Preflight, compiled from its source: the
/// controller is a binary without a library target to depend on.
#[path = "../../../../migration-controller/src/logical.rs"]
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
    let session = pg
        .superuser_session(dbops_api::TlsMode::Disable, dbname)
        .await
        .unwrap();
    // A target of 17: what these tests look at is the source.
    let unmet = logical::preflight(&session, 170000, "17", true)
        .await
        .unwrap();
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
        .args(pg.superuser_login_args())
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
