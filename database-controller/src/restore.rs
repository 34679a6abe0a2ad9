//! `spec.restoreFrom`: the new database is filled from a completed Backup's artifact
//! before the Database turns Ready.
//!
//! The steps, each safe to repeat after a crash:
//! 1. the Backup must exist and be Completed (`WaitingForBackup` until then; the Backup
//!    watch wakes the Database);
//! 2. an encrypted artifact's header must open with one of `--backup-identities-secret`'s
//!    identities (`DecryptionKeyMissing` otherwise); the artifact's SHA-256 is computed
//!    from the store and compared with the manifest beside it and with the Backup's
//!    `status.checksum`; any difference is `ChecksumMismatch`; either way nothing has
//!    changed on the server yet (this runs before the plan's changes);
//! 3. a database that may hold half a restore (found marked `restore=pending` rather than
//!    created just now) is dropped and created again, empty;
//! 4. `pg_restore --single-transaction --exit-on-error`, connected as the owner role (so
//!    every restored object belongs to it), reads the artifact from the store on stdin:
//!    of the `--pg-restore`/`--pg-bin-dir` programs, one that reads the archive of the
//!    pg_dump its manifest names and whose settings the server has
//!    (`pg_tools::pick_restore`);
//! 5. the database's mark loses `restore=pending`: from then on it is an ordinary
//!    database of this Database and is never restored over again.
//!
//! Store layout and checksums are the backup-controller's (`shared::backup_store`): the
//! database-controller must run with the same `--backup-store`.

use dbops_api::reasons::DatabaseReason;
use std::process::Stdio;

use dbops_api::{Backup, BackupPhase, Database};
use dbops_shared::artifact_copy::{WhenRefused, copy_artifact};
use dbops_shared::backup_store::{BackupStore, ObjectKey, StoreError, traced};
use dbops_shared::checksum::HashingReader;
use dbops_shared::pg_tools::{self, Connection};
use dbops_shared::postgres::{Endpoint, Session, ddl};
use dbops_shared::sealing::{self, Identities, OpenError};
use dbops_shared::server::Directory;
use kube::api::Api;
use kube::{Resource, ResourceExt};

use crate::error::{Error, Result, Why};
use crate::sql;

/// Where artifacts are read from and with which programs.
pub struct Restorer {
    pub store: BackupStore,
    pub clients: pg_tools::Clients,
    /// `--backup-identities-secret`: the Secret (controllers' namespace) whose secret keys
    /// open encrypted artifacts.
    pub identities_secret: Option<String>,
    /// `--restore-jobs`: pg_restore's parallel jobs (from a scratch file when above 1).
    pub jobs: u16,
    /// `--restore-scratch-dir`: where a parallel restore's copy of the artifact is kept.
    pub scratch: std::path::PathBuf,
}

/// A completed Backup's artifact, checked: its key and checksum.
pub struct Artifact {
    pub key: ObjectKey,
    pub backup: String,
    pub checksum: String,
    /// The major of the pg_dump that wrote it (`pgDumpVersion` in its manifest).
    pub pg_dump_major: Option<u32>,
    /// For an encrypted artifact, the identities of which one opens it.
    pub identities: Option<Identities>,
    /// When the dump began (its snapshot): the instant a clone of it is as of.
    pub taken_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

fn store_error(e: StoreError) -> Error {
    match e {
        StoreError::NotFound(what) => Error::reported(
            DatabaseReason::ArtifactNotFound,
            format!(
                "{what}: the Backup's artifact is missing (does this controller use the backup-controller's --backup-store?)"
            ),
        ),
        // A store that refuses or is misconfigured is StoreUnavailable as well, and
        // retried with backoff as its class says (a fixed store needs no change here).
        e => Error::reported(DatabaseReason::StoreUnavailable, e.to_string()),
    }
}

/// Step 1 and 2: the Backup named in `spec.restoreFrom`, completed, with an artifact whose
/// SHA-256 matches both its manifest and the Backup's status.
pub async fn verify(
    db: &Database,
    client: &kube::Client,
    restorer: &Restorer,
    directory: &Directory,
) -> Result<Artifact> {
    let Some(name) = db.backup_to_restore() else {
        return Err(Error::Internal("no restoreFrom".into()));
    };
    let namespace = db.namespace().unwrap_or_default();
    let backups: Api<Backup> = Api::namespaced(client.clone(), &namespace);
    let Some(backup) = backups.get_opt(name).await? else {
        return Err(Error::reported(
            DatabaseReason::BackupNotFound,
            format!(
                "Backup {namespace}/{name} named in {} does not exist",
                if db.spec.restore_from.is_some() {
                    "spec.restoreFrom"
                } else {
                    "spec.cloneFrom.backupRef"
                }
            ),
        ));
    };
    let status = backup.status.clone().unwrap_or_default();
    completed(&status, &namespace, name)?;
    let expected = status.checksum.clone().unwrap_or_default();
    let key = ObjectKey::new(&namespace, name, &backup.uid().unwrap_or_default());

    let manifest = restorer
        .store
        .get_manifest(&key)
        .await
        .map_err(store_error)?;
    let manifest = serde_json::from_slice::<serde_json::Value>(&manifest).ok();
    let in_manifest = manifest
        .as_ref()
        .and_then(|m| m.get("checksum")?.as_str().map(str::to_owned));
    let pg_dump_major = manifest
        .as_ref()
        .and_then(|m| m.get("pgDumpVersion")?.as_str())
        .and_then(pg_tools::ClientVersion::parse)
        .map(|v| v.major);
    // A key that opens it first (its header): the checksum pass reads the whole artifact.
    let backup_name = format!("{namespace}/{name}");
    let identities = match encryption_of(&status, manifest.as_ref()) {
        Some(encryption) => {
            Some(opening_keys(restorer, directory, &key, &backup_name, &encryption).await?)
        }
        None => None,
    };
    let actual = sha256_of(restorer, &key).await?;
    let mismatch = |what: &str, want: &str| {
        Error::reported(
            DatabaseReason::ChecksumMismatch,
            format!(
                "the artifact of Backup {namespace}/{name} has SHA-256 {actual}, but {what} says {want}; nothing was restored"
            ),
        )
    };
    match in_manifest.as_deref() {
        None => return Err(mismatch("the manifest", "nothing readable")),
        Some(m) if m != actual => return Err(mismatch("its manifest", m)),
        Some(_) => {}
    }
    if expected != actual {
        return Err(mismatch("the Backup's status", &expected));
    }
    Ok(Artifact {
        key,
        backup: backup_name,
        checksum: actual,
        pg_dump_major,
        identities,
        taken_at: status.started_at.clone(),
    })
}

/// Whether the Backup `namespace/name` with `status` completed; otherwise why not.
fn completed(status: &dbops_api::BackupStatus, namespace: &str, name: &str) -> Result<()> {
    match status.phase {
        Some(BackupPhase::Completed) => Ok(()),
        Some(BackupPhase::Failed) => Err(Error::reported(
            DatabaseReason::BackupFailed,
            format!("Backup {namespace}/{name} failed; there is nothing to restore"),
        )),
        _ => Err(Error::reported(
            DatabaseReason::WaitingForBackup,
            format!("waiting for Backup {namespace}/{name} to complete before restoring"),
        )),
    }
}

/// How the artifact is encrypted, if it is: as the Backup's status says (the API's
/// word), else as its manifest does.
fn encryption_of(
    status: &dbops_api::BackupStatus,
    manifest: Option<&serde_json::Value>,
) -> Option<serde_json::Value> {
    status
        .encryption
        .as_ref()
        .and_then(|e| serde_json::to_value(e).ok())
        .or_else(|| manifest.and_then(|m| m.get("encryption")).cloned())
}

/// The identities that open the encrypted artifact of `key` (its manifest's `encryption`
/// names the format and recipients): `--backup-identities-secret`'s, tried on the
/// artifact's header. Otherwise `DecryptionKeyMissing`, naming the recipients, and
/// nothing is restored.
async fn opening_keys(
    restorer: &Restorer,
    directory: &Directory,
    key: &ObjectKey,
    backup: &str,
    encryption: &serde_json::Value,
) -> Result<Identities> {
    let format = encryption
        .get("format")
        .and_then(|f| f.as_str())
        .unwrap_or_default();
    let recipients: Vec<&str> = encryption
        .get("recipients")
        .and_then(|r| r.as_array())
        .map(|r| r.iter().filter_map(|k| k.as_str()).collect())
        .unwrap_or_default();
    let refused = |why: String| {
        Error::reported(
            DatabaseReason::DecryptionKeyMissing,
            format!(
                "the artifact of Backup {backup} is encrypted ({format}) to {}; {why}; nothing was restored",
                recipients.join(", ")
            ),
        )
    };
    if format != sealing::FORMAT {
        return Err(refused(format!(
            "this controller reads {} only",
            sealing::FORMAT
        )));
    }
    let Some(name) = &restorer.identities_secret else {
        return Err(refused(
            "the database-controller has no identities to open it (--backup-identities-secret)"
                .into(),
        ));
    };
    directory.synced().await.map_err(|e| Error::Reported {
        reason: DatabaseReason::CacheNotSynced.into(),
        message: e.to_string(),
    })?;
    let secret = directory.secret(name);
    let identities = sealing::keys_from(
        secret.as_deref(),
        name,
        sealing::IDENTITIES_KEY,
        Identities::parse,
    )
    .map_err(refused)?;
    let reader = open_artifact(restorer, key).await?;
    match sealing::open(reader, &identities).await {
        Ok(_) => Ok(identities),
        Err(OpenError::Io(e)) => Err(Error::Reported {
            reason: DatabaseReason::StoreUnavailable.into(),
            message: format!("reading {}: {e}", restorer.store.location(key)),
        }),
        Err(e) => Err(refused(format!(
            "Secret {name} holds identities for {}: {e}",
            identities.public_keys().join(", ")
        ))),
    }
}

/// The artifact of `key`, opened for reading from the store (traced).
async fn open_artifact(
    restorer: &Restorer,
    key: &ObjectKey,
) -> Result<dbops_shared::backup_store::ArtifactReader> {
    traced(
        "open_artifact",
        restorer.store.location(key),
        restorer.store.open_artifact(key),
    )
    .await
    .map_err(store_error)
}

async fn sha256_of(restorer: &Restorer, key: &ObjectKey) -> Result<String> {
    let reader = open_artifact(restorer, key).await?;
    HashingReader::new(reader)
        .sha256_hex_to_end()
        .await
        .map_err(|e| Error::Reported {
            reason: DatabaseReason::StoreUnavailable.into(),
            message: format!("reading {}: {e}", restorer.store.location(key)),
        })
}

/// Steps 3 to 5: an empty database (dropped and created again unless `fresh`), the
/// artifact restored into it as `owner`, then the pending mark removed.
#[allow(clippy::too_many_arguments)]
pub async fn restore(
    db: &Database,
    server: &Endpoint,
    session: &Session,
    restorer: &Restorer,
    artifact: &Artifact,
    fresh: bool,
    owner: &str,
    password: &str,
) -> Result<()> {
    let uid = db.uid().unwrap_or_default();
    let database = db.database_name();
    if !fresh {
        start_over(session, db, owner).await?;
    }
    let pg_restore = pick_pg_restore(session, restorer, artifact).await?;
    run_pg_restore(db, server, &pg_restore, restorer, artifact, owner, password).await?;
    sql::comment_database(session, &database, &sql::mark(&uid)).await?;
    tracing::info!(
        database,
        backup = artifact.backup,
        checksum = artifact.checksum,
        "restored"
    );
    Ok(())
}

/// Maybe half a restore (or clone) from an attempt that crashed or failed: the database
/// dropped and made again, empty, still marked pending.
pub async fn start_over(session: &Session, db: &Database, owner: &str) -> Result<()> {
    let database = db.database_name();
    sql::drop_database(session, &database).await?;
    sql::create_database(
        session,
        &database,
        owner,
        db.spec.connection_limit,
        &sql::restore_pending_mark(&db.uid().unwrap_or_default()),
    )
    .await?;
    Ok(())
}

/// The pg_restore for this artifact and server (`pg_tools::pick_restore`); an artifact
/// whose manifest names no pg_dump is taken as written by the newest pg_restore's major.
pub async fn pick_pg_restore(
    session: &Session,
    restorer: &Restorer,
    artifact: &Artifact,
) -> Result<std::path::PathBuf> {
    let (num, version) = ddl::server_version(session).await?;
    let restore = restorer
        .clients
        .pg_restore_for(artifact.pg_dump_major, num, &version);
    restore.await.map_err(|refusal| {
            Error::reported(
                Why::shared(refusal.reason),
                format!(
                    "Backup {}: {refusal}; run the database-controller with one (--pg-restore, --pg-bin-dir)",
                    artifact.backup
                ),
            )
        })
}

/// Runs `pg_restore` as `owner` into the database: fed the artifact from the store on its
/// stdin in one transaction, or with `--restore-jobs` above 1 from a scratch file (the
/// custom format restores in parallel from a file only; the file is removed after), the
/// bytes checked against the verified checksum before pg_restore reads them.
async fn run_pg_restore(
    db: &Database,
    server: &Endpoint,
    pg_restore: &std::path::Path,
    restorer: &Restorer,
    artifact: &Artifact,
    owner: &str,
    password: &str,
) -> Result<()> {
    let target = Target {
        db,
        server,
        owner,
        password,
    };
    restore_section(&target, pg_restore, restorer, artifact, None).await
}

/// Where a restore goes: the Database's database on `server`, as `owner`.
pub struct Target<'a> {
    pub db: &'a Database,
    pub server: &'a Endpoint,
    pub owner: &'a str,
    pub password: &'a str,
}

/// [`run_pg_restore`], or with `section` only that part of the archive (`pre-data`,
/// `post-data`), from stdin in one transaction.
pub async fn restore_section(
    target: &Target<'_>,
    pg_restore: &std::path::Path,
    restorer: &Restorer,
    artifact: &Artifact,
    section: Option<&str>,
) -> Result<()> {
    let Target {
        db,
        server,
        owner,
        password,
    } = *target;
    let program = pg_restore.display().to_string();
    let could_not_run = |e: std::io::Error| restore_failed(format!("could not run {program}: {e}"));
    let scratch = match (restorer.jobs, section) {
        (0 | 1, _) | (_, Some(_)) => None,
        _ => Some(to_scratch(db, restorer, artifact).await?),
    };
    // The password goes through the environment only: never on a command line. The
    // server's CA file (`_root_cert`) lives until pg_restore has ended.
    let (mut command, _root_cert) = pg_tools::command(
        pg_restore,
        &Connection {
            server,
            username: owner,
            password,
            database: &db.database_name(),
            application: "dbops-database-controller-restore",
        },
    )
    .map_err(could_not_run)?;
    command
        .args(pg_tools::RESTORE_AS_OWNER)
        .args(section.map(|s| format!("--section={s}")))
        .arg(format!("--dbname={}", db.database_name()))
        .stdout(Stdio::null());
    match &scratch {
        // Not one transaction: a failed parallel restore leaves the database marked
        // pending, and the next attempt makes it anew.
        Some(file) => command
            .arg(format!("--jobs={}", restorer.jobs))
            .arg(&file.path)
            .stdin(Stdio::null()),
        None => command.arg("--single-transaction").stdin(Stdio::piped()),
    };
    let mut child = command.spawn().map_err(could_not_run)?;
    let errors = pg_tools::keep_stderr(child.stderr.take());
    let (copy_error, restored) = match child.stdin.take() {
        Some(stdin) => feed_part(stdin, restorer, artifact, section.is_some()).await?,
        None => (None, artifact.checksum.clone()),
    };
    let status = child
        .wait()
        .await
        .map_err(|e| restore_failed(format!("waiting for pg_restore: {e}")))?;
    let stderr = errors.await.unwrap_or_default();
    if !status.success() {
        // What the copy met, if anything (an artifact that did not decrypt, a store that
        // failed), is why pg_restore saw a stream cut short: both are said.
        let copy = copy_error.map(|e| format!("; {e}")).unwrap_or_default();
        return Err(restore_failed(format!(
            "pg_restore failed ({status}): {stderr}{copy}"
        )));
    }
    copied_as_verified(copy_error, &restored, artifact)
}

/// The artifact copied to a scratch file of `--restore-scratch-dir` (decrypted), its
/// bytes as stored checked against the verified checksum; removed when dropped.
async fn to_scratch(db: &Database, restorer: &Restorer, artifact: &Artifact) -> Result<Scratch> {
    let path = restorer.scratch.join(format!(
        "dbops-restore-{}.dump",
        db.uid().unwrap_or_default()
    ));
    let scratch = Scratch { path };
    let file = tokio::fs::File::create(&scratch.path)
        .await
        .map_err(|e| restore_failed(format!("creating {}: {e}", scratch.path.display())))?;
    let (copy_error, restored) = feed(
        tokio::io::BufWriter::with_capacity(1 << 20, file),
        restorer,
        artifact,
    )
    .await?;
    copied_as_verified(copy_error, &restored, artifact)?;
    Ok(scratch)
}

/// A scratch copy of an artifact, removed when dropped.
struct Scratch {
    path: std::path::PathBuf,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether the copy went through and its bytes, as stored, are the verified ones.
pub fn copied_as_verified(
    copy_error: Option<String>,
    restored: &str,
    artifact: &Artifact,
) -> Result<()> {
    if let Some(e) = copy_error {
        return Err(restore_failed(e));
    }
    if restored != artifact.checksum {
        return Err(restore_failed(format!(
            "the artifact changed while it was restored (SHA-256 {restored}, verified {})",
            artifact.checksum
        )));
    }
    Ok(())
}

/// Copies the artifact from the store to `out`, pg_restore's stdin or a scratch file
/// (closed at the end), decrypted if it is encrypted
/// ([`dbops_shared::artifact_copy`]); what went wrong on the way, if anything, and the
/// SHA-256 of the bytes copied. If the artifact changed since `verify`, the attempt fails
/// and the database keeps its pending mark, so the next attempt starts from an empty
/// database and verifies again.
pub async fn feed<W: tokio::io::AsyncWrite + Unpin>(
    out: W,
    restorer: &Restorer,
    artifact: &Artifact,
) -> Result<(Option<String>, String)> {
    feed_part(out, restorer, artifact, false).await
}

/// [`feed`]; with `part`, for a pg_restore of one section, which may stop reading before
/// the archive's end: the rest is read and hashed all the same, and its stopping is not
/// an error (its exit status says whether it did its part).
pub async fn feed_part<W: tokio::io::AsyncWrite + Unpin>(
    out: W,
    restorer: &Restorer,
    artifact: &Artifact,
    part: bool,
) -> Result<(Option<String>, String)> {
    let identities = artifact.identities.as_ref();
    let when_refused = if part {
        WhenRefused::HashTheRest
    } else {
        WhenRefused::Stop
    };
    let copied = copy_artifact(
        &restorer.store,
        &artifact.key,
        identities,
        out,
        when_refused,
    )
    .await
    .map_err(store_error)?;
    let error = copied.error.filter(|_| !(part && copied.only_refused));
    Ok((error, copied.sha256))
}

/// A restore that failed, retried with backoff.
fn restore_failed(message: String) -> Error {
    Error::Reported {
        reason: DatabaseReason::RestoreFailed.into(),
        message,
    }
}

/// Whether a Backup event concerns a Database still waiting to be restored from it.
pub fn waits_for(db: &Database, backup_namespace: &str, backup: &str) -> bool {
    db.meta().namespace.as_deref() == Some(backup_namespace)
        && db.backup_to_restore() == Some(backup)
        && db.status.as_ref().is_none_or(|s| s.provider_id.is_none())
}
