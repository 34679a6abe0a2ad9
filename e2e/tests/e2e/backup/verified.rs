//! Verified backups (issue 37): a Backup with `verify: true` is restored into a scratch
//! database on the backup-controller's `--verify-server` (a DatabaseServer that admits no
//! tenant) as a throwaway role, and checked against the inventory its dump took in its
//! own snapshot. It passes with every row; it fails on an artifact changed in the store
//! and on an inventory that does not match (injected into the manifest); it cannot run
//! without a verification server or on one that admits tenants; each outcome has its
//! condition, Event and metric, and nothing is left on the server.

use dbops_api::Backup;
use dbops_e2e::harness::backup::{ADMIN_SECRET, READY, S3_BUCKET, Setup};
use dbops_e2e::wait::condition;
use dbops_e2e::wait::eventually;
use dbops_shared::sealing::Identities;
use kube::api::ListParams;
use kube::api::{Patch, PatchParams};
use serde_json::json;

fn verification(b: &Backup) -> dbops_api::BackupVerification {
    b.status
        .as_ref()
        .and_then(|s| s.verification.clone())
        .expect("status.verification")
}

/// `Verified`'s status, reason and message.
fn verified(b: &Backup) -> (String, String, String) {
    let c = condition(b, "Verified").expect("a Verified condition");
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

/// The scratch database and role of Backup `b` are gone from the server.
async fn assert_nothing_left(s: &Setup, b: &Backup) {
    let scratch = format!("dbops-verify-{}", b.metadata.uid.as_deref().unwrap());
    assert!(
        !s.pg.database_exists(&scratch).await.unwrap(),
        "{scratch} left"
    );
    assert!(
        !s.pg.role_exists(&scratch).await.unwrap(),
        "role {scratch} left"
    );
}

/// Backup `b`'s verification was told by an Event of `type_` and `reason`, and left
/// nothing on the server.
/// The Event is published after the status write that the caller waited for, so it is
/// awaited (bounded) rather than read once.
async fn assert_told_and_cleaned(s: &Setup, b: &Backup, type_: &str, reason: &str) {
    let name = b.metadata.name.as_deref().unwrap();
    eventually(
        &format!("a {type_} Event {reason} about {name}"),
        EVENT_DEADLINE,
        || async { Ok(s.backup_event_reasons(name, type_).await) },
        |reasons: &Vec<String>| reasons.iter().any(|r| r == reason),
    )
    .await;
    assert_nothing_left(s, b).await;
}

/// How long an Event or a counter may trail the status write it follows.
const EVENT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Waits (bounded) until the backup-controller's `dbops_backup_verifications_total` with
/// `result` reaches `expected` (it is counted after the outcome's status write), and
/// asserts it is exactly that.
async fn assert_verifications(s: &Setup, result: &str, expected: f64) {
    let label = format!(r#"result="{result}""#);
    let counted = eventually(
        &format!("dbops_backup_verifications_total{{{label}}} reaching {expected}"),
        EVENT_DEADLINE,
        || async { Ok(s.backup_metric("dbops_backup_verifications_total", &[label.as_str()])) },
        |n: &f64| *n >= expected,
    )
    .await;
    assert_eq!(counted, expected);
}

async fn set_verify(s: &Setup, name: &str) {
    s.backups()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"verify": true}})),
        )
        .await
        .unwrap();
}

/// Restarts the backup-controller with `--verify-server=<server>`, every dump taking
/// its inventory (so that a Backup made without `verify` can be verified later).
fn restart_with_verify_server(s: &mut Setup, server: &str) {
    s.kill_backup_controller();
    s.backup_args = vec![
        format!("--verify-server={server}"),
        "--dump-inventory=true".into(),
    ];
    s.start_backup_controller();
}

/// Without a verification server, with one that admits tenants, and for a Backup whose
/// dump counted nothing (made without `verify`, `--dump-inventory=false`): Error, saying why.
/// With one: Passed with every table and row, nothing left; a changed byte in the store
/// Failed (VerificationChecksumMismatch); a row count changed in the manifest Failed
/// (RowCountMismatch, naming the table); each a condition, an Event and a metric.
#[tokio::test]
async fn a_verified_backup_passes_and_a_changed_artifact_or_inventory_fails() {
    let mut s = Setup::new("bk-verify").await;
    s.create_pgbench_database("source", 1).await;
    s.exec_as_superuser(
        "source",
        "CREATE VIEW big_accounts AS SELECT * FROM pgbench_accounts WHERE abalance > 0;
         CREATE FUNCTION add(a int, b int) RETURNS int LANGUAGE sql AS 'SELECT a + b';
         ALTER VIEW big_accounts OWNER TO source; ALTER FUNCTION add(int, int) OWNER TO source;",
    )
    .await;

    // A Backup made without verify by a controller with the default --dump-inventory=false:
    // its dump counted nothing, so it cannot be verified later.
    s.create_backup("uncounted", "source", json!({})).await;
    s.wait_completed("uncounted", READY).await;

    // No --verify-server: Error, and nothing judged.
    s.create_backup("unverifiable", "source", json!({"verify": true}))
        .await;
    let b = s.wait_verification("unverifiable", "Error", READY).await;
    let (status, reason, message) = verified(&b);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("Unknown", "VerificationUnavailable")
    );
    assert!(message.contains("--verify-server"), "{message}");

    // A server that admits tenants is refused.
    let tenants = dbops_e2e::fixtures::server_name(s.ns(), ADMIN_SECRET);
    restart_with_verify_server(&mut s, &tenants);
    s.create_backup("beside-tenants", "source", json!({"verify": true}))
        .await;
    let b = s.wait_verification("beside-tenants", "Error", READY).await;
    assert!(
        verified(&b).2.contains("allowedNamespaces"),
        "{:?}",
        verified(&b)
    );

    let server = s.create_verify_server().await;
    restart_with_verify_server(&mut s, &server);
    s.create_backup("good", "source", json!({"verify": true}))
        .await;
    let good = s.wait_verification("good", "Passed", READY).await;
    let v = verification(&good);
    let tables = s.tables("source").await;
    let rows: i64 = tables.values().map(|(n, _)| n).sum();
    assert_eq!(
        v.tables,
        Some(i64::try_from(tables.len()).unwrap()),
        "{v:?}"
    );
    assert_eq!(v.rows, Some(rows), "{v:?}");
    assert_eq!(v.server.as_deref(), Some(server.as_str()));
    assert!(
        v.verified_at.is_some() && v.duration.is_some() && v.runner.is_none(),
        "{v:?}"
    );
    let (status, reason, message) = verified(&good);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "VerificationPassed")
    );
    assert!(message.contains(&format!("{rows} rows")), "{message}");
    assert_told_and_cleaned(&s, &good, "Normal", "Verified").await;
    assert_verifications(&s, "Passed", 1.0).await;

    // One byte changed in the store after the dump: Failed, and said so.
    s.create_backup("changed", "source", json!({})).await;
    let changed = s.wait_completed("changed", READY).await;
    assert!(changed.status.as_ref().unwrap().verification.is_none());
    let (artifact, manifest) = s.artifact_paths(&changed);
    let mut bytes = std::fs::read(&artifact).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    std::fs::write(&artifact, &bytes).unwrap();
    set_verify(&s, "changed").await;
    let changed = s.wait_verification("changed", "Failed", READY).await;
    let (status, reason, message) = verified(&changed);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "VerificationChecksumMismatch")
    );
    assert!(
        message.contains("not the artifact that was written"),
        "{message}"
    );
    assert_told_and_cleaned(&s, &changed, "Warning", "VerificationChecksumMismatch").await;
    drop((artifact, manifest));

    // The inventory says one more row than the dump holds: RowCountMismatch, naming it.
    s.create_backup("miscounted", "source", json!({})).await;
    let miscounted = s.wait_completed("miscounted", READY).await;
    let (_, manifest) = s.artifact_paths(&miscounted);
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let accounts = &mut m["inventory"]["tables"]["public.pgbench_accounts"];
    assert_eq!(accounts.as_i64(), Some(tables["pgbench_accounts"].0), "{m}");
    *accounts = json!(tables["pgbench_accounts"].0 + 1);
    std::fs::write(&manifest, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    set_verify(&s, "miscounted").await;
    let miscounted = s.wait_verification("miscounted", "Failed", READY).await;
    let (status, reason, message) = verified(&miscounted);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "RowCountMismatch")
    );
    assert!(
        message.contains(&format!(
            "public.pgbench_accounts: {} rows in the dump's snapshot, {} restored",
            tables["pgbench_accounts"].0 + 1,
            tables["pgbench_accounts"].0
        )),
        "{message}"
    );
    assert_told_and_cleaned(&s, &miscounted, "Warning", "RowCountMismatch").await;
    assert_verifications(&s, "Failed", 2.0).await;
}

/// A schedule with `verify: true` on an encrypted `s3://` store: its Backups are created
/// verifying, and one passes (the inventory read from the manifest's sealed part, the
/// artifact decrypted on its way to pg_restore; the bucket holds no table name in the
/// clear); the Database's last passed verification and its allowed age are exported.
#[tokio::test]
async fn a_schedule_verifies_its_encrypted_backups_and_exports_the_last_verification() {
    let mut s = Setup::with_s3("bk-verify-s3", "verify", None).await;
    let (identity, public) = Identities::generate();
    s.put_secret("backup-recipients", "recipients", &public)
        .await;
    s.put_secret("backup-identities", "identities", &identity)
        .await;
    s.extra_args = vec![
        "--backup-recipients-secret=backup-recipients".into(),
        "--backup-identities-secret=backup-identities".into(),
    ];
    let server = s.create_verify_server().await;
    restart_with_verify_server(&mut s, &server);
    let marker = format!("marker_{}", std::process::id());
    s.create_database_spec(
        "nightly",
        ADMIN_SECRET,
        json!({"backup": {"schedule": "* * * * *", "verify": true}}),
    )
    .await;
    s.wait_database_ready("nightly").await;
    s.exec_as_superuser(
        "nightly",
        &format!(
            "CREATE TABLE {marker} (n int PRIMARY KEY);
             INSERT INTO {marker} SELECT generate_series(1, 250);
             ALTER TABLE {marker} OWNER TO nightly;"
        ),
    )
    .await;
    let labelled = ListParams::default().labels("dbops.dev/schedule-of=nightly");
    let backups = s.backups();
    let passed = eventually(
        "a scheduled Backup verified",
        std::time::Duration::from_secs(180),
        || async { Ok(backups.list(&labelled).await?.items) },
        |items: &Vec<Backup>| {
            items.iter().any(|b| {
                b.status
                    .as_ref()
                    .and_then(|st| st.verification.as_ref())
                    .is_some_and(|v| v.result.as_str() == "Passed" && v.rows == Some(250))
            })
        },
    )
    .await;
    assert!(
        passed.iter().all(|b| b.spec.verify),
        "scheduled Backups verify"
    );
    let b = passed
        .iter()
        .find(|b| verification(b).result.as_str() == "Passed")
        .unwrap();
    assert!(b.status.as_ref().unwrap().encryption.is_some());
    assert_eq!(verification(b).tables, Some(1));
    assert_nothing_left(&s, b).await;
    let stem = format!(
        "verify/{}/{}-{}",
        s.ns(),
        b.metadata.name.as_deref().unwrap(),
        b.metadata.uid.as_deref().unwrap()
    );
    let store = s.s3.as_ref().unwrap();
    for suffix in ["dump", "manifest.json"] {
        let bytes =
            std::fs::read(store.object_file(S3_BUCKET, &format!("{stem}.{suffix}"))).unwrap();
        assert!(
            !bytes.windows(marker.len()).any(|w| w == marker.as_bytes()),
            "the table's name in the clear in the {suffix}"
        );
    }
    let labels = [r#"database="nightly""#];
    let verified_at = verification(b).verified_at.unwrap().0.as_second();
    let last = s.backup_metric("dbops_backup_last_verified_timestamp_seconds", &labels);
    assert!(last >= verified_at as f64 - 1.0, "{last} < {verified_at}");
    let max_age = s.backup_metric("dbops_backup_verification_max_age_seconds", &labels);
    assert_eq!(max_age, 8.0 * 24.0 * 3600.0);
}
