//! One attempt at a Backup: credentials, server version, pg_dump into the store under a
//! temporary name, rename, manifest; and the runner's renewals of its hold on the attempt
//! while it runs (see [`crate::runner`]).

use std::path::PathBuf;
use std::time::Duration;

use dbops_api::reasons::BackupReason;
use dbops_api::{Backup, Database};
use dbops_shared::backup_store::{ObjectKey, traced};
use dbops_shared::controller::Context;
use dbops_shared::pg_tools;
use dbops_shared::postgres::{Credentials, Endpoint, ddl};
use dbops_shared::sealing::{self, Recipients};
use dbops_shared::server::Resolved;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::Api;
use serde_json::json;

use crate::dump::{self, Dumped, Source, object_key};
use crate::error::{Failure, backup_reason};
use crate::inventory::{self, Inventory};
use crate::runner;
use crate::state::State;
use crate::status::Completed;
use crate::write;

/// How often a running dump reports `status.progressBytes`, at most.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(3);

/// One attempt: credentials, server version, the dump into the store, the manifest.
/// `backup` is the Backup as its claim returned it (its progress is written over it).
pub async fn run(
    backup: &Backup,
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Backup>,
    started_at: &Time,
) -> Result<Completed, Failure> {
    let state = &ctx.state;
    let key = object_key(backup);
    let Resolved {
        endpoint,
        credentials,
        ..
    } = server_of(ctx, db).await?;
    let dbname = db.database_name();
    let (server_version, pg_dump) = pick_pg_dump(state, &endpoint, &credentials, &dbname).await?;
    let pg_dump_version = dump::pg_dump_version(&pg_dump).await?;
    // Encrypted to these recipients, or refused: never written in the clear when asked.
    let recipients = recipients(state)?;
    let source = Source {
        server: &endpoint,
        credentials: &credentials,
        database: &dbname,
        lock_wait: state.servers.lock_timeout(),
        snapshot: None,
    };
    let (dumped, inventory) = dump_counted(
        state,
        api,
        backup,
        &key,
        &pg_dump,
        source,
        recipients.as_ref(),
    )
    .await?;

    let location = state.store.location(&key);
    let done = Completed {
        location: location.clone(),
        size_bytes: i64::try_from(dumped.size_bytes).unwrap_or(i64::MAX),
        checksum: dumped.sha256,
        server_version,
        completed_at: dbops_shared::conditions::now(),
        database_uid: db.uid().unwrap_or_default(),
        encrypted_to: recipients.as_ref().map(Recipients::public_keys),
    };
    let manifest = manifest(
        backup,
        db,
        &endpoint,
        &key,
        &pg_dump_version,
        &done,
        started_at,
        &inventory,
    );
    let manifest = seal_manifest(manifest, recipients.as_ref())?;
    let body = serde_json::to_vec_pretty(&manifest).map_err(|e| {
        Failure::new(
            BackupReason::ManifestFailed,
            format!("encoding the manifest: {e}"),
        )
    })?;
    traced(
        "put_manifest",
        location,
        state.store.put_manifest(&key, &body),
    )
    .await?;
    tracing::info!(
        size_bytes = dumped.size_bytes,
        checksum = %done.checksum,
        "backup completed"
    );
    Ok(done)
}

/// The dump of `source` into the store, reading the snapshot of an admin transaction
/// that counts what it sees meanwhile (the inventory, or why there is none), when the
/// Backup verifies or `--dump-inventory` says every dump does; else a plain dump.
async fn dump_counted(
    state: &State,
    api: &Api<Backup>,
    backup: &Backup,
    key: &ObjectKey,
    pg_dump: &std::path::Path,
    mut source: Source<'_>,
    recipients: Option<&Recipients>,
) -> Result<(Dumped, Result<Inventory, String>), Failure> {
    if !state.verification.inventory && !backup.spec.verify {
        let dumped = dump_into_store(state, api, backup, key, pg_dump, &source, recipients).await?;
        return Ok((
            dumped,
            Err("not taken: the Backup was created without verify and the backup-controller runs with --dump-inventory=false".into()),
        ));
    }
    let mut session = state
        .servers
        .connect(source.server, source.credentials, source.database)
        .await?;
    let mut counted = Counted::begin(&mut session, state.verification.timeout).await;
    source.snapshot = counted.snapshot.clone();
    let (dumped, inventory) = tokio::join!(
        dump_into_store(state, api, backup, key, pg_dump, &source, recipients),
        counted.take(),
    );
    counted.end().await;
    drop(counted);
    drop(session);
    Ok((dumped?, inventory))
}

/// The admin's transaction whose snapshot pg_dump reads and in which the inventory is
/// taken, while pg_dump runs. A snapshot that cannot be exported leaves the dump as it
/// was (its own snapshot) and the manifest without an inventory, saying why: a Backup
/// never fails for want of a count.
struct Counted<'a> {
    tx: Option<dbops_shared::postgres::Transaction<'a>>,
    snapshot: Option<String>,
    why_not: String,
}

impl<'a> Counted<'a> {
    async fn begin(session: &'a mut dbops_shared::postgres::Session, timeout: Duration) -> Self {
        let tx = match session.transaction().await {
            Ok(tx) => tx,
            Err(e) => return Self::without(format!("beginning the snapshot's transaction: {e}")),
        };
        let exported = match inventory::prepare(&tx, timeout).await {
            Ok(()) => inventory::export_snapshot(&tx).await,
            Err(e) => Err(e),
        };
        match exported {
            Ok(snapshot) => Self {
                tx: Some(tx),
                snapshot: Some(snapshot),
                why_not: String::new(),
            },
            Err(why) => Self::without(why),
        }
    }

    fn without(why_not: String) -> Self {
        tracing::warn!(%why_not, "no inventory for this dump: it takes its own snapshot");
        Self {
            tx: None,
            snapshot: None,
            why_not,
        }
    }

    /// The inventory, in the exported snapshot.
    async fn take(&self) -> Result<Inventory, String> {
        match &self.tx {
            Some(tx) => inventory::take(tx).await.inspect_err(|why| {
                tracing::warn!(%why, "no inventory for this dump");
            }),
            None => Err(self.why_not.clone()),
        }
    }

    /// Ends the transaction (read only: nothing to keep).
    async fn end(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.rollback().await;
        }
    }
}

/// The server's version, and the pg_dump to dump it with: the oldest major that dumps it.
async fn pick_pg_dump(
    state: &State,
    endpoint: &Endpoint,
    credentials: &Credentials,
    dbname: &str,
) -> Result<(String, PathBuf), Failure> {
    let session = state.servers.connect(endpoint, credentials, dbname).await?;
    let (server_version_num, server_version) = ddl::server_version(&session).await?;
    drop(session);
    let pg_dumps = state.clients.pg_dumps().await;
    if pg_dumps.is_empty() {
        return Err(Failure::new(
            BackupReason::ClientProgramFailed,
            "no pg_dump answered `--version` (the log says why)",
        ));
    }
    let server_major = u32::try_from(server_version_num / 10000).unwrap_or(0);
    let pg_dump = pg_tools::pick_dump(&pg_dumps, server_major, &server_version)
        .map_err(|refusal| {
            Failure::new(
                backup_reason(refusal.reason, BackupReason::PgDumpTooOld),
                format!("{refusal}: run the backup-controller with one (--pg-dump, --pg-bin-dir)"),
            )
        })?
        .path
        .clone();
    Ok((server_version, pg_dump))
}

/// The recipients of `--backup-recipients-secret`, if given: read from the controllers'
/// namespace's Secrets at each attempt (a changed Secret counts from the next one on).
/// Unreadable keys fail the attempt (retried): an artifact asked to be encrypted is never
/// written in the clear.
fn recipients(state: &State) -> Result<Option<Recipients>, Failure> {
    let Some(name) = &state.recipients_secret else {
        return Ok(None);
    };
    let secret = state.directory.secret(name);
    sealing::keys_from(
        secret.as_deref(),
        name,
        sealing::RECIPIENTS_KEY,
        Recipients::parse,
    )
    .map(Some)
    .map_err(|message| Failure::new(BackupReason::EncryptionKeysInvalid, message))
}

/// The manifest with its `database` (names, server address) and `inventory` (table
/// names and row counts) sealed to `recipients`, if
/// any: `encryption` says how, `sealed` holds it armored; what a restore needs before it
/// decrypts (the checksum, the pg_dump version, the format) stays readable.
fn seal_manifest(
    mut manifest: serde_json::Value,
    recipients: Option<&Recipients>,
) -> Result<serde_json::Value, Failure> {
    let Some(recipients) = recipients else {
        return Ok(manifest);
    };
    let Some(object) = manifest.as_object_mut() else {
        return Ok(manifest);
    };
    let database = object.remove("database").unwrap_or_default();
    let inventory = object.remove("inventory").unwrap_or_default();
    let sealed = serde_json::to_vec(&json!({ "database": database, "inventory": inventory }))
        .map_err(std::io::Error::other)
        .and_then(|plain| recipients.seal_armored(&plain))
        .map_err(|e| {
            Failure::new(
                BackupReason::ManifestFailed,
                format!("encrypting the manifest: {e}"),
            )
        })?;
    object.insert(
        "encryption".into(),
        json!({"format": sealing::FORMAT, "recipients": recipients.public_keys()}),
    );
    object.insert("sealed".into(), json!(sealed));
    Ok(manifest)
}

/// pg_dump of `source` into the artifact of `key` (a temporary name, then committed),
/// sealed to `recipients` if any, with its progress in the status.
async fn dump_into_store(
    state: &State,
    api: &Api<Backup>,
    backup: &Backup,
    key: &ObjectKey,
    pg_dump: &std::path::Path,
    source: &Source<'_>,
    recipients: Option<&Recipients>,
) -> Result<Dumped, Failure> {
    let sealer = recipients
        .map(Recipients::sealer)
        .transpose()
        .map_err(|e| {
            Failure::new(
                BackupReason::EncryptionKeysInvalid,
                format!("encrypting the dump: {e}"),
            )
        })?;
    let location = state.store.location(key);
    let create = state.store.create_artifact(key);
    let mut artifact = traced("create_artifact", location.clone(), create).await?;
    let dumped = dump::run(
        pg_dump,
        source,
        &mut artifact,
        sealer,
        PROGRESS_EVERY,
        |bytes| write::progress(state, api, backup, bytes),
    )
    .await?;
    traced("commit", location, artifact.commit()).await?;
    Ok(dumped)
}

/// The manifest written beside the artifact: what a restore needs, and what the dump
/// saw (`inventory`, or why it could not be taken) for a verification.
#[allow(clippy::too_many_arguments)]
fn manifest(
    backup: &Backup,
    db: &Database,
    server: &Endpoint,
    key: &ObjectKey,
    pg_dump_version: &str,
    done: &Completed,
    started_at: &Time,
    inventory: &Result<Inventory, String>,
) -> serde_json::Value {
    let inventory = match inventory {
        Ok(inventory) => json!(inventory),
        Err(why) => json!({ "error": why }),
    };
    json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "BackupManifest",
        "backup": {
            "namespace": backup.namespace(),
            "name": backup.name_any(),
            "uid": backup.uid(),
        },
        "database": {
            "name": db.name_any(),
            "uid": db.uid(),
            "databaseName": db.database_name(),
            "server": server.key.to_string(),
            "databaseServer": db.spec.server_ref.name,
        },
        "serverVersion": done.server_version,
        "pgDumpVersion": pg_dump_version,
        "format": "custom",
        "artifact": key.artifact(),
        "sizeBytes": done.size_bytes,
        "checksum": done.checksum,
        "checksumAlgorithm": "sha256",
        "startedAt": started_at,
        "completedAt": done.completed_at,
        "inventory": inventory,
    })
}

/// The Database's DatabaseServer: its endpoint and admin credentials, from the caches.
/// Every failure is transient: the platform team fixes the server or its Secrets, and
/// the retries (bounded by `maxRetries`) find it fixed.
async fn server_of(ctx: &Context<State>, db: &Database) -> Result<Resolved, Failure> {
    let directory = &ctx.state.directory;
    let resolved = async {
        directory.synced().await?;
        directory.resolve(&db.spec.server_ref.name)
    };
    resolved.await.map_err(|e| {
        let reason = backup_reason(e.reason(), BackupReason::ServerNotFound);
        Failure::new(reason, e.to_string())
    })
}

/// Renews this replica's hold on attempt `attempt` every [`runner::RENEW_EVERY`]; returns
/// only when the status names another runner or attempt (an API error is retried at
/// the next renewal: the hold lasts [`runner::LEASE`]).
pub async fn hold(state: &State, api: &Api<Backup>, name: &str, identity: &str, attempt: i32) {
    loop {
        tokio::time::sleep(runner::RENEW_EVERY).await;
        match write::renew(state, api, name, identity, attempt).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(
                    attempt,
                    "another replica took attempt {attempt} over; stopping this dump"
                );
                return;
            }
            Err(e) => tracing::warn!(error = %e, "could not renew the hold on the attempt"),
        }
    }
}
