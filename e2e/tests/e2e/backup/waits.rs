//! When a Backup waits and when it fails: an outage spends no retry, an unwritable store is
//! retried then Failed, a missing Database or refused credentials fail at once, a Backup
//! waits for its Database, one dump per server at a time, held locks are reported.

use std::time::Duration;

use dbops_api::BackupPhase;
use dbops_e2e::fixtures::{merge_patch, merge_patch_spec};
use dbops_e2e::harness::backup::{
    ADMIN_SECRET, READY, Setup, assert_has, attempts, has, phase, verify_artifact,
};
use dbops_e2e::harness::object::InBed;
use dbops_e2e::wait::ObjectView;
use dbops_e2e::wait::Want;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;

/// Issue 12's question "does an outage burn a Backup's retries?": once the outage is
/// known (the DatabaseServer's probe, which maps to its Databases), the Database is not
/// Ready and a Backup created then waits (`Pending`, `WaitingForDatabase`) without spending
/// its retries, and completes in one attempt once the server is back. Only attempts begun
/// before the outage was noticed count (transient failures, as `maxRetries` says).
#[tokio::test]
async fn a_backup_created_in_an_outage_waits_without_spending_retries() {
    let mut s = Setup::new("bk-outage").await;
    s.create_database("app", "Delete").await;
    let server = dbops_e2e::fixtures::server_name(s.ns(), ADMIN_SECRET);
    s.pg.stop().unwrap();
    dbops_e2e::fixtures::server_condition(
        &s.b.client,
        &server,
        Want::not_ready("ServerUnreachable"),
        Duration::from_secs(120),
    )
    .await
    .unwrap();

    s.create_backup("app-1", "app", json!({"maxRetries": 1}))
        .await;
    s.wait_backup("app-1", "waiting for its Database", READY, |b| {
        has(b, Want::progressing("WaitingForDatabase"))
    })
    .await;
    // Several backoff periods (1 s .. 5 s here): no attempt is made.
    let backups = s.backups();
    dbops_e2e::wait::holds_for(
        "the Backup waits without an attempt",
        Duration::from_secs(15),
        || async { Ok(ObjectView(backups.get("app-1").await?)) },
        |b| {
            phase(&b.0) == Some(BackupPhase::Pending)
                && attempts(&b.0) == 0
                && has(&b.0, Want::progressing("WaitingForDatabase"))
        },
    )
    .await
    .unwrap();

    s.pg.start_again().await.unwrap();
    let done = s.wait_completed("app-1", READY).await;
    assert_eq!(attempts(&done), 1, "{:?}", ObjectView(done.clone()));
    verify_artifact(&s, &done);
}

/// (c) A store that cannot be written (its path goes through a regular file, so even
/// root cannot create it): each attempt fails, is retried with backoff, and after
/// maxRetries retries the Backup is Failed with the store's reason.
#[tokio::test]
async fn an_unwritable_store_is_retried_then_failed() {
    let s = Setup::new("bk-store").await;
    // A store that cannot be written at startup keeps the controller from starting (see
    // backup_store.rs); one that breaks later is an attempt's failure: this namespace's
    // directory in the store is made a regular file.
    std::fs::write(s.store.path().join(s.ns()), b"not a directory").unwrap();
    s.create_database("app", "Delete").await;
    s.create_backup("app-1", "app", json!({"maxRetries": 2}))
        .await;

    let retrying = s
        .wait_backup("app-1", "a retry after a failed attempt", READY, |b| {
            has(b, Want::progressing("Retrying")) && has(b, Want::not_ready("StoreUnavailable"))
        })
        .await;
    assert!(attempts(&retrying) >= 1);
    let failed = s.wait_failed("app-1", READY).await;
    assert_eq!(attempts(&failed), 3, "one attempt and maxRetries=2 retries");
    assert_has(
        &failed,
        Want::new("Failed", "True", Some("StoreUnavailable")),
    );
    assert!(has(&failed, Want::new("Progressing", "False", None)));
    assert!(has(&failed, Want::not_ready("StoreUnavailable")));
}

/// (e) A Backup of a Database that does not exist fails at once, without retries.
#[tokio::test]
async fn a_missing_database_fails_the_backup_at_once() {
    let s = Setup::new("bk-missing").await;
    s.create_backup("orphan", "no-such-db", json!({"maxRetries": 5}))
        .await;
    let failed = s.wait_failed("orphan", Duration::from_secs(30)).await;
    assert!(has(
        &failed,
        Want::new("Failed", "True", Some("DatabaseNotFound"))
    ));
    assert!(has(&failed, Want::not_ready("DatabaseNotFound")));
    assert_eq!(attempts(&failed), 0, "no dump was attempted");
    assert!(s.store_files().is_empty());
}

/// A Backup of a Database that is not Ready yet waits (Pending, WaitingForDatabase, no
/// attempt) and runs once the Database turns Ready.
#[tokio::test]
async fn a_backup_waits_for_its_database_to_be_ready() {
    let s = Setup::new("bk-wait").await;
    // Neither the admin Secret nor its DatabaseServer exists yet: the Database cannot be
    // provisioned.
    s.create_database_with("late", "Delete", "late-admin").await;
    s.create_backup("late-1", "late", json!({})).await;
    let waiting = s
        .wait_backup("late-1", "waiting for its Database", READY, |b| {
            has(b, Want::progressing("WaitingForDatabase"))
        })
        .await;
    assert_eq!(phase(&waiting), Some(BackupPhase::Pending));
    assert_eq!(attempts(&waiting), 0);
    dbops_e2e::wait::holds_for(
        "the Backup keeps waiting while its Database is not Ready",
        Duration::from_secs(6),
        || async { Ok(s.backups().get("late-1").await.map(ObjectView)?) },
        |b| phase(&b.0) == Some(BackupPhase::Pending) && attempts(&b.0) == 0,
    )
    .await
    .unwrap();

    s.create_admin_secret("late-admin").await;
    s.wait_database_ready("late").await;
    let done = s.wait_completed("late-1", READY).await;
    assert_eq!(attempts(&done), 1);
    verify_artifact(&s, &done);
}

/// Two Backups of one server at once: the second waits for the server's dump slot
/// (Pending, WaitingForSlot), never Running beside the first; both complete.
#[tokio::test]
async fn one_dump_per_server_at_a_time() {
    let s = Setup::new("bk-slots").await;
    s.create_pgbench_database("app", 20).await;
    s.create_backup("first", "app", json!({})).await;
    s.create_backup("second", "app", json!({})).await;

    let backups = s.backups();
    let mut saw_waiting = false;
    let deadline = tokio::time::Instant::now() + READY;
    loop {
        let a = backups.get("first").await.unwrap();
        let b = backups.get("second").await.unwrap();
        assert!(
            !(phase(&a) == Some(BackupPhase::Running) && phase(&b) == Some(BackupPhase::Running)),
            "two dumps of one server ran at once: {:?} {:?}",
            ObjectView(a),
            ObjectView(b)
        );
        saw_waiting |= [&a, &b]
            .iter()
            .any(|x| has(x, Want::progressing("WaitingForSlot")));
        if [&a, &b]
            .iter()
            .all(|x| phase(x) == Some(BackupPhase::Completed))
        {
            verify_artifact(&s, &a);
            verify_artifact(&s, &b);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "both Backups did not complete within {READY:?}: {:?} {:?}\n{}",
            ObjectView(a),
            ObjectView(b),
            s.log("backup-controller", 6000)
        );
        tokio::time::sleep(dbops_e2e::wait::POLL_INTERVAL).await;
    }
    assert!(
        saw_waiting,
        "neither Backup was seen waiting for the server's slot"
    );
}

/// Refused credentials are permanent: the Backup fails at once (one attempt, no retry)
/// with AuthenticationFailed, and neither password reaches the log or the status.
#[tokio::test]
async fn refused_credentials_fail_the_backup_at_once() {
    let mut s = Setup::new("bk-auth").await;
    s.create_database("app", "Delete").await;
    // The database-controller stops, so the Database stays Ready; then the admin Secret
    // gets a wrong password.
    if let Some(mut c) = s.database_controller.take() {
        c.process.stop().unwrap();
    }
    let wrong = "not-the-password-4f1c9b";
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    merge_patch(
        &secrets,
        ADMIN_SECRET,
        json!({"stringData": {"password": wrong}}),
    )
    .await
    .unwrap();
    s.create_backup("app-1", "app", json!({"maxRetries": 5}))
        .await;
    let failed = s.wait_failed("app-1", READY).await;
    assert_has(
        &failed,
        Want::new("Failed", "True", Some("AuthenticationFailed")),
    );
    assert_eq!(attempts(&failed), 1, "a permanent failure is not retried");
    assert!(s.store_files().is_empty(), "{:?}", s.store_files());
    let raw = std::fs::read_to_string(s.logs.path().join("backup-controller.log")).unwrap();
    let status = serde_json::to_string(&failed.status).unwrap();
    let admin = s.pg.test_admin_password();
    for secret in [wrong, admin.as_str()] {
        assert!(
            !raw.contains(secret),
            "a password is in the backup-controller's log"
        );
        assert!(
            !status.contains(secret),
            "a password is in the Backup's status"
        );
    }
}

// Restore: `spec.restoreFrom` on a new Database (performed by the database-controller).

/// Nothing waits without a bound: an application's transaction holding an exclusive lock
/// on a table (which pg_dump needs) and a DBA's open transaction on the database's
/// settings (which a connection-limit change needs). The Backup reports `LockTimeout`
/// naming the table and retries; the Database reports `LockTimeout`; both finish once the
/// locks are released.
#[tokio::test]
async fn held_locks_are_reported_and_work_resumes_when_they_are_released() {
    let mut s = Setup::new("bk-lock").await;
    let bound = std::env::var("DBOPS_TEST_LOCK_TIMEOUT").unwrap_or_else(|_| "2s".into());
    s.extra_args = vec![format!("--lock-timeout={bound}")];
    s.kill_database_controller();
    s.kill_backup_controller();
    s.start_database_controller();
    s.start_backup_controller();
    s.create_database("app", "Retain").await;
    s.exec_as_superuser(
        "app",
        "CREATE TABLE orders (id int PRIMARY KEY); INSERT INTO orders VALUES (1)",
    )
    .await;

    // The application's and the DBA's open transactions.
    let app = s.pg.connect_as_superuser_to("app").await.unwrap();
    app.batch_execute("BEGIN; LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let dba = s.pg.connect_as_superuser().await.unwrap();
    dba.batch_execute("BEGIN; ALTER DATABASE app CONNECTION LIMIT 7")
        .await
        .unwrap();

    s.create_backup("app-locked", "app", json!({"maxRetries": 20}))
        .await;
    merge_patch_spec(&s.databases(), "app", json!({"connectionLimit": 5}))
        .await
        .unwrap();

    // Each says what it waits for, and neither is stuck.
    s.wait_backup(
        "app-locked",
        "a retry after LockTimeout on public.orders",
        READY,
        |b| {
            b.status.as_ref().is_some_and(|st| {
                st.conditions.iter().any(|c| {
                    c.message.contains("LockTimeout") && c.message.contains("public.orders")
                })
            })
        },
    )
    .await;
    s.wait_database("app", Want::not_ready("LockTimeout"), READY)
        .await;

    // Released: the Backup completes, the Database converges.
    app.batch_execute("ROLLBACK").await.unwrap();
    dba.batch_execute("ROLLBACK").await.unwrap();
    s.wait_completed("app-locked", READY).await;
    s.wait_database("app", Want::provisioned(), READY).await;
    assert_eq!(s.pg.connlimit("app").await.unwrap(), Some(5));
}
