//! The Backup reconcile, as a pipeline of named steps:
//!
//! 1. `cleanup` when the Backup is being deleted: its artifact and manifest leave the
//!    store when `deletionPolicy` is Delete (behind the finalizer);
//! 2. `sync_finalizer`: present exactly when deletion has work outside the cluster;
//! 3. nothing more for a Completed or Failed Backup;
//! 4. `dereference`: the Database (same namespace) must exist (else Failed, at once) and
//!    be Ready (else Pending, `WaitingForDatabase`; its watch brings us back);
//! 5. a dump slot: one of `--max-concurrent-backups`, and the server's only one;
//! 6. `attempt`: status Running (attempts + 1), then credentials, server version,
//!    pg_dump into the store under a temporary name, rename, manifest;
//! 7. the outcome: Completed; a transient failure retried after the shared backoff curve
//!    until `maxRetries` retries are spent; a permanent one Failed at once.
//!
//! A Backup found Running whose runner is this replica restarted, or has stopped renewing
//! its hold (see [`crate::runner`]), was interrupted: it is attempted again, as the next
//! attempt, into the same object key. One held by a live replica is left to it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{
    Backup, BackupDeletionPolicy, BackupPhase, BackupStatus, Database, DatabaseDeletionPolicy,
    condition, marks,
};
use dbops_shared::backoff::Backoff;
use dbops_shared::controller::Context;
use dbops_shared::events::Recorder;
use dbops_shared::memo::Memo;
use dbops_shared::pg_tools;
use dbops_shared::postgres::{ServerKey, Servers, ddl};
use dbops_shared::server::{Directory, Resolved};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::dump::{self, Source};
use crate::error::{Failure, Result};
use crate::runner::{self, Running};
use crate::status::{self, Completed, Guard, Outcome};
use dbops_shared::backup_store::{BackupStore, ObjectKey, traced};

pub const FINALIZER: &str = "dbops.dev/backup-artifact";
/// How often a running dump reports `status.progressBytes`, at most.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(3);
/// How soon a Backup waiting for a dump slot looks again.
const SLOT_POLL: Duration = Duration::from_secs(2);

/// The backup-controller's own state.
pub struct State {
    pub store: BackupStore,
    /// The pg_dump programs (`--pg-dump`, `--pg-bin-dir`): each dump takes the oldest
    /// major that dumps its server.
    pub clients: pg_tools::Clients,
    pub servers: Servers,
    /// DatabaseServers and their admin and CA Secrets (the controllers' namespace only).
    pub directory: Directory,
    pub slots: Slots,
    /// The shared backoff curve (`--backoff-base`, `--backoff-max`), applied to the
    /// attempt count in the status so that it survives restarts.
    pub backoff: Backoff,
    pub recorder: Recorder,
    pub databases: DatabaseIndex,
    pub attempts: Attempts,
    /// This replica, as `status.runner` names it: `$POD_NAME`.
    pub identity: String,
}

/// Dump slots: `--max-concurrent-backups` in all, and one per server.
pub struct Slots {
    global: Arc<Semaphore>,
    per_server: Mutex<HashMap<ServerKey, Arc<Semaphore>>>,
}

/// The two permits a dump holds while it runs.
pub struct Slot {
    _global: OwnedSemaphorePermit,
    _server: OwnedSemaphorePermit,
}

impl Slots {
    pub fn new(max_concurrent: usize) -> Self {
        Self {
            global: Arc::new(Semaphore::new(max_concurrent.max(1))),
            per_server: Mutex::new(HashMap::new()),
        }
    }

    /// Both permits, if both are free now.
    pub fn try_acquire(&self, server: &ServerKey) -> Option<Slot> {
        let per_server = {
            let mut map = self.per_server.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(server.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(1)))
                .clone()
        };
        let server = per_server.try_acquire_owned().ok()?;
        let global = self.global.clone().try_acquire_owned().ok()?;
        Some(Slot {
            _global: global,
            _server: server,
        })
    }
}

/// Which Backups refer to which Database: Backup → `spec.databaseRef`, kept for Backups
/// that are not finished, so a Database event maps to the Backups waiting for it without
/// a scan.
pub type DatabaseIndex = dbops_shared::ref_index::RefIndex;

/// What this process wrote about each Backup's attempts: tells a status from the watch
/// cache that lags behind our own write (ignored) from an attempt left Running by another
/// process (repeated), and holds the time before which a failed attempt is not retried.
#[derive(Default)]
pub struct Attempts {
    written: Memo<Written>,
}

#[derive(Clone, Copy, Debug)]
struct Written {
    attempt: i32,
    phase: BackupPhase,
    retry_at: Option<Instant>,
}

impl Attempts {
    fn wrote(&self, uid: &str, attempt: i32, phase: BackupPhase, retry_at: Option<Instant>) {
        self.written.insert(
            uid,
            Written {
                attempt,
                phase,
                retry_at,
            },
        );
    }

    /// Whether `status` is older than what this process last wrote.
    fn is_stale(&self, uid: &str, status: &BackupStatus) -> bool {
        let seen = status.attempts.unwrap_or(0);
        self.written.is(uid, |w| {
            seen < w.attempt || (seen == w.attempt && status.phase != Some(w.phase))
        })
    }

    /// How long until the failed attempt of `uid` may be retried.
    fn retry_in(&self, uid: &str) -> Option<Duration> {
        self.written
            .get(uid, |w| w.retry_at)??
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    fn forget(&self, uid: &str) {
        self.written.forget(uid);
    }
}

/// The store key of a Backup: from its identity, so retries and restarts overwrite.
pub fn object_key(backup: &Backup) -> ObjectKey {
    ObjectKey::new(
        &backup.namespace().unwrap_or_default(),
        &backup.name_any(),
        &backup.uid().unwrap_or_default(),
    )
}

pub async fn reconcile(backup: Arc<Backup>, ctx: Arc<Context<State>>) -> Result<Action> {
    let namespace = backup.namespace().unwrap_or_default();
    let name = backup.name_any();
    let uid = backup.uid().unwrap_or_default();
    let database = backup.spec.database_ref.name.clone();
    let api: Api<Backup> = Api::namespaced(ctx.client.clone(), &namespace);

    if backup.metadata.deletion_timestamp.is_some() {
        return cleanup(&backup, &ctx, &api).await;
    }
    sync_finalizer(&backup, &api).await?;

    let current = backup.status.clone().unwrap_or_default();
    if matches!(
        current.phase,
        Some(BackupPhase::Completed | BackupPhase::Failed)
    ) {
        ctx.state.databases.forget(&namespace, &name);
        ctx.state.attempts.forget(&uid);
        // A spec change (deletionPolicy, maxRetries) after the end is observed, no more.
        status::observe_generation(&backup, &api).await?;
        return Ok(Action::await_change());
    }
    ctx.state.databases.record(&namespace, &name, &database);
    if ctx.state.attempts.is_stale(&uid, &current) {
        // Our own last write has not reached the watch cache yet.
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    if let Some(wait) = ctx.state.attempts.retry_in(&uid) {
        return Ok(Action::requeue(wait));
    }

    let done = current.attempts.unwrap_or(0);
    let allowed = backup.spec.max_retries.max(0).saturating_add(1);
    if current.phase == Some(BackupPhase::Running) {
        match runner::running(&current, &ctx.state.identity, jiff::Timestamp::now()) {
            Running::HeldBy { identity, for_ } => {
                // Another replica runs it: nothing to write, look again when its hold
                // would run out (its outcome arrives through the watch before that).
                tracing::debug!(runner = %identity, ?for_, "attempt {done} is held by another replica");
                return Ok(Action::requeue(for_ + Duration::from_secs(1)));
            }
            Running::Interrupted => {
                tracing::info!(
                    attempt = done,
                    "attempt {done} was interrupted (its runner stopped); starting over"
                );
                if done >= allowed {
                    let failure = Failure::permanent(
                        "Interrupted",
                        format!("attempt {done} of {allowed} was interrupted and no retry is left"),
                    );
                    return finish(&backup, &ctx, &api, Err(failure), Guard::AsRead).await;
                }
            }
        }
    }

    let db = match dereference(&backup, &ctx).await? {
        Dereferenced::Ready(db) => db,
        Dereferenced::Missing(failure) => {
            return finish(&backup, &ctx, &api, Err(failure), Guard::AsRead).await;
        }
        Dereferenced::NotReady(message) => {
            let waiting = Outcome::Waiting {
                reason: "WaitingForDatabase",
                message,
            };
            if status::publish(&backup, &ctx, &api, &waiting, Guard::AsRead)
                .await?
                .is_none()
            {
                return Ok(Action::requeue(CHANGED_UNDER_US));
            }
            // The Database watch brings the Backup back when it changes.
            return Ok(Action::requeue(ctx.resync_interval));
        }
    };

    let server = match ctx.state.directory.get(&db.spec.server_ref.name) {
        Some(found) => dbops_shared::server::key_of(&found),
        // Not found: the attempt reports it (ServerNotFound), under this name's slot.
        None => ServerKey {
            host: db.spec.server_ref.name.clone(),
            port: 0,
        },
    };
    let Some(slot) = ctx.state.slots.try_acquire(&server) else {
        let waiting = Outcome::Waiting {
            reason: "WaitingForSlot",
            message: format!(
                "waiting for a free dump slot (one dump per server at a time; {server} is busy or all slots are in use)"
            ),
        };
        status::publish(&backup, &ctx, &api, &waiting, Guard::AsRead).await?;
        return Ok(Action::requeue(SLOT_POLL));
    };

    let attempt = done + 1;
    let started_at = dbops_shared::conditions::now();
    let identity = ctx.state.identity.as_str();
    let running = Outcome::Running {
        attempt,
        of: allowed,
        started_at: started_at.clone(),
        what: format!("pg_dump of database {} on {server}", db.database_name()),
        runner: identity,
    };
    // The claim: written only over the Backup as read, so that of two replicas that saw
    // it Pending one starts the attempt and the other gets a conflict.
    let Some(claimed) = status::publish(&backup, &ctx, &api, &running, Guard::AsRead).await? else {
        tracing::debug!("another replica changed the Backup first; not starting an attempt");
        return Ok(Action::requeue(CHANGED_UNDER_US));
    };
    let mut latest = (*backup).clone();
    latest.status = Some(claimed);
    ctx.state
        .attempts
        .wrote(&uid, attempt, BackupPhase::Running, None);
    let as_runner = Guard::Runner { identity, attempt };
    let outcome = tokio::select! {
        outcome = run_attempt(&latest, &db, &ctx, &api, &started_at) => Some(outcome),
        () = hold(&api, &name, identity, attempt) => None,
    };
    let action = match outcome {
        Some(outcome) => finish(&latest, &ctx, &api, outcome, as_runner).await,
        None => {
            // The dump (and pg_dump with it) was dropped: the attempt is another's now.
            ctx.state.attempts.forget(&uid);
            Ok(Action::requeue(runner::LEASE))
        }
    };
    // Only now: the next dump on this server must not show Running beside this one.
    drop(slot);
    action
}

/// How soon a reconcile whose guarded write met a newer version looks again (the watch
/// usually brings that version sooner).
const CHANGED_UNDER_US: Duration = Duration::from_secs(1);

/// Renews this replica's hold on attempt `attempt` every [`runner::RENEW_EVERY`]; returns
/// only when the status names another runner or attempt (an API error is retried at
/// the next renewal: the hold lasts [`runner::LEASE`]).
async fn hold(api: &Api<Backup>, name: &str, identity: &str, attempt: i32) {
    loop {
        tokio::time::sleep(runner::RENEW_EVERY).await;
        match status::renew(api, name, identity, attempt).await {
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

/// Publishes the end of an attempt (or of a Backup that cannot start): Completed, a retry
/// after the backoff, or Failed, as `guard` allows. `latest` carries the status as last
/// written.
async fn finish(
    latest: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    outcome: std::result::Result<Completed, Failure>,
    guard: Guard<'_>,
) -> Result<Action> {
    let backup = latest;
    let uid = backup.uid().unwrap_or_default();
    let allowed = backup.spec.max_retries.max(0).saturating_add(1);
    let attempt = match guard {
        Guard::Runner { attempt, .. } => attempt,
        Guard::AsRead => backup.status.as_ref().and_then(|s| s.attempts).unwrap_or(0),
    };
    let lost = || {
        tracing::info!(
            attempt,
            "the Backup changed under this outcome (another replica); leaving it to that"
        );
        Ok(Action::requeue(CHANGED_UNDER_US))
    };
    match outcome {
        Ok(done) => {
            let Some(_) =
                status::publish(latest, ctx, api, &Outcome::Completed(&done), guard).await?
            else {
                return lost();
            };
            // Partial files of interrupted attempts of this key.
            discard_partial(backup, ctx).await;
            if let Some(metrics) = ctx.metrics.backup() {
                let started = backup.status.as_ref().and_then(|s| s.started_at.as_ref());
                let seconds = started.map_or(0.0, |s| {
                    done.completed_at
                        .0
                        .duration_since(s.0)
                        .as_secs_f64()
                        .max(0.0)
                });
                metrics.record_completed(
                    &backup.namespace().unwrap_or_default(),
                    &backup.spec.database_ref.name,
                    u64::try_from(done.size_bytes).unwrap_or(0),
                    seconds,
                    done.completed_at.0.as_second(),
                );
            }
            ctx.state
                .attempts
                .wrote(&uid, attempt, BackupPhase::Completed, None);
            Ok(Action::await_change())
        }
        Err(failure) if failure.permanent || attempt >= allowed => {
            tracing::warn!(
                reason = failure.reason,
                "Backup failed: {}",
                failure.message
            );
            let Some(_) =
                status::publish(latest, ctx, api, &Outcome::Failed(&failure), guard).await?
            else {
                return lost();
            };
            discard_partial(backup, ctx).await;
            ctx.state
                .attempts
                .wrote(&uid, attempt, BackupPhase::Failed, None);
            Ok(Action::await_change())
        }
        Err(failure) => {
            let retry_in = ctx
                .state
                .backoff
                .jittered_delay(u32::try_from(attempt - 1).unwrap_or(0));
            tracing::info!(
                reason = failure.reason,
                attempt,
                ?retry_in,
                "attempt failed; retrying: {}",
                failure.message
            );
            let retrying = Outcome::Retrying {
                failure: &failure,
                attempt,
                of: allowed,
                retry_in,
            };
            let Some(_) = status::publish(latest, ctx, api, &retrying, guard).await? else {
                return lost();
            };
            ctx.state.attempts.wrote(
                &uid,
                attempt,
                BackupPhase::Pending,
                Some(Instant::now() + retry_in),
            );
            Ok(Action::requeue(retry_in))
        }
    }
}

async fn discard_partial(backup: &Backup, ctx: &Context<State>) {
    let (store, key) = (&ctx.state.store, object_key(backup));
    let discarded = traced(
        "discard_partial",
        store.location(&key),
        store.discard_partial(&key),
    );
    if let Err(e) = discarded.await {
        tracing::warn!(error = %e, "could not remove a partial artifact");
    }
}

/// What became of the Database a Backup refers to.
enum Dereferenced {
    Ready(Box<Database>),
    /// It does not exist: the Backup fails at once.
    Missing(Failure),
    /// It exists and is not Ready: the Backup waits.
    NotReady(String),
}

/// The Database to back up (same namespace), if it exists and is Ready.
async fn dereference(backup: &Backup, ctx: &Context<State>) -> Result<Dereferenced> {
    let namespace = backup.namespace().unwrap_or_default();
    let name = &backup.spec.database_ref.name;
    let databases: Api<Database> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(db) = databases.get_opt(name).await? else {
        return Ok(Dereferenced::Missing(Failure::permanent(
            "DatabaseNotFound",
            format!("Database {namespace}/{name} does not exist"),
        )));
    };
    if let Some(wanted) = backup.annotations().get(marks::DATABASE_UID)
        && db.uid().as_ref() != Some(wanted)
    {
        return Ok(Dereferenced::Missing(Failure::permanent(
            "DatabaseReplaced",
            format!(
                "Backup is for the Database {namespace}/{name} with UID {wanted}, but the Database of that name now has UID {}: it was deleted and created again, and is not dumped in its place",
                db.uid().unwrap_or_default()
            ),
        )));
    }
    let final_snapshot = db
        .uid()
        .is_some_and(|uid| backup.labels().get(dbops_api::marks::FINAL_SNAPSHOT_OF) == Some(&uid));
    Ok(if can_be_dumped(&db, final_snapshot) {
        Dereferenced::Ready(Box::new(db))
    } else {
        Dereferenced::NotReady(format!(
            "waiting for Database {namespace}/{name} to be Ready"
        ))
    })
}

/// Whether the Database's database exists in PostgreSQL for pg_dump: it is Ready, or it
/// is being deleted with `deletionPolicy: Snapshot` (its controller reports
/// Ready=False/Deleting then, and keeps the database until the final Backup is Ready)
/// after it was provisioned, or at all when this Backup is its final snapshot: the
/// database-controller asks for one only when the server holds a whole database of that
/// Database's, even one whose provisioning it never recorded.
fn can_be_dumped(db: &Database, final_snapshot: bool) -> bool {
    let Some(status) = db.status.as_ref() else {
        return false;
    };
    let ready = dbops_shared::conditions::is_true(&status.conditions, condition::READY);
    let awaiting_final_snapshot = db.metadata.deletion_timestamp.is_some()
        && db.spec.deletion_policy == DatabaseDeletionPolicy::Snapshot
        && (status.provider_id.is_some() || final_snapshot);
    ready || awaiting_final_snapshot
}

/// One attempt: credentials, server version, the dump into the store, the manifest.
async fn run_attempt(
    backup: &Backup,
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Backup>,
    started_at: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> std::result::Result<Completed, Failure> {
    let state = &ctx.state;
    let key = object_key(backup);
    let Resolved {
        endpoint,
        credentials,
        ..
    } = server_of(ctx, db).await?;
    let dbname = db.database_name();

    let session = state
        .servers
        .connect(&endpoint, &credentials, &dbname)
        .await?;
    let (server_version_num, server_version) = ddl::server_version(&session).await?;
    drop(session);
    let pg_dumps = state.clients.pg_dumps().await;
    if pg_dumps.is_empty() {
        return Err(Failure::transient(
            "ClientProgramFailed",
            "no pg_dump answered `--version` (the log says why)",
        ));
    }
    let server_major = u32::try_from(server_version_num / 10000).unwrap_or(0);
    let pg_dump = pg_tools::pick_dump(&pg_dumps, server_major, &server_version)
        .map_err(|refusal| {
            Failure::permanent(
                refusal.reason,
                format!("{refusal}: run the backup-controller with one (--pg-dump, --pg-bin-dir)"),
            )
        })?
        .path
        .clone();
    let pg_dump_version = dump::pg_dump_version(&pg_dump).await?;

    let location = state.store.location(&key);
    let create = state.store.create_artifact(&key);
    let mut artifact = traced("create_artifact", location.clone(), create).await?;
    let source = Source {
        server: &endpoint,
        credentials: &credentials,
        database: &dbname,
        lock_wait: state.servers.lock_timeout(),
    };
    let (name, uid) = (backup.name_any(), backup.uid().unwrap_or_default());
    let dumped = dump::run(&pg_dump, &source, &mut artifact, PROGRESS_EVERY, |bytes| {
        status::progress(api, &name, &uid, bytes)
    })
    .await?;
    traced("commit", location.clone(), artifact.commit()).await?;

    let completed_at = dbops_shared::conditions::now();
    let manifest = json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "BackupManifest",
        "backup": {
            "namespace": backup.namespace(),
            "name": name,
            "uid": backup.uid(),
        },
        "database": {
            "name": db.name_any(),
            "uid": db.uid(),
            "databaseName": dbname,
            "server": endpoint.key.to_string(),
            "databaseServer": db.spec.server_ref.name,
        },
        "serverVersion": server_version,
        "pgDumpVersion": pg_dump_version,
        "format": "custom",
        "artifact": key.artifact(),
        "sizeBytes": dumped.size_bytes,
        "checksum": dumped.sha256,
        "checksumAlgorithm": "sha256",
        "startedAt": started_at,
        "completedAt": completed_at,
    });
    let body = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Failure::transient("ManifestFailed", format!("encoding the manifest: {e}")))?;
    traced(
        "put_manifest",
        location,
        state.store.put_manifest(&key, &body),
    )
    .await?;
    tracing::info!(
        size_bytes = dumped.size_bytes,
        checksum = %dumped.sha256,
        "backup completed"
    );
    Ok(Completed {
        location: state.store.location(&key),
        size_bytes: i64::try_from(dumped.size_bytes).unwrap_or(i64::MAX),
        checksum: dumped.sha256,
        server_version,
        completed_at,
        database_uid: db.uid().unwrap_or_default(),
    })
}

/// The Database's DatabaseServer: its endpoint and admin credentials, from the caches.
/// Every failure is transient: the platform team fixes the server or its Secrets, and
/// the retries (bounded by `maxRetries`) find it fixed.
async fn server_of(ctx: &Context<State>, db: &Database) -> std::result::Result<Resolved, Failure> {
    let directory = &ctx.state.directory;
    let resolved = async {
        directory.synced().await?;
        directory.resolve(&db.spec.server_ref.name)
    };
    resolved
        .await
        .map_err(|e| Failure::transient(e.reason(), e.to_string()))
}

fn wants_finalizer(backup: &Backup) -> bool {
    backup.spec.deletion_policy == BackupDeletionPolicy::Delete
}

fn has_finalizer(backup: &Backup) -> bool {
    backup.finalizers().iter().any(|f| f == FINALIZER)
}

/// The finalizer is there exactly when deleting the Backup must remove its artifact.
async fn sync_finalizer(backup: &Backup, api: &Api<Backup>) -> Result<()> {
    let want = wants_finalizer(backup);
    Ok(dbops_shared::finalizer::set(backup, api, FINALIZER, want).await?)
}

/// Deletion: the artifact and manifest go when the policy says Delete (already gone is
/// fine), then the finalizer.
async fn cleanup(backup: &Backup, ctx: &Context<State>, api: &Api<Backup>) -> Result<Action> {
    let namespace = backup.namespace().unwrap_or_default();
    ctx.state.databases.forget(&namespace, &backup.name_any());
    ctx.state.attempts.forget(&backup.uid().unwrap_or_default());
    if !has_finalizer(backup) {
        return Ok(Action::await_change());
    }
    let key = object_key(backup);
    if wants_finalizer(backup) {
        let store = &ctx.state.store;
        traced("delete", store.location(&key), store.delete(&key)).await?;
        status::publish_event(
            ctx,
            backup,
            true,
            "ArtifactDeleted",
            &format!(
                "removed {} and its manifest",
                ctx.state.store.location(&key)
            ),
        )
        .await;
    }
    dbops_shared::finalizer::set(backup, api, FINALIZER, false).await?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(attempts: i32, phase: BackupPhase) -> BackupStatus {
        BackupStatus {
            attempts: Some(attempts),
            phase: Some(phase),
            ..BackupStatus::default()
        }
    }

    #[test]
    fn a_lagging_cache_is_told_from_an_interrupted_attempt() {
        let attempts = Attempts::default();
        // Another process's attempt left Running: not ours, so not stale.
        assert!(!attempts.is_stale("u", &status(1, BackupPhase::Running)));
        attempts.wrote("u", 2, BackupPhase::Completed, None);
        assert!(attempts.is_stale("u", &status(2, BackupPhase::Running)));
        assert!(attempts.is_stale("u", &status(1, BackupPhase::Pending)));
        assert!(!attempts.is_stale("u", &status(2, BackupPhase::Completed)));
    }

    #[test]
    fn one_dump_per_server_and_a_global_limit() {
        let slots = Slots::new(2);
        let a = ServerKey {
            host: "a".into(),
            port: 5432,
        };
        let b = ServerKey {
            host: "b".into(),
            port: 5432,
        };
        let c = ServerKey {
            host: "c".into(),
            port: 5432,
        };
        let first = slots.try_acquire(&a).unwrap();
        assert!(slots.try_acquire(&a).is_none(), "one dump per server");
        let _second = slots.try_acquire(&b).unwrap();
        assert!(slots.try_acquire(&c).is_none(), "two in all");
        drop(first);
        assert!(slots.try_acquire(&c).is_some());
    }

    fn database(policy: &str, deleting: bool, ready: &str, provisioned: bool) -> Database {
        let mut db: Database = serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "ns"},
            "spec": {"serverRef": {"name": "pg"}, "deletionPolicy": policy},
            "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "X",
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        }))
        .unwrap();
        if deleting {
            db.metadata.deletion_timestamp = Some(dbops_shared::conditions::now());
        }
        if provisioned && let Some(s) = db.status.as_mut() {
            s.provider_id = Some("h:5432/1".into());
        }
        db
    }

    #[test]
    fn a_ready_database_or_one_awaiting_its_final_snapshot_can_be_dumped() {
        assert!(can_be_dumped(
            &database("Retain", false, "True", true),
            false
        ));
        assert!(!can_be_dumped(
            &database("Retain", false, "False", true),
            false
        ));
        assert!(can_be_dumped(
            &database("Snapshot", true, "False", true),
            false
        ));
        assert!(!can_be_dumped(
            &database("Snapshot", true, "False", false),
            false
        ));
        assert!(!can_be_dumped(
            &database("Delete", true, "False", true),
            false
        ));
        // Its final snapshot is dumped even when its provisioning was never recorded (the
        // database-controller asks for one only when the database is whole)...
        assert!(can_be_dumped(
            &database("Snapshot", true, "False", false),
            true
        ));
        // ...and only while it is being deleted with that policy.
        assert!(!can_be_dumped(
            &database("Snapshot", false, "False", false),
            true
        ));
        assert!(!can_be_dumped(
            &database("Delete", true, "False", false),
            true
        ));
    }

    #[test]
    fn the_index_maps_a_database_to_its_unfinished_backups() {
        let index = DatabaseIndex::default();
        index.record("ns", "b1", "orders");
        index.record("ns", "b2", "orders");
        index.record("other", "b3", "orders");
        let mut of = index.referrers_of("ns", "orders");
        of.sort();
        assert_eq!(of, ["b1", "b2"]);
        index.forget("ns", "b1");
        index.forget("ns", "b2");
        assert!(index.referrers_of("ns", "orders").is_empty());
    }
}
