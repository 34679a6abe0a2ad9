//! The `s3://` store: one verified object per Backup that deletion removes, refused
//! credentials keep the controllers not ready, uploads in parts show only committed
//! artifacts.

use std::time::Duration;

use dbops_api::Backup;
use dbops_e2e::harness::backup::{
    ADMIN_SECRET, READY, S3_BUCKET, Setup, attempts, pg_restore_list, sha256_of,
};
use dbops_e2e::s3::S3Server;
use kube::api::DeleteParams;
use serde_json::json;

/// The object keys of a Backup in the bucket: `<prefix>/<ns>/<name>-<uid>.{dump,manifest.json}`.
fn s3_keys_of(s: &Setup, s3_prefix: &str, backup: &Backup) -> (String, String) {
    let stem = format!(
        "{s3_prefix}/{}/{}-{}",
        s.ns(),
        backup.metadata.name.as_deref().unwrap(),
        backup.metadata.uid.as_deref().unwrap()
    );
    (format!("{stem}.dump"), format!("{stem}.manifest.json"))
}

/// (s3-a) A Backup into `s3://bucket/prefix`: the artifact and the manifest are objects
/// under the Backup's key, the status checksum is the SHA-256 of the stored object,
/// pg_restore reads it, and deleting the Backup (deletionPolicy Delete) removes both.
#[tokio::test]
async fn an_s3_backup_is_one_verified_object_that_deletion_removes() {
    let s = Setup::with_s3("bk-s3", "dbops/e2e", None).await;
    let server = s.s3.as_ref().unwrap();
    s.create_pgbench_database("bench", 2).await;
    let created = s
        .create_backup("bench-1", "bench", json!({"deletionPolicy": "Delete"}))
        .await;
    let backup = s.wait_completed("bench-1", READY).await;
    assert_eq!(attempts(&backup), 1);
    let (artifact_key, manifest_key) = s3_keys_of(&s, "dbops/e2e", &backup);
    // Beside the store's identity (`<prefix>/.dbops-store-id`, written at startup).
    assert_eq!(
        server.keys(S3_BUCKET, "").unwrap(),
        [
            "dbops/e2e/.dbops-store-id".to_string(),
            artifact_key.clone(),
            manifest_key.clone()
        ],
        "exactly the artifact and its manifest"
    );
    assert_eq!(
        server.unfinished_upload_parts().unwrap(),
        0,
        "no upload left open"
    );

    let status = backup.status.clone().unwrap();
    let artifact = server.object_file(S3_BUCKET, &artifact_key);
    let sum = sha256_of(&artifact);
    assert_eq!(status.checksum.as_deref(), Some(sum.as_str()));
    let size = std::fs::metadata(&artifact).unwrap().len();
    assert_eq!(status.size_bytes, Some(i64::try_from(size).unwrap()));
    assert_eq!(
        status.location.as_deref(),
        Some(format!("s3://{S3_BUCKET}/{artifact_key}").as_str())
    );
    let manifest = server.object_file(S3_BUCKET, &manifest_key);
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(m["checksum"], json!(sum));
    assert_eq!(m["sizeBytes"], json!(size));
    assert_eq!(m["backup"]["uid"], json!(created.metadata.uid));
    let toc = pg_restore_list(&artifact);
    for table in ["pgbench_accounts", "pgbench_branches", "pgbench_tellers"] {
        assert!(toc.contains(table), "{table} is not in the dump:\n{toc}");
    }
    let raw = std::fs::read_to_string(s.logs.path().join("backup-controller.log")).unwrap();
    assert!(
        !raw.contains(server.secret_key()),
        "the S3 secret key is in the backup-controller's log"
    );

    s.backups()
        .delete("bench-1", &DeleteParams::default())
        .await
        .unwrap();
    s.wait_object_gone(s.backups(), &created, READY).await;
    assert_eq!(
        server.keys(S3_BUCKET, "").unwrap(),
        ["dbops/e2e/.dbops-store-id"],
        "deletionPolicy Delete removes the artifact and the manifest (not the store's identity)"
    );
}

/// (s3-b) Credentials the S3 server refuses are a configuration error found when the
/// controllers start (issue 10: not ready with the reason, instead of failing later): both
/// answer /readyz 503 naming it, no Backup is attempted, and no secret is logged. (A
/// missing bucket is sorted the same way, see backup_store's unit tests; s3s-fs creates
/// buckets on PUT.)
#[tokio::test]
async fn refused_s3_credentials_keep_the_controllers_not_ready() {
    let wrong = "not-the-s3-secret-key-7c1e";
    let s = Setup::with_s3("bk-s3-auth", "dbops", Some(wrong)).await;
    // Refused credentials are found when the controllers start, not at the first Backup:
    // neither becomes ready, and /readyz says why.
    for (name, controller) in [
        ("backup-controller", s.backup_controller.as_ref().unwrap()),
        (
            "database-controller",
            s.database_controller.as_ref().unwrap(),
        ),
    ] {
        let (code, body) = dbops_e2e::wait::eventually(
            &format!("{name} /readyz names the refused credentials"),
            READY,
            || async { controller.get("/readyz") },
            |(code, body): &(u16, String)| {
                *code == 503 && body.contains("credentials were refused")
            },
        )
        .await;
        assert_eq!(code, 503);
        assert!(body.contains("BackupStore"), "{body}");
        assert!(!body.contains(wrong), "a secret is in /readyz");
    }
    s.create_database_with("app", "Delete", ADMIN_SECRET).await;
    s.create_backup("app-1", "app", json!({"maxRetries": 3}))
        .await;
    dbops_e2e::wait::holds_for(
        "no attempt is made while the store refuses the credentials",
        Duration::from_secs(5),
        || async { Ok(s.backups().get("app-1").await.map(|b| attempts(&b))?) },
        |n| *n == 0,
    )
    .await
    .unwrap();
    let server = s.s3.as_ref().unwrap();
    for log in ["backup-controller.log", "database-controller.log"] {
        let raw = std::fs::read_to_string(s.logs.path().join(log)).unwrap();
        assert!(raw.contains("credentials were refused"), "{log}");
        for secret in [wrong, server.secret_key()] {
            assert!(!raw.contains(secret), "a secret is in {log}");
        }
    }
}

/// (s3-c) The store itself against the server, no controller: a 40 MiB artifact goes up
/// in 16 MiB parts and is invisible until committed; a writer dropped mid-way (an attempt
/// that died) leaves no object and its upload is aborted; a retry overwrites the same key;
/// reads stream back what was written; missing objects are NotFound; delete is
/// idempotent; a wrong secret is refused for good and an unreachable server is transient.
#[tokio::test]
async fn the_s3_store_uploads_in_parts_and_shows_only_committed_artifacts() {
    use dbops_shared::backup_store::{BackupStore, ObjectKey, StoreError};
    use tokio::io::AsyncReadExt;

    let logs = tempfile::tempdir().unwrap();
    let server = S3Server::start("s3s-fs", logs.path()).await.unwrap();
    server.create_bucket(S3_BUCKET).unwrap();
    let url = format!("s3://{S3_BUCKET}/direct");
    let store = url
        .parse::<BackupStore>()
        .unwrap()
        .with_s3_environment(server.env());
    let key = ObjectKey::new("team-a", "orders-1", "0b5c");
    let object = server.object_file(S3_BUCKET, "direct/team-a/orders-1-0b5c.dump");
    let data: Vec<u8> = (0u32..40 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let nothing_visible = || server.keys(S3_BUCKET, "").unwrap().is_empty();

    // An attempt that dies after one part went up: nothing visible, the upload aborted.
    let mut first = store.create_artifact(&key).await.unwrap();
    for chunk in data[..20 << 20].chunks(256 << 10) {
        first.write(chunk).await.unwrap();
    }
    dbops_e2e::wait::eventually(
        "the first part to be uploaded",
        Duration::from_secs(60),
        || async { server.unfinished_upload_parts() },
        |parts| *parts > 0,
    )
    .await;
    assert!(nothing_visible(), "{:?}", server.keys(S3_BUCKET, ""));
    drop(first);
    dbops_e2e::wait::eventually(
        "the dropped writer's upload to be aborted",
        Duration::from_secs(60),
        || async { server.unfinished_upload_parts() },
        |parts| *parts == 0,
    )
    .await;
    assert!(nothing_visible(), "{:?}", server.keys(S3_BUCKET, ""));

    // The retry: three parts, visible once committed, read back as written.
    let mut second = store.create_artifact(&key).await.unwrap();
    for chunk in data.chunks(256 << 10) {
        second.write(chunk).await.unwrap();
    }
    assert!(nothing_visible(), "visible before commit");
    second.commit().await.unwrap();
    let stored = std::fs::read(&object).unwrap();
    assert!(
        stored == data,
        "the stored object differs ({} bytes, {} written)",
        stored.len(),
        data.len()
    );
    assert_eq!(server.unfinished_upload_parts().unwrap(), 0);
    let mut back = Vec::new();
    store
        .open_artifact(&key)
        .await
        .unwrap()
        .read_to_end(&mut back)
        .await
        .unwrap();
    assert!(back == data, "read back {} bytes", back.len());

    store
        .put_manifest(&key, br#"{"checksum":"x"}"#)
        .await
        .unwrap();
    assert_eq!(
        store.get_manifest(&key).await.unwrap(),
        br#"{"checksum":"x"}"#
    );
    assert_eq!(
        server.keys(S3_BUCKET, "").unwrap(),
        [
            "direct/team-a/orders-1-0b5c.dump",
            "direct/team-a/orders-1-0b5c.manifest.json"
        ]
    );

    // A small artifact is one PUT, and overwrites.
    let mut small = store.create_artifact(&key).await.unwrap();
    small.write(b"a small dump").await.unwrap();
    small.commit().await.unwrap();
    assert_eq!(std::fs::read(&object).unwrap(), b"a small dump");

    let other = ObjectKey::new("team-a", "never", "1");
    assert!(matches!(
        store.open_artifact(&other).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.get_manifest(&other).await,
        Err(StoreError::NotFound(_))
    ));
    store.delete(&key).await.unwrap();
    store.delete(&key).await.unwrap(); // already gone: still a success
    assert!(nothing_visible(), "{:?}", server.keys(S3_BUCKET, ""));

    let wrong_secret: Vec<(String, String)> = server
        .env()
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "AWS_SECRET_ACCESS_KEY" => (k, "not-the-secret-key".to_string()),
            _ => (k, v),
        })
        .collect();
    let refused = url
        .parse::<BackupStore>()
        .unwrap()
        .with_s3_environment(wrong_secret);
    let e = refused.put_manifest(&key, b"{}").await.unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    assert!(!e.is_transient(), "{e}");
    assert!(!e.to_string().contains(server.secret_key()), "{e}");
    assert!(nothing_visible());

    drop(server); // stopped: the endpoint no longer answers
    let e = store.get_manifest(&key).await.unwrap_err();
    assert!(matches!(e, StoreError::Remote { .. }), "{e}");
    assert!(e.is_transient(), "{e}");
}
