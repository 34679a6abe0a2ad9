//! A Backup restores into a new Database with every row; a corrupted artifact is refused;
//! a restore interrupted by a crash completes after the restart.

use std::collections::BTreeMap;

use dbops_e2e::harness::backup::{ADMIN_SECRET, BIG_DUMP, READY, Setup};
use dbops_e2e::postgres::scalar;
use dbops_e2e::wait::{Want, condition};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;

/// Row counts by table, without owners.
fn counts(tables: &BTreeMap<String, (i64, String)>) -> BTreeMap<String, i64> {
    tables.iter().map(|(t, (n, _))| (t.clone(), *n)).collect()
}

/// pgbench data (and extension pgcrypto) backed up, then restored into a new Database:
/// every table with the same row count, owned by the new Database's role, the extension
/// usable, and the data reachable with the new Secret.
#[tokio::test]
async fn a_backup_restores_into_a_new_database_with_every_row() {
    let s = Setup::new("rs-basic").await;
    s.create_database_with_pgcrypto("source").await;
    s.pgbench("source", 2).await;
    s.create_backup("source-1", "source", json!({})).await;
    s.wait_completed("source-1", READY).await;

    s.create_restored_database("copy", "source-1").await;
    // The same Backup cloned with a mask (`cloneFrom.backupRef`): schema, masked rows,
    // then the primary key, which holds on the hashed (permuted) aid.
    let mask = json!([
        {"table": "public.pgbench_accounts", "column": "aid", "with": "hash"},
        {"table": "public.pgbench_accounts", "column": "abalance", "with": "fixed", "value": "7"},
    ]);
    let masked = json!({"deletionPolicy": "Delete",
                        "cloneFrom": {"backupRef": {"name": "source-1"}, "mask": mask}});
    s.create_database_spec("masked", ADMIN_SECRET, masked).await;
    let copy = s.wait_database("copy", Want::provisioned(), BIG_DUMP).await;
    let masked = s
        .wait_database("masked", Want::provisioned(), BIG_DUMP)
        .await;

    let source = s.tables("source").await;
    let restored = s.tables("copy").await;
    assert_eq!(source.len(), 4, "pgbench makes 4 tables: {source:?}");
    assert_eq!(counts(&restored), counts(&source));
    assert_eq!(source["pgbench_accounts"].0, 200_000);
    assert_eq!(counts(&s.tables("masked").await), counts(&source));
    let (masked_client, connection) =
        tokio_postgres::connect(&s.pg.conn_string("masked"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let fixed: i64 = scalar(
        &masked_client,
        "SELECT count(*) FROM pgbench_accounts WHERE abalance = 7",
    )
    .await;
    let kept: i64 = scalar(
        &masked_client,
        "SELECT count(*) FROM pgbench_accounts WHERE aid BETWEEN 1 AND 200000",
    )
    .await;
    let keyed: bool = scalar(&masked_client, "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = 'pgbench_accounts'::regclass AND indisprimary)").await;
    assert_eq!((fixed, keyed), (200_000, true));
    assert!(kept < 50_000, "{kept} aids kept their value");
    let clone = masked.status.unwrap().clone_status.unwrap();
    assert_eq!(clone.masked_values, Some(400_000), "{clone:?}");
    assert_eq!(
        clone.source.as_deref(),
        Some(format!("Backup {}/source-1", s.ns()).as_str())
    );
    // The extension came along (pgcrypto is trusted: the owner role may create it).
    let (client, connection) =
        tokio_postgres::connect(&s.pg.conn_string("copy"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let digest: String = scalar(&client, "SELECT encode(digest('x', 'sha256'), 'hex')").await;
    assert_eq!(digest.len(), 64);
    for (table, (_, owner)) in &restored {
        assert_eq!(owner, "copy", "{table} is owned by {owner}");
    }
    // Restored, the database carries the plain ownership mark (no pending restore).
    let uid = copy.metadata.uid.clone().unwrap();
    assert_eq!(
        s.pg.database_comment("copy").await.unwrap(),
        Some(format!("dbops.dev/uid={uid}"))
    );
    // The application's own credentials read the restored rows.
    let secret = Api::<Secret>::namespaced(s.b.client.clone(), s.ns())
        .get("copy-connection")
        .await
        .unwrap();
    let data = secret.data.unwrap_or_default();
    let value = |k: &str| String::from_utf8(data.get(k).unwrap().0.clone()).unwrap();
    let app =
        s.pg.connect(&value("username"), &value("password"), &value("dbname"))
            .await
            .unwrap();
    let n: i64 = scalar(&app, "SELECT count(*) FROM pgbench_branches").await;
    assert_eq!(n, 2);
}

/// A corrupted artifact (same size, one byte changed) is refused: Ready=False with
/// ChecksumMismatch and a Warning Event, and the new database stays empty.
#[tokio::test]
async fn a_corrupted_artifact_is_refused_and_nothing_is_restored() {
    let s = Setup::new("rs-corrupt").await;
    s.create_pgbench_database("source", 1).await;
    s.create_backup("source-1", "source", json!({})).await;
    let backup = s.wait_completed("source-1", READY).await;

    let (artifact, _) = s.artifact_paths(&backup);
    let mut bytes = std::fs::read(&artifact).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&artifact, &bytes).unwrap();

    s.create_restored_database("copy", "source-1").await;
    let db = s
        .wait_database("copy", Want::not_ready("ChecksumMismatch"), READY)
        .await;
    let ready = condition(&db, "Ready").unwrap();
    assert!(
        ready.message.contains("nothing was restored")
            && ready
                .message
                .contains(backup.status.as_ref().unwrap().checksum.as_deref().unwrap()),
        "{}",
        ready.message
    );
    assert!(
        db.status.as_ref().unwrap().provider_id.is_none(),
        "a database that failed its restore is not reported as provisioned"
    );
    // Verified before anything changes on the server: no database, no role.
    assert!(
        !s.pg.database_exists("copy").await.unwrap() && !s.pg.role_exists("copy").await.unwrap(),
        "the refused restore touched the server"
    );

    let events = dbops_e2e::wait::eventually(
        "a ChecksumMismatch Warning Event",
        READY,
        || async {
            let events: Api<k8s_openapi::api::core::v1::Event> =
                Api::namespaced(s.b.client.clone(), s.ns());
            Ok(events.list(&Default::default()).await?.items)
        },
        |events: &Vec<k8s_openapi::api::core::v1::Event>| {
            events.iter().any(|e| {
                e.reason.as_deref() == Some("ChecksumMismatch")
                    && e.type_.as_deref() == Some("Warning")
                    && e.involved_object.name.as_deref() == Some("copy")
            })
        },
    )
    .await;
    assert!(!events.is_empty());
}

/// The database-controller killed while pg_restore runs: after a restart the half-restored
/// database is made anew and restored once, with every row and no duplicate.
#[tokio::test]
async fn a_restore_interrupted_by_a_crash_completes_after_restart() {
    let mut s = Setup::new("rs-crash").await;
    s.create_pgbench_database("source", 20).await;
    s.create_backup("source-1", "source", json!({})).await;
    s.wait_completed("source-1", BIG_DUMP).await;

    s.create_restored_database("copy", "source-1").await;
    let first = s
        .wait_database("copy", Want::progressing("Restoring"), BIG_DUMP)
        .await;
    // pg_restore is running (its session is visible on the server): kill the controller.
    let restoring = dbops_e2e::wait::eventually(
        "pg_restore connected to the new database",
        READY,
        || {
            s.pg.sessions_of("copy", "dbops-database-controller-restore")
        },
        |n| *n > 0,
    )
    .await;
    assert!(restoring > 0);
    let oid_before = s.pg.database_oid("copy").await.unwrap();
    s.kill_database_controller();
    let uid = first.metadata.uid.clone().unwrap();
    assert_eq!(
        s.pg.database_comment("copy").await.unwrap(),
        Some(format!("dbops.dev/uid={uid} dbops.dev/restore=pending")),
        "the database is still marked as waiting for its restore"
    );

    s.start_database_controller();
    s.wait_database("copy", Want::provisioned(), BIG_DUMP).await;
    assert_eq!(
        counts(&s.tables("copy").await),
        counts(&s.tables("source").await)
    );
    assert_eq!(s.pg.count_databases_like("copy%").await.unwrap(), 1);
    assert_ne!(
        s.pg.database_oid("copy").await.unwrap(),
        oid_before,
        "the half-restored database was made anew"
    );
}

// The s3:// store against a real S3-compatible server (s3s-fs, built by e2e/install) on
// loopback. What the store wrote is checked in the server's data directory, where s3s-fs
// keeps each object as a plain file, independently of the client under test.
