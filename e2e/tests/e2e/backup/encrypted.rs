//! Client-side encryption (issue 37): the backup-controller given recipients
//! (`--backup-recipients-secret`) writes age ciphertext only, to a `file://` and an
//! `s3://` store; the database-controller given identities (`--backup-identities-secret`)
//! restores it. A restore without an identity that opens the artifact is refused naming
//! its recipients, before anything changes on the server; keys rotate with several
//! recipients and identities at once; a changed byte is refused by the checksum.

use std::path::PathBuf;

use dbops_api::Backup;
use dbops_e2e::fixtures::Connection;
use dbops_e2e::harness::backup::{READY, S3_BUCKET, Setup};
use dbops_e2e::postgres::scalar;
use dbops_e2e::wait::{Want, condition};
use dbops_shared::sealing::Identities;
use serde_json::json;

const RECIPIENTS: &str = "backup-recipients";
const IDENTITIES: &str = "backup-identities";

/// Writes Secret `name` (the controllers' namespace is the test's) with `key: text`.
async fn put_keys(s: &Setup, name: &str, key: &str, text: &str) {
    s.put_secret(name, key, text).await;
}

/// Both controllers restarted with the key flags (each reads the one it uses).
fn restart_with_keys(s: &mut Setup, identities: bool) {
    s.kill_backup_controller();
    s.kill_database_controller();
    s.extra_args = vec![format!("--backup-recipients-secret={RECIPIENTS}")];
    if identities {
        s.extra_args
            .push(format!("--backup-identities-secret={IDENTITIES}"));
    }
    s.start_backup_controller();
    s.start_database_controller();
}

/// A Database `name` with a table whose name is `marker` (pg_dump compresses table data,
/// not its table of contents: a name is where plaintext would show) and 1,000 rows.
async fn database_with_marker(s: &Setup, name: &str, marker: &str) {
    s.create_database(name, "Delete").await;
    s.exec_as_superuser(
        name,
        &format!(
            "CREATE TABLE {marker} (n int PRIMARY KEY, v text);
             INSERT INTO {marker} SELECT g, 'row ' || g FROM generate_series(1, 1000) g;
             ALTER TABLE {marker} OWNER TO {name};"
        ),
    )
    .await;
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// The rows of `marker` in the restored database `db`, read with its own Secret's login.
async fn rows_in(s: &Setup, db: &str, marker: &str) -> i64 {
    let c = Connection::of_database(&s.b.client, s.ns(), db)
        .await
        .unwrap();
    let app = s.pg.connect(&c.user, &c.password, &c.dbname).await.unwrap();
    scalar(&app, &format!("SELECT count(*) FROM {marker}")).await
}

/// The database-controller restarted with the store, Debian's pg_restore, two restore
/// jobs and `scratch` (after the common flags, the key flags among them).
fn restart_with_jobs(s: &mut Setup, scratch: &std::path::Path) {
    s.kill_database_controller();
    let pg_restore = dbops_e2e::paths::postgres_bin_dir()
        .unwrap()
        .join("pg_restore");
    s.database_controller = Some(s.start_with_env(
        "database-controller",
        vec![
            format!("--backup-store={}", s.store_url),
            format!("--pg-restore={}", pg_restore.display()),
            "--restore-jobs=2".into(),
            format!("--restore-scratch-dir={}", scratch.display()),
        ],
        &s.s3_env,
    ));
}

/// A Backup before and after the keys are given, the second restored: the plain artifact
/// shows the marker (the check can fail), the encrypted one and its manifest do not; the
/// status and manifest say how it is encrypted; the restore has every row; then one byte
/// changed in the stored artifact is refused (ChecksumMismatch) with nothing made.
async fn round_trip(mut s: Setup, artifact_of: impl Fn(&Setup, &Backup) -> (PathBuf, PathBuf)) {
    let marker = format!("marker_{}", std::process::id());
    database_with_marker(&s, "source", &marker).await;
    s.create_backup("plain", "source", json!({})).await;
    let plain = s.wait_completed("plain", READY).await;
    let (plain_artifact, _) = artifact_of(&s, &plain);
    assert!(
        contains(&std::fs::read(&plain_artifact).unwrap(), &marker),
        "the unencrypted artifact shows the table's name"
    );

    let (identity, public) = Identities::generate();
    put_keys(
        &s,
        RECIPIENTS,
        "recipients",
        &format!("# the platform's\n{public}\n"),
    )
    .await;
    put_keys(&s, IDENTITIES, "identities", &identity).await;
    restart_with_keys(&mut s, true);
    s.create_backup("sealed", "source", json!({})).await;
    let sealed = s.wait_completed("sealed", READY).await;
    let status = sealed.status.clone().unwrap();
    let encryption = status.encryption.clone().expect("status.encryption");
    assert_eq!(encryption.format, "age");
    assert_eq!(encryption.recipients, vec![public.clone()]);
    let (artifact, manifest) = artifact_of(&s, &sealed);
    let bytes = std::fs::read(&artifact).unwrap();
    assert!(
        bytes.starts_with(b"age-encryption.org/v1\n"),
        "not an age file"
    );
    assert!(
        !contains(&bytes, &marker),
        "plaintext in the encrypted artifact"
    );
    assert_eq!(
        status.checksum.as_deref(),
        Some(dbops_shared::checksum::sha256_hex(&bytes).as_str()),
        "the checksum is of the stored (encrypted) bytes"
    );
    let manifest_bytes = std::fs::read(&manifest).unwrap();
    let m: serde_json::Value = serde_json::from_slice(&manifest_bytes).unwrap();
    assert_eq!(
        m["encryption"],
        json!({"format": "age", "recipients": [public]})
    );
    assert!(m.get("database").is_none(), "{m}");
    assert!(!contains(&manifest_bytes, "databaseName"), "{m}");
    let opened = Identities::parse(&identity)
        .unwrap()
        .open_armored(m["sealed"].as_str().unwrap())
        .unwrap();
    let sealed_part: serde_json::Value = serde_json::from_slice(&opened).unwrap();
    assert_eq!(sealed_part["database"]["databaseName"], json!("source"));

    s.create_restored_database("copy", "sealed").await;
    s.wait_database("copy", Want::provisioned(), READY).await;
    assert_eq!(rows_in(&s, "copy", &marker).await, 1000);

    let mut changed = bytes.clone();
    let middle = changed.len() / 2;
    changed[middle] ^= 1;
    std::fs::write(&artifact, &changed).unwrap();
    s.create_restored_database("copy2", "sealed").await;
    s.wait_database("copy2", Want::not_ready("ChecksumMismatch"), READY)
        .await;
    assert!(!s.pg.database_exists("copy2").await.unwrap());
}

#[tokio::test]
async fn an_encrypted_backup_restores_and_the_file_store_holds_no_plaintext() {
    let s = Setup::new("bk-enc").await;
    round_trip(s, |s, b| s.artifact_paths(b)).await;
}

#[tokio::test]
async fn an_encrypted_backup_restores_and_the_s3_store_holds_no_plaintext() {
    let s = Setup::with_s3("bk-enc-s3", "enc", None).await;
    round_trip(s, |s, b| {
        let stem = format!(
            "enc/{}/{}-{}",
            s.ns(),
            b.metadata.name.as_deref().unwrap(),
            b.metadata.uid.as_deref().unwrap()
        );
        let server = s.s3.as_ref().unwrap();
        (
            server.object_file(S3_BUCKET, &format!("{stem}.dump")),
            server.object_file(S3_BUCKET, &format!("{stem}.manifest.json")),
        )
    })
    .await;
}

/// Rotation: Backups sealed to the old key, to both, and to the new one. Without
/// identities a restore is refused naming the recipients, and nothing is made on the
/// server; with the new identity only, the artifacts sealed to it restore and the one
/// sealed to the old key alone is refused; with both identities (the old kept while its
/// artifacts may be needed) that one restores too.
#[tokio::test]
async fn keys_rotate_and_a_restore_without_a_key_that_opens_it_touches_nothing() {
    let mut s = Setup::new("bk-rotate").await;
    let marker = format!("marker_{}", std::process::id());
    database_with_marker(&s, "source", &marker).await;
    let (old, old_public) = Identities::generate();
    let (new, new_public) = Identities::generate();
    put_keys(&s, RECIPIENTS, "recipients", &old_public).await;
    // No resync within the test: what wakes a Database is an event.
    s.resync = "600s";
    restart_with_keys(&mut s, false);
    for (backup, recipients) in [
        ("to-old", vec![old_public.clone()]),
        ("to-both", vec![old_public.clone(), new_public.clone()]),
        ("to-new", vec![new_public.clone()]),
    ] {
        // The Secret is read at each attempt: no restart.
        put_keys(&s, RECIPIENTS, "recipients", &recipients.join("\n")).await;
        let b = s.create_backup(backup, "source", json!({})).await;
        let done = s.wait_completed(backup, READY).await;
        assert_eq!(
            done.status
                .and_then(|st| st.encryption)
                .map(|e| e.recipients),
            Some(recipients),
            "{:?}",
            b.metadata.name
        );
    }

    // No identities at all.
    s.create_restored_database("from-new", "to-new").await;
    let refused = s
        .wait_database("from-new", Want::not_ready("DecryptionKeyMissing"), READY)
        .await;
    let message = condition(&refused, "Ready").unwrap().message.clone();
    assert!(
        message.contains(&new_public) && message.contains("--backup-identities-secret"),
        "{message}"
    );
    assert!(
        !s.pg.database_exists("from-new").await.unwrap()
            && !s.pg.role_exists("from-new").await.unwrap(),
        "a refused restore made something on the server"
    );

    // The new identity only.
    put_keys(&s, IDENTITIES, "identities", &new).await;
    restart_with_keys(&mut s, true);
    s.wait_database("from-new", Want::provisioned(), READY)
        .await;
    s.create_restored_database("from-both", "to-both").await;
    s.wait_database("from-both", Want::provisioned(), READY)
        .await;
    s.create_restored_database("from-old", "to-old").await;
    let refused = s
        .wait_database("from-old", Want::not_ready("DecryptionKeyMissing"), READY)
        .await;
    let message = condition(&refused, "Ready").unwrap().message.clone();
    assert!(message.contains(&old_public), "{message}");
    assert!(
        !message.contains("AGE-SECRET-KEY"),
        "a key in the status: {message}"
    );
    assert!(!s.pg.database_exists("from-old").await.unwrap());

    // The old identity kept beside the new one: its artifacts restore, woken by the
    // Secret's change (no resync comes within the wait).
    put_keys(
        &s,
        IDENTITIES,
        "identities",
        &format!("# new\n{new}\n# old, until its Backups expire\n{old}\n"),
    )
    .await;
    s.wait_database("from-old", Want::provisioned(), READY)
        .await;
    for db in ["from-new", "from-both", "from-old"] {
        assert_eq!(rows_in(&s, db, &marker).await, 1000, "{db}");
    }
}

/// `--restore-jobs=2`: the encrypted artifact is decrypted into a scratch file, checked,
/// restored by two pg_restore jobs, and the file removed; every row arrives.
#[tokio::test]
async fn an_encrypted_backup_restores_with_two_jobs_from_a_scratch_file_removed_after() {
    let mut s = Setup::new("bk-enc-jobs").await;
    s.create_pgbench_database("source", 2).await;
    let (identity, public) = Identities::generate();
    put_keys(&s, RECIPIENTS, "recipients", &public).await;
    put_keys(&s, IDENTITIES, "identities", &identity).await;
    restart_with_keys(&mut s, true);
    s.create_backup("sealed", "source", json!({})).await;
    s.wait_completed("sealed", READY).await;

    let scratch = dbops_e2e::harness::bed::test_dir("bk-enc-jobs", "scratch");
    restart_with_jobs(&mut s, scratch.path());
    s.create_restored_database("copy", "sealed").await;
    s.wait_database("copy", Want::provisioned(), READY).await;
    let counts = |t: std::collections::BTreeMap<String, (i64, String)>| {
        t.into_iter().map(|(k, (n, _))| (k, n)).collect::<Vec<_>>()
    };
    assert_eq!(
        counts(s.tables("copy").await),
        counts(s.tables("source").await)
    );
    assert_eq!(
        std::fs::read_dir(scratch.path()).unwrap().count(),
        0,
        "the scratch copy was not removed"
    );
    let log = s.log("database-controller", 200_000);
    assert!(!log.contains("AGE-SECRET-KEY"), "a key in the log");

    // The copy goes where the flag says: a directory that is not there fails the restore.
    let missing = scratch.path().join("missing");
    restart_with_jobs(&mut s, &missing);
    s.create_restored_database("copy2", "sealed").await;
    let failed = s
        .wait_database("copy2", Want::not_ready("RestoreFailed"), READY)
        .await;
    let message = condition(&failed, "Ready").unwrap().message.clone();
    assert!(
        message.contains(&missing.display().to_string()),
        "{message}"
    );
}
