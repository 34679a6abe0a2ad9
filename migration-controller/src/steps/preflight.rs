//! The saga's steps and their compensations, one small function each. Every step checks
//! what already exists before it acts, so running it again after a crash at any line
//! repeats no side effect; whatever a compensation must know is in the status, written
//! before the step acted.
//!
//! The Dump mode's steps (the Logical mode's Replicate and CatchUp are in `replicate`; it
//! shares the others, FreezeSource sparing the subscription's WAL sender, Cleanup taking
//! the replication down once more):
//!
//! | step | does | compensation |
//! |---|---|---|
//! | Preflight | records the source (the Database's `spec.serverRef`); refuses a target DatabaseServer that does not exist, is being deleted, does not allow the namespace, is the source (by name or `host:port`) or would exceed its `databasesPerNamespace`; reads both servers: reachable, target major ≥ source, extensions available, no foreign role/database of those names on the target; chooses the mode once (`Auto`: Logical when the Logical Preflight of `logical` passes, else Dump with the reason in the ModeChosen condition and an Event; `Logical`: refused with that reason) | none (read only) |
//! | Snapshot | Backup `<migration>-snapshot`, owned by the Migration; waits for it | none: the Backup stays as the rollback point |
//! | FreezeSource | records the connection limit and `default_transaction_read_only`, then sets them to 0 and on and ends every session | restores the recorded values |
//! | ProvisionTarget | role (a password nobody knows: the database-controller sets the connection Secret's when the Database arrives) and database on the target, marked with this Migration, and the source's extensions | drops the role and database if they carry this Migration's mark |
//! | CopyData | `pg_dump` of the frozen source piped into `pg_restore` on the target, in one transaction | none of its own: the data is in the target database |
//! | Verify | the same tables, with the same row counts, on both | none (read only) |
//! | SwitchTraffic | patches the Database's `spec.serverRef` to the target (field manager `dbops-migration-controller`), waits until it is Ready at the new generation | none: the point of no return |
//! | Cleanup | `sourceRetention: Drop` drops the source database and role (if marked by the Database) | none |
//!
//! Servers are DatabaseServers, resolved from the caches of `dbops_shared::server` at
//! each step (address, TLS and the admin credentials of the controllers' namespace): the
//! source as Preflight recorded it, the target from `spec.target.serverRef`.

use std::sync::Arc;
use std::time::Duration;

use dbops_api::{
    Backup, BackupPhase, ChosenMode, Database, DatabaseServer, MigrationMode, MigrationStep,
    ServerReference, SourceRetention, condition,
};
use dbops_shared::pg_tools;
use dbops_shared::postgres::{PgError, Session, extensions};
use dbops_shared::server::{Resolved, ServerError};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::copy::{self, Programs, Side};
use crate::error::{Error, Result};
use crate::replicate;
use crate::saga::{FIELD_MANAGER, Saga};
use crate::sql;
use dbops_shared::controller::ReconcileError;

/// What a step's run came to.
#[derive(Debug)]
pub enum Outcome {
    /// Its effects are complete; the message goes into the step's record and an Event.
    Done(String),
    /// It waits for another object (a watch brings the reconcile back).
    Wait(String),
    /// It waits for a server (the replication's progress): run again after this long
    /// (at most the resync interval).
    Poll(String, Duration),
}

/// Label on the snapshot Backup: the Migration it belongs to.
pub const SNAPSHOT_LABEL: &str = "dbops.dev/migration";

pub async fn run(saga: &mut Saga<'_>, step: MigrationStep, db: &Database) -> Result<Outcome> {
    match step {
        MigrationStep::Preflight => preflight(saga, db).await,
        MigrationStep::Snapshot => snapshot(saga, db).await,
        MigrationStep::FreezeSource => freeze_source(saga, db).await,
        MigrationStep::ProvisionTarget => provision_target(saga, db).await,
        MigrationStep::CopyData => copy_data(saga, db).await,
        MigrationStep::Replicate => replicate::replicate(saga, db).await,
        MigrationStep::CatchUp => replicate::catch_up(saga, db).await,
        MigrationStep::Verify => verify(saga, db).await,
        MigrationStep::SwitchTraffic => switch_traffic(saga, db).await,
        MigrationStep::Cleanup => cleanup(saga, Some(db)).await.map(Outcome::Done),
    }
}

/// Undoes the step's effects (idempotent); returns what was done.
pub async fn compensate(
    saga: &mut Saga<'_>,
    step: MigrationStep,
    db: Option<&Database>,
) -> Result<String> {
    match step {
        MigrationStep::Preflight => Ok("nothing to undo: Preflight only reads".into()),
        MigrationStep::Snapshot => Ok(match saga.status().snapshot_ref {
            Some(r) => format!("snapshot Backup {} kept as the rollback point", r.name),
            None => "no snapshot was taken".into(),
        }),
        MigrationStep::FreezeSource => unfreeze_source(saga, db).await,
        MigrationStep::ProvisionTarget => clean_target(saga, db).await,
        MigrationStep::CopyData => Ok(
            "nothing of its own to undo: the copy is in the target database, which the compensation of ProvisionTarget drops"
                .into(),
        ),
        MigrationStep::Replicate | MigrationStep::CatchUp => {
            let (database, _) = names(saga, db)?;
            replicate::teardown(saga, &database).await
        }
        MigrationStep::Verify => Ok("nothing to undo: Verify only reads".into()),
        MigrationStep::SwitchTraffic | MigrationStep::Cleanup => {
            Ok("nothing to undo: the step never ran".into())
        }
    }
}

// ---- helpers -------------------------------------------------------------------------

/// How long Preflight waits for the cache of Databases to fill after the process starts.
const DATABASES_SYNC_WAIT: Duration = Duration::from_secs(30);

/// The DatabaseServer `server` from the caches (once they have synced): its address, TLS
/// and admin credentials (a Secret of the controllers' namespace, never the Migration's).
pub(crate) async fn resolve(saga: &Saga<'_>, server: &ServerReference) -> Result<Resolved> {
    let directory = &saga.ctx.state.directory;
    directory.synced().await?;
    Ok(directory.resolve(&server.name)?)
}

/// An admin session on `server`, connected to the database `dbname`.
pub(crate) async fn session(saga: &Saga<'_>, server: &Resolved, dbname: &str) -> Result<Session> {
    Ok(saga
        .ctx
        .state
        .servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}

/// The source DatabaseServer recorded by Preflight.
pub(crate) fn source_ref(saga: &Saga<'_>) -> Result<ServerReference> {
    saga.status().source_server.ok_or_else(|| {
        Error::transient("SourceNotRecorded", "Preflight has not recorded the source")
    })
}

/// The source DatabaseServer recorded by Preflight, resolved.
pub(crate) async fn source_server(saga: &Saga<'_>) -> Result<Resolved> {
    resolve(saga, &source_ref(saga)?).await
}

/// The target DatabaseServer (`spec.target.serverRef`), resolved.
pub(crate) async fn target_server(saga: &Saga<'_>) -> Result<Resolved> {
    resolve(saga, &saga.m.spec.target.server_ref).await
}

pub(crate) fn database_uid(saga: &Saga<'_>) -> Result<String> {
    saga.status().database_uid.ok_or_else(|| {
        Error::transient(
            "SourceNotRecorded",
            "Preflight has not recorded the Database",
        )
    })
}

/// The database and owner role names in PostgreSQL: as Preflight recorded them, or from
/// the Database (a Migration that recorded none yet).
pub(crate) fn names(saga: &Saga<'_>, db: Option<&Database>) -> Result<(String, String)> {
    let status = saga.status();
    match (status.database_name, status.owner_role, db) {
        (Some(database), Some(role), _) => Ok((database, role)),
        (_, _, Some(db)) => Ok((db.database_name(), db.owner_role())),
        _ => Err(Error::transient(
            "DatabaseNotFound",
            "the Database is gone and Preflight recorded no names",
        )),
    }
}

pub(crate) fn migration_uid(saga: &Saga<'_>) -> String {
    saga.m.uid().unwrap_or_default()
}

/// A server in messages: `<DatabaseServer> (<host>:<port>)`.
pub(crate) fn at(server: &Resolved) -> String {
    format!("{} ({})", server.name, server.endpoint.key)
}

/// Errors that retrying Preflight cannot cure end it at once: refused credentials or
/// TLS, and a DatabaseServer that cannot be used (not found, being deleted, namespace not
/// allowed, admin or CA Secret missing or invalid). Caches not synced yet are retried.
fn preflight_error(e: Error) -> Error {
    match e {
        Error::Postgres(PgError::AuthenticationFailed { .. })
        | Error::Postgres(PgError::Tls { .. }) => {
            let reason = e.reason();
            Error::fatal(reason, e.to_string())
        }
        Error::Server(e) if !e.is_transient() => Error::fatal(e.reason(), e.to_string()),
        e => e,
    }
}

pub(crate) fn major(version_num: i32) -> i32 {
    version_num / 10000
}

// ---- Preflight -----------------------------------------------------------------------

async fn preflight(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    if db.metadata.deletion_timestamp.is_some() {
        return Err(Error::fatal(
            "DatabaseDeleting",
            format!("Database {} is being deleted", db.name_any()),
        ));
    }
    let ready = db
        .status
        .as_ref()
        .is_some_and(|s| dbops_shared::conditions::is_true(&s.conditions, condition::READY));
    if !ready {
        return Ok(Outcome::Wait(format!(
            "waiting for Database {} to be Ready",
            db.name_any()
        )));
    }
    let mut status = saga.status();
    if status.source_server.is_none()
        || status.database_uid.is_none()
        || status.database_name.is_none()
        || status.owner_role.is_none()
    {
        status.source_server = Some(db.spec.server_ref.clone());
        status.database_uid = db.uid();
        status.database_name = Some(db.database_name());
        status.owner_role = Some(db.owner_role());
        saga.save(status).await?;
    }
    preflight_checks(saga, db).await.map_err(preflight_error)
}

async fn preflight_checks(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let source_ref = source_ref(saga)?;
    if source_ref == saga.m.spec.target.server_ref {
        return Err(Error::fatal(
            "TargetIsSource",
            format!(
                "the target DatabaseServer {} is the one the Database is on",
                source_ref.name
            ),
        ));
    }
    let target = admitted_target(saga, db).await?;
    let source = resolve(saga, &source_ref).await?;
    if source.endpoint.key == target.endpoint.key {
        return Err(Error::fatal(
            "TargetIsSource",
            format!(
                "the target {} is the server the Database is on ({})",
                at(&target),
                at(&source)
            ),
        ));
    }
    let uid = database_uid(saga)?;
    let (database, role) = (db.database_name(), db.owner_role());

    let s = session(saga, &source, "postgres").await?;
    let (source_num, source_version) = sql::server_version(&s).await?;
    let found = sql::observe(&s, &role, &database).await?.database;
    drop(s);
    if !found.is_some_and(|d| sql::is_databases(d.comment.as_deref(), &uid)) {
        return Err(Error::fatal(
            "SourceNotFound",
            format!(
                "database {database:?} on {} does not exist or was not created by this Database",
                at(&source)
            ),
        ));
    }
    let s = session(saga, &source, &database).await?;
    let extensions = sql::installed_extensions(&s).await?;
    drop(s);

    let t = session(saga, &target, "postgres").await?;
    let (target_num, target_version) = sql::server_version(&t).await?;
    if major(target_num) < major(source_num) {
        return Err(Error::fatal(
            "TargetVersionTooOld",
            format!(
                "the target runs PostgreSQL {target_version}, older than the source's {source_version}"
            ),
        ));
    }
    // Every extension of the source database must be allowed on the target too (its
    // allowedExtensions, or trusted when it has none) and available there.
    let offered = extensions::available(&t, &extensions).await?;
    let allowed = target.server.spec.allowed_extensions.as_deref();
    if let Some(refused) = extensions::refusal(&extensions, allowed, &offered, &target.name) {
        return Err(Error::fatal(
            refused.reason,
            format!(
                "the database uses extensions the target does not take: {}",
                refused.message
            ),
        ));
    }
    let muid = migration_uid(saga);
    let found = sql::observe(&t, &role, &database).await?;
    let ours = |comment: Option<&str>| sql::is_migrations(comment, &uid, &muid);
    if found.database.is_some_and(|d| !ours(d.comment.as_deref())) {
        return Err(Error::fatal(
            "NameConflict",
            format!(
                "a database {database:?} already exists on {} and was not created by this Migration; nothing was changed",
                at(&target)
            ),
        ));
    }
    if found.role.is_some_and(|r| !ours(r.comment.as_deref())) {
        return Err(Error::fatal(
            "NameConflict",
            format!(
                "a role {role:?} already exists on {} and was not created by this Migration; nothing was changed",
                at(&target)
            ),
        ));
    }
    drop(t);
    let mode = choose_mode(saga, &source, &database, (target_num, &target_version)).await?;
    let (pg_dump, pg_restore) = copy_programs(
        saga,
        (source_num, &source_version),
        (target_num, &target_version),
        // The Logical mode's schema copy picks from every program too: pg_restore 17+
        // cannot restore into a server older than 17.
        true,
    )
    .await
    .map_err(|e| match e {
        Error::Fatal { reason, message } => {
            Error::fatal(reason, format!("{message}; nothing was changed"))
        }
        e => e,
    })?;
    Ok(Outcome::Done(format!(
        "source PostgreSQL {source_version} on {}, target PostgreSQL {target_version} on {}; extensions {extensions:?} available; no role or database {database:?} on the target; mode {mode:?}, copying with pg_dump {} and pg_restore {}",
        at(&source),
        at(&target),
        pg_dump.version.version,
        pg_restore.version.version
    )))
}

/// The pg_dump and pg_restore that copy from a server of `source` (`server_version_num`,
/// `server_version`) to one of `target` (`pg_tools::pick_copy`): of every program (`all`,
/// the Dump mode's CopyData), or of `--pg-dump` and `--pg-restore` only (the Logical
/// mode's schema copy). None fitting is fatal, naming the versions.
pub(crate) async fn copy_programs(
    saga: &Saga<'_>,
    source: (i32, &str),
    target: (i32, &str),
    all: bool,
) -> Result<(pg_tools::Program, pg_tools::Program)> {
    let state = &saga.ctx.state;
    let clients = if all {
        state.clients.clone()
    } else {
        pg_tools::Clients::new(
            Some(state.pg_dump.clone()),
            Some(state.pg_restore.clone()),
            &[],
        )
    };
    let (dumps, restores) = (clients.pg_dumps().await, clients.pg_restores().await);
    if dumps.is_empty() || restores.is_empty() {
        return Err(Error::transient(
            "ClientProgramFailed",
            "no pg_dump or no pg_restore answered `--version` (the log says why)",
        ));
    }
    let major = |num: i32| u32::try_from(major(num)).unwrap_or(0);
    pg_tools::pick_copy(
        &dumps,
        &restores,
        (major(source.0), source.1),
        (major(target.0), target.1),
    )
    .map(|(dump, restore)| (dump.clone(), restore.clone()))
    .map_err(|refusal| refused(refusal, all))
}

/// No client programs fit: fatal (retrying cannot help), saying which flags give others.
fn refused(refusal: pg_tools::Refusal, all: bool) -> Error {
    let flags = if all {
        "--pg-dump, --pg-restore, --pg-bin-dir"
    } else {
        "--pg-dump, --pg-restore: the Logical mode's schema copy"
    };
    Error::fatal(
        refusal.reason,
        format!("{refusal}: run the migration-controller with one ({flags})"),
    )
}

/// The mode the Migration runs in: recorded once (with the ModeChosen condition and an
/// Event) and never changed afterwards. `Logical` refuses a source that cannot replicate
/// (the Logical Preflight's reason); `Auto` then falls back to Dump, saying why.
async fn choose_mode(
    saga: &mut Saga<'_>,
    source: &Resolved,
    database: &str,
    (target_num, target_version): (i32, &str),
) -> Result<ChosenMode> {
    if let Some(mode) = saga.status().mode {
        return Ok(mode);
    }
    let (mode, reason, message) = match saga.m.spec.mode {
        MigrationMode::Dump => (
            ChosenMode::Dump,
            "DumpRequested",
            "mode Dump: the source is frozen for the whole copy".to_string(),
        ),
        requested => {
            let s = session(saga, source, database).await?;
            let unmet = crate::logical::preflight(&s, target_num, target_version).await?;
            drop(s);
            match crate::logical::auto_mode(unmet) {
                crate::logical::Mode::Logical => (
                    ChosenMode::Logical,
                    "LogicalPossible",
                    format!(
                        "mode {requested:?}: the source can replicate logically; it stays writable until a short freeze for the final catch-up"
                    ),
                ),
                crate::logical::Mode::Dump { because } => {
                    let (reason, why) = crate::logical::condition(&because)
                        .unwrap_or(("LogicalNotPossible", String::new()));
                    if requested == MigrationMode::Logical {
                        return Err(Error::fatal(
                            reason,
                            format!("mode Logical is not possible on {}: {why}", at(source)),
                        ));
                    }
                    (
                        ChosenMode::Dump,
                        reason,
                        format!(
                            "mode Auto chose Dump (the source is frozen for the whole copy) because logical replication is not possible on {}: {why}",
                            at(source)
                        ),
                    )
                }
            }
        }
    };
    let mut status = saga.status();
    crate::progress::choose_mode(&mut status, mode);
    dbops_shared::conditions::set_condition(
        &mut status.conditions,
        dbops_shared::conditions::ConditionSpec {
            type_: crate::progress::MODE_CHOSEN,
            status: dbops_shared::conditions::ConditionStatus::from(mode == ChosenMode::Logical),
            reason,
            message: message.clone(),
            observed_generation: saga.m.metadata.generation,
        },
        dbops_shared::conditions::now(),
    );
    saga.save(status).await?;
    let fallback = saga.m.spec.mode == MigrationMode::Auto && mode == ChosenMode::Dump;
    let event = match mode {
        ChosenMode::Logical => "LogicalModeChosen",
        ChosenMode::Dump => "DumpModeChosen",
    };
    saga.event(!fallback, event, &message).await;
    Ok(mode)
}

/// The target DatabaseServer, resolved, if the Database may move there: it exists (and
/// this installation serves it), is not being deleted, allows the Migration's namespace
/// and has room under its `databasesPerNamespace` limit. Checked before anything is
/// touched; a refusal ends Preflight at once (`preflight_error`).
async fn admitted_target(saga: &Saga<'_>, db: &Database) -> Result<Resolved> {
    let directory = &saga.ctx.state.directory;
    directory.synced().await?;
    let name = &saga.m.spec.target.server_ref.name;
    let server = directory
        .get(name)
        .ok_or_else(|| ServerError::NotFound(name.clone()))?;
    if server.metadata.deletion_timestamp.is_some() {
        return Err(ServerError::Deleting(name.clone()).into());
    }
    directory.admits(&server, &saga.namespace)?;
    check_quota(saga, db, &server).await?;
    Ok(directory.resolve_server(server)?)
}

/// Refuses (`QuotaExceeded`) a move that would put more Databases of the Migration's
/// namespace on `server` than its `limits.databasesPerNamespace`.
async fn check_quota(saga: &Saga<'_>, db: &Database, server: &DatabaseServer) -> Result<()> {
    let Some(limit) = server
        .spec
        .limits
        .as_ref()
        .and_then(|l| l.databases_per_namespace)
    else {
        return Ok(());
    };
    let store = &saga.ctx.state.databases;
    if !matches!(
        tokio::time::timeout(DATABASES_SYNC_WAIT, store.wait_until_ready()).await,
        Ok(Ok(()))
    ) {
        return Err(Error::transient(
            "CacheNotSynced",
            "the cache of Databases has not synced yet",
        ));
    }
    let name = server.name_any();
    let there = databases_on(&store.state(), &saga.namespace, &name, db);
    if has_room(limit, there) {
        return Ok(());
    }
    Err(Error::fatal(
        "QuotaExceeded",
        format!(
            "DatabaseServer {name} allows {limit} Databases per namespace and namespace {} has {there} there already; nothing was changed",
            saga.namespace
        ),
    ))
}

/// How many Databases of `namespace` other than `db` name `server` in `spec.serverRef`
/// (being deleted or not: they hold their database there until they are gone).
fn databases_on(all: &[Arc<Database>], namespace: &str, server: &str, db: &Database) -> usize {
    all.iter()
        .filter(|d| d.metadata.namespace.as_deref() == Some(namespace))
        .filter(|d| d.spec.server_ref.name == server)
        .filter(|d| {
            (&d.metadata.namespace, &d.metadata.name) != (&db.metadata.namespace, &db.metadata.name)
        })
        .count()
}

/// Whether one more Database fits under `limit` beside the `there` already on the server.
fn has_room(limit: i32, there: usize) -> bool {
    i64::try_from(there).is_ok_and(|there| there < i64::from(limit))
}

/// The W3C trace context of this reconcile, for an object another controller acts on (it
/// continues the trace); empty when tracing is off.
fn trace_annotations() -> serde_json::Map<String, serde_json::Value> {
    dbops_shared::telemetry::trace_annotation()
        .map(|(k, v)| (k, serde_json::Value::String(v)))
        .into_iter()
        .collect()
}

// ---- Snapshot ------------------------------------------------------------------------

/// The snapshot Backup dumps this very Database (its UID), and continues the trace.
fn snapshot_annotations(db: &Database) -> serde_json::Map<String, serde_json::Value> {
    let mut annotations = trace_annotations();
    annotations.insert(
        dbops_api::marks::DATABASE_UID.to_string(),
        serde_json::Value::String(db.uid().unwrap_or_default()),
    );
    annotations
}

async fn snapshot(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let name = format!("{}-snapshot", saga.m.name_any());
    let backups: Api<Backup> = Api::namespaced(saga.ctx.client.clone(), &saga.namespace);
    let backup = match backups.get_opt(&name).await? {
        Some(b) => b,
        None => {
            let owner = saga.m.controller_owner_ref(&()).map(|r| vec![r]);
            let b: Backup = serde_json::from_value(json!({
                "apiVersion": "dbops.dev/v1alpha1",
                "kind": "Backup",
                "metadata": {
                    "name": name,
                    "namespace": saga.namespace,
                    "labels": {SNAPSHOT_LABEL: saga.m.name_any()},
                    "annotations": snapshot_annotations(db),
                    "ownerReferences": owner,
                },
                "spec": {"databaseRef": {"name": db.name_any()}, "deletionPolicy": "Retain"},
            }))
            .map_err(|e| Error::transient("InternalError", e.to_string()))?;
            match backups.create(&PostParams::default(), &b).await {
                Ok(b) => b,
                Err(kube::Error::Api(e)) if e.code == 409 => backups.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    let ours = backup
        .owner_references()
        .iter()
        .any(|r| Some(&r.uid) == saga.m.metadata.uid.as_ref());
    if !ours {
        return Err(Error::fatal(
            "NameConflict",
            format!("Backup {name} exists and does not belong to this Migration"),
        ));
    }
    let mut status = saga.status();
    if status.snapshot_ref.is_none() {
        status.snapshot_ref = Some(dbops_api::LocalObjectReference { name: name.clone() });
        saga.save(status).await?;
    }
    let backup_status = backup.status.clone().unwrap_or_default();
    match backup_status.phase {
        Some(BackupPhase::Completed) => Ok(Outcome::Done(format!(
            "Backup {name} completed ({} bytes, sha256 {})",
            backup_status.size_bytes.unwrap_or_default(),
            backup_status.checksum.as_deref().unwrap_or("?")
        ))),
        Some(BackupPhase::Failed) => {
            let why = dbops_shared::conditions::get(&backup_status.conditions, condition::FAILED)
                .map(|c| format!("{}: {}", c.reason, c.message))
                .unwrap_or_else(|| "no reason given".into());
            Err(Error::fatal(
                "SnapshotFailed",
                format!("snapshot Backup {name} failed ({why})"),
            ))
        }
        phase => Ok(Outcome::Wait(format!(
            "waiting for snapshot Backup {name} ({})",
            phase.map_or("not started".to_string(), |p| format!("{p:?}"))
        ))),
    }
}

// ---- FreezeSource --------------------------------------------------------------------

async fn freeze_source(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let source = source_server(saga).await?;
    let database = db.database_name();
    let s = session(saga, &source, "postgres").await?;
    let mut status = saga.status();
    let record = match status.freeze.clone() {
        Some(r) => r,
        None => {
            let found = sql::freeze_state(&s, &database).await?.ok_or_else(|| {
                Error::fatal(
                    "SourceNotFound",
                    format!("database {database:?} is gone from {}", at(&source)),
                )
            })?;
            // Written before anything changes: the compensation restores exactly this.
            status.freeze = Some(found.clone());
            saga.save(status).await?;
            found
        }
    };
    // Logical mode: the subscription's WAL sender stays for the catch-up.
    let spare = (saga.status().mode == Some(ChosenMode::Logical))
        .then(|| crate::replication::name(&migration_uid(saga)));
    let (ended, left) = sql::freeze(&s, &database, spare.as_deref()).await?;
    if left > 0 {
        return Err(Error::transient(
            "SessionsRemain",
            format!("{left} sessions on {database} survived pg_terminate_backend"),
        ));
    }
    Ok(Outcome::Done(format!(
        "database {database} on {}: connection limit 0 (was {}), default_transaction_read_only on (was {}); {ended} sessions ended",
        at(&source),
        record.previous_connection_limit,
        record.previous_read_only.as_deref().unwrap_or("unset"),
    )))
}

async fn unfreeze_source(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    let Some(record) = saga.status().freeze else {
        return Ok("nothing was frozen".into());
    };
    let (database, _) = names(saga, db)?;
    let source = source_server(saga).await?;
    let s = session(saga, &source, "postgres").await?;
    if sql::freeze_state(&s, &database).await?.is_none() {
        return Ok(format!(
            "database {database} no longer exists on {}",
            at(&source)
        ));
    }
    sql::unfreeze(&s, &database, &record).await?;
    Ok(format!(
        "database {database} on {}: connection limit {} and default_transaction_read_only {} restored",
        at(&source),
        record.previous_connection_limit,
        record.previous_read_only.as_deref().unwrap_or("unset"),
    ))
}

// ---- ProvisionTarget -----------------------------------------------------------------

async fn provision_target(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let target = target_server(saga).await?;
    let source = source_server(saga).await?;
    let uid = database_uid(saga)?;
    let muid = migration_uid(saga);
    let mark = sql::migration_mark(&uid, &muid);
    let (database, role) = (db.database_name(), db.owner_role());

    let mut t = session(saga, &target, "postgres").await?;
    let found = sql::observe(&t, &role, &database).await?;
    let ours = |comment: Option<&str>| sql::is_migrations(comment, &uid, &muid);
    if found.role.is_some() && !found.role_is(ours) {
        return Err(Error::fatal(
            "NameConflict",
            format!("role {role:?} appeared on {} meanwhile", at(&target)),
        ));
    }
    if found.database.is_some() && !found.database_is(ours, &role) {
        return Err(Error::fatal(
            "NameConflict",
            format!(
                "database {database:?} appeared on {} meanwhile",
                at(&target)
            ),
        ));
    }
    // A password nobody knows: the role is not used before the switch, and the
    // database-controller gives it the connection Secret's password when the Database
    // arrives on this server (this controller never reads a tenant's Secret).
    let password = dbops_shared::postgres::generate_password();
    let mut status = saga.status();
    if !status.target_touched {
        // Written before the first statement that changes the target.
        status.target_touched = true;
        saga.save(status).await?;
    }
    if found.role.is_none() {
        sql::create_role(&mut t, &role, &password, &mark).await?;
    }
    match &found.database {
        None => {
            sql::create_database(&t, &database, &role, db.spec.connection_limit).await?;
            sql::mark_database(&t, &database, &mark).await?;
        }
        Some(d) if d.comment.is_none() => sql::mark_database(&t, &database, &mark).await?,
        Some(_) => {}
    }
    drop(t);

    let s = session(saga, &source, &database).await?;
    let extensions = sql::installed_extensions(&s).await?;
    drop(s);
    if !extensions.is_empty() {
        let t = session(saga, &target, &database).await?;
        let there = sql::installed_extensions(&t).await?;
        let missing: Vec<String> = extensions
            .iter()
            .filter(|e| !there.contains(e))
            .cloned()
            .collect();
        // Preflight checked that the target allows and offers each of them.
        for extension in extensions::available(&t, &missing).await? {
            extensions::create(&t, &extension).await?;
        }
    }
    Ok(Outcome::Done(format!(
        "role {role} and database {database} on {} (marked {mark:?}); extensions {extensions:?}",
        at(&target)
    )))
}

async fn clean_target(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    if !saga.status().target_touched {
        return Ok("nothing was created on the target".into());
    }
    let target = target_server(saga).await?;
    let uid = database_uid(saga)?;
    let muid = migration_uid(saga);
    let (database, role) = names(saga, db)?;
    let t = session(saga, &target, "postgres").await?;
    let ours = |comment: Option<&str>| sql::is_migrations(comment, &uid, &muid);
    let dropped = sql::drop_marked(&t, &database, &role, &[], ours).await?;
    let mut done = dropped.describe(&database, &role, "not created by this Migration");
    if done.is_empty() {
        done.push("nothing of this Migration's is left".into());
    }
    Ok(format!("on {}: {}", at(&target), done.join(", ")))
}

// ---- CopyData ------------------------------------------------------------------------

async fn copy_data(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let source = source_server(saga).await?;
    let target = target_server(saga).await?;
    let database = db.database_name();
    let t = session(saga, &target, &database).await?;
    let already = sql::user_objects(&t).await?;
    let (target_num, target_version) = sql::server_version(&t).await?;
    drop(t);
    if already > 0 {
        return Ok(Outcome::Done(format!(
            "already copied: {already} objects in the target database (the restore is one transaction)"
        )));
    }
    let s = session(saga, &source, &database).await?;
    let (source_num, source_version) = sql::server_version(&s).await?;
    drop(s);
    let (pg_dump, pg_restore) = copy_programs(
        saga,
        (source_num, &source_version),
        (target_num, &target_version),
        true,
    )
    .await?;
    let started = std::time::Instant::now();
    copy::copy(
        &Programs {
            pg_dump: &pg_dump.path,
            pg_restore: &pg_restore.path,
        },
        &Side {
            server: &source.endpoint,
            credentials: &source.credentials,
            database: &database,
        },
        &Side {
            server: &target.endpoint,
            credentials: &target.credentials,
            database: &database,
        },
        &db.owner_role(),
        copy::Contents::Everything,
    )
    .await?;
    Ok(Outcome::Done(format!(
        "pg_dump {} of {database} on {} restored by pg_restore {} into {} in {:.1}s, owned by {}",
        pg_dump.version.version,
        at(&source),
        pg_restore.version.version,
        at(&target),
        started.elapsed().as_secs_f64(),
        db.owner_role()
    )))
}

// ---- Verify --------------------------------------------------------------------------

async fn verify(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let source = source_server(saga).await?;
    let target = target_server(saga).await?;
    let database = db.database_name();
    let s = session(saga, &source, &database).await?;
    let t = session(saga, &target, &database).await?;
    let (on_source, on_target) = (sql::tables(&s).await?, sql::tables(&t).await?);
    if on_source != on_target {
        let missing: Vec<_> = on_source
            .iter()
            .filter(|x| !on_target.contains(x))
            .collect();
        let extra: Vec<_> = on_target
            .iter()
            .filter(|x| !on_source.contains(x))
            .collect();
        return Err(Error::fatal(
            "VerifyFailed",
            format!(
                "tables differ: missing on the target {missing:?}, only on the target {extra:?}"
            ),
        ));
    }
    let mut rows = 0;
    let mut mismatches = Vec::new();
    for (schema, table) in &on_source {
        let (a, b) = (
            sql::count_rows(&s, schema, table).await?,
            sql::count_rows(&t, schema, table).await?,
        );
        if a != b {
            mismatches.push(format!(
                "{schema}.{table}: {a} on the source, {b} on the target"
            ));
        }
        rows += a;
    }
    if !mismatches.is_empty() {
        return Err(Error::fatal(
            "VerifyFailed",
            format!("row counts differ: {}", mismatches.join("; ")),
        ));
    }
    Ok(Outcome::Done(format!(
        "{} tables, {rows} rows: the same on both servers",
        on_source.len()
    )))
}

// ---- SwitchTraffic -------------------------------------------------------------------

/// Needs no session: the target is named, not resolved, so the switch and its wait do not
/// depend on the server caches.
async fn switch_traffic(saga: &mut Saga<'_>, db: &Database) -> Result<Outcome> {
    let target = saga.m.spec.target.server_ref.clone();
    let mut status = saga.status();
    let mut db = db.clone();
    if db.spec.server_ref != target {
        let databases: Api<Database> = Api::namespaced(saga.ctx.client.clone(), &saga.namespace);
        let mut metadata = json!({"name": db.name_any(), "annotations": trace_annotations()});
        // Only the Database Preflight recorded is moved, never one created again under
        // its name since (`Saga::database` sees none then): its UID is a precondition.
        if let Some(uid) = &status.database_uid {
            metadata["uid"] = json!(uid);
        }
        let patch = json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": metadata,
            "spec": {"serverRef": {"name": target.name}},
        });
        db = databases
            .patch(
                &db.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        status.switched_generation = db.metadata.generation;
        saga.save(status.clone()).await?;
        saga.event(
            true,
            "TrafficSwitched",
            &format!(
                "Database {} spec.serverRef now {}; waiting for it to be Ready there",
                db.name_any(),
                target.name
            ),
        )
        .await;
    } else if status.switched_generation.is_none() {
        // Patched, then a crash before the record: this generation is at least the patched one.
        status.switched_generation = db.metadata.generation;
        saga.save(status.clone()).await?;
    }
    let generation = status.switched_generation.unwrap_or_default();
    if db.metadata.deletion_timestamp.is_some() {
        // Deleted after the switch: it will never be Ready there, and need not be; its
        // deletion policy applies on the target once this Migration ends.
        return Ok(Outcome::Done(format!(
            "Database {} now refers to DatabaseServer {} (generation {generation}) and is being deleted; its deletionPolicy applies there once this Migration ends",
            db.name_any(),
            target.name
        )));
    }
    let ready = db.status.as_ref().is_some_and(|s| {
        s.observed_generation.unwrap_or_default() >= generation
            && dbops_shared::conditions::get(&s.conditions, condition::READY).is_some_and(|c| {
                c.status == "True" && c.observed_generation.unwrap_or_default() >= generation
            })
    });
    if ready {
        Ok(Outcome::Done(format!(
            "Database {} is Ready on DatabaseServer {} (generation {generation}); Secret {} points there",
            db.name_any(),
            target.name,
            db.connection_secret_name()
        )))
    } else {
        Ok(Outcome::Wait(format!(
            "waiting for Database {} to be Ready on DatabaseServer {} at generation {generation}",
            db.name_any(),
            target.name
        )))
    }
}

// ---- Cleanup -------------------------------------------------------------------------

/// Keep or Drop the source; `db` is `None` when the Database was deleted after the switch.
pub async fn cleanup(saga: &mut Saga<'_>, db: Option<&Database>) -> Result<String> {
    let source_ref = source_ref(saga)?;
    let (database, role) = names(saga, db)?;
    // Logical mode: CatchUp took the replication down; once more in case it did not
    // finish (nothing is written when nothing is left).
    let replication = if saga.status().mode == Some(ChosenMode::Logical) {
        format!("{}; ", replicate::teardown(saga, &database).await?)
    } else {
        String::new()
    };
    if saga.m.spec.source_retention == SourceRetention::Keep {
        return Ok(format!(
            "{replication}sourceRetention Keep: database {database} stays on DatabaseServer {}, frozen (read-only, connection limit 0)",
            source_ref.name
        ));
    }
    let source = resolve(saga, &source_ref).await?;
    let uid = database_uid(saga)?;
    let s = session(saga, &source, "postgres").await?;
    let ours = |comment: Option<&str>| sql::is_databases(comment, &uid);
    let dropped = sql::drop_marked(&s, &database, &role, &[], ours).await?;
    let mut done = dropped.describe(&database, &role, "not this Database's");
    if done.is_empty() {
        done.push("already gone".into());
    }
    Ok(format!(
        "{replication}sourceRetention Drop on {}: {}",
        at(&source),
        done.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database(namespace: &str, name: &str, server: &str) -> Database {
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"serverRef": {"name": server}},
        }))
        .unwrap()
    }

    #[test]
    fn the_quota_counts_the_namespaces_other_databases_on_the_target() {
        let moving = database("shop", "orders", "pg-16");
        let all: Vec<Arc<Database>> = [
            database("shop", "orders", "pg-16"),
            database("shop", "carts", "pg-17"),
            database("shop", "users", "pg-17"),
            database("shop", "audit", "pg-16"),
            database("other", "orders", "pg-17"),
        ]
        .into_iter()
        .map(Arc::new)
        .collect();
        assert_eq!(databases_on(&all, "shop", "pg-17", &moving), 2);
        assert_eq!(databases_on(&all, "other", "pg-17", &moving), 1);
        // A Database already there (a target that is its own source) is not counted twice.
        let there = database("shop", "carts", "pg-17");
        assert_eq!(databases_on(&all, "shop", "pg-17", &there), 1);
        assert_eq!(databases_on(&all, "shop", "pg-15", &moving), 0);
    }

    #[test]
    fn one_more_database_fits_only_below_the_limit() {
        assert!(has_room(3, 2));
        assert!(!has_room(3, 3));
        assert!(!has_room(0, 0), "a limit of 0 admits none");
        assert!(has_room(1, 0));
    }

    #[test]
    fn preflight_refuses_an_unusable_server_for_good_and_waits_for_the_caches() {
        let refused = |e: ServerError| match preflight_error(e.into()) {
            Error::Fatal { reason, .. } => reason,
            other => panic!("not fatal: {other:?}"),
        };
        assert_eq!(
            refused(ServerError::NotFound("pg-17".into())),
            "ServerNotFound"
        );
        assert_eq!(
            refused(ServerError::NamespaceNotAllowed {
                server: "pg-17".into(),
                namespace: "shop".into(),
                detail: "its labels do not match spec.allowedNamespaces".into(),
            }),
            "NamespaceNotAllowed"
        );
        assert_eq!(
            refused(ServerError::Deleting("pg-17".into())),
            "ServerDeleting"
        );
        assert_eq!(
            refused(ServerError::AdminSecretNotFound {
                server: "pg-17".into(),
                secret: "dbops-system/pg-17-admin".into(),
            }),
            "AdminSecretNotFound"
        );
        assert!(matches!(
            preflight_error(ServerError::NotSynced.into()),
            Error::Server(ServerError::NotSynced)
        ));
        assert!(matches!(
            preflight_error(Error::transient("SessionsRemain", "1 session")),
            Error::Transient { .. }
        ));
    }

    #[test]
    fn client_programs_that_cannot_copy_end_the_migration_naming_the_versions() {
        let program = |v: &str| pg_tools::Program {
            path: format!("/pg/{v}/pg_dump").into(),
            version: pg_tools::ClientVersion::parse(v).unwrap(),
        };
        let (dumps, restores) = ([program("15.14")], [program("15.14")]);
        let refusal =
            pg_tools::pick_copy(&dumps, &restores, (18, "18.4"), (18, "18.4")).unwrap_err();
        match refused(refusal, true) {
            Error::Fatal { reason, message } => {
                assert_eq!(reason, "PgDumpTooOld");
                assert!(
                    message.contains("15.14") && message.contains("PostgreSQL 18.4"),
                    "{message}"
                );
                assert!(message.contains("--pg-bin-dir"), "{message}");
            }
            other => panic!("not fatal: {other:?}"),
        }
        let (dumps, restores) = ([program("18.6")], [program("18.6")]);
        let refusal =
            pg_tools::pick_copy(&dumps, &restores, (13, "13.23"), (16, "16.14")).unwrap_err();
        let e = refused(refusal, false);
        assert_eq!(e.reason(), "PgRestoreTooNew");
        assert!(e.to_string().contains("schema copy"), "{e}");
    }
}
