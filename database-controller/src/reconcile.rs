//! The Database reconcile, as a pipeline of named steps:
//!
//! 1. `cleanup` when the Database is being deleted (behind the finalizer);
//! 2. `sync_finalizer`: present exactly when deletion has work to do outside the cluster
//!    (policy Delete or Snapshot, or a Migration in flight);
//! 3. `admit`: the DatabaseServer exists, allows the namespace and has room under its
//!    quota (a Database already provisioned there stays admitted);
//! 4. `provision`: session → observe → role → database → settings → extensions →
//!    connection Secret; each step checks before it writes, so a converged Database costs
//!    reads only;
//! 5. `status::publish`: the status derived from the outcome, written only if it differs,
//!    and an Event for every condition transition.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{
    Backup, Database, DatabaseDeletionPolicy, DatabaseStatus, Migration, MigrationPhase,
};
use dbops_shared::controller::Context;
use dbops_shared::events::Recorder;
use dbops_shared::postgres::{ServerKey, Servers, Session};
use dbops_shared::server::{Directory, Resolved, ServerError};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::json;

use crate::error::{Error, Result};
use crate::{restore, secret, sql, status};

pub const FINALIZER: &str = "dbops.dev/database-cleanup";
pub const FIELD_MANAGER: &str = "dbops-database-controller";
/// How long a reconcile waits for a cache's first list before it backs off.
const STORE_SYNC_WAIT: Duration = Duration::from_secs(30);

/// The database-controller's own state.
pub struct State {
    /// Sessions to PostgreSQL servers, shared with the DatabaseServer controller.
    pub servers: Arc<Servers>,
    pub recorder: Recorder,
    /// DatabaseServers, their admin and CA Secrets (the controllers' namespace only) and
    /// the namespaces' labels.
    pub directory: Directory,
    /// Every Migration, kept by a reflector (set up with the watches); shared with the
    /// DatabaseServer controller.
    pub migrations: Arc<std::sync::OnceLock<Store<Migration>>>,
    /// When each Database's PostgreSQL state was last verified, and at which generation.
    pub verified: Verified,
    /// The status last written for each Database.
    pub written: Written,
    /// The controller's own cache of Databases (set up with the watches), to forget
    /// what is remembered about Databases that are gone, count a server's Databases and
    /// apply its quota. Shared with the DatabaseServer controller.
    pub databases: Arc<std::sync::OnceLock<Store<Database>>>,
    /// The connection Secrets (label `app.kubernetes.io/managed-by=dbops`), kept by their
    /// watch (set up with the watches); no other Secret of a tenant is cached.
    pub secrets: std::sync::OnceLock<Store<Secret>>,
    pub last_prune: Mutex<Option<Instant>>,
    /// The backup store and pg_restore, for `spec.restoreFrom`.
    pub restorer: restore::Restorer,
}

impl State {
    /// Drops index and memo entries of Databases no longer in the cache, at most once per
    /// `every`: memory stays bounded by the Databases that exist.
    pub fn prune(&self, every: Duration) {
        let Some(store) = self.databases.get() else {
            return;
        };
        {
            let mut last = self.last_prune.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|at| at.elapsed() < every) {
                return;
            }
            *last = Some(Instant::now());
        }
        let live: HashSet<String> = store
            .state()
            .iter()
            .filter_map(|d| d.metadata.uid.clone())
            .collect();
        // An entry older than `every` (the resync interval) no longer spares a check.
        self.verified
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|uid, (_, _, at)| live.contains(uid) && at.elapsed() < every);
        self.written
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|uid, _| live.contains(uid));
    }
}

/// The status this controller last wrote for each Database (by uid). A reconcile that
/// runs on a cached object older than its own last status write (the watch has not
/// caught up yet) would otherwise write the same status, and send the same Event, twice.
///
/// An entry lives until the cache shows the write: the next reconcile drops it, and so does
/// a sweep whenever the map has doubled since the last one (a burst of new Databases is
/// written faster than it is reconciled again), so the map stays near the number of
/// writes the watch has not delivered yet rather than the number of Databases.
#[derive(Default)]
pub struct Written {
    inner: Mutex<HashMap<String, DatabaseStatus>>,
    /// The size at which `record` sweeps next.
    sweep_at: Mutex<usize>,
}

/// The smallest map `Written::record` sweeps.
const WRITTEN_SWEEP_MIN: usize = 64;

impl Written {
    /// The status to build on: the one last written if there is one (this controller is
    /// the only writer, so the cached object can only be older), else the cached one.
    /// Once the cache has caught up (it holds what was written), the entry is dropped:
    /// memory is spent only on Databases whose last write the watch has not shown yet.
    pub fn latest(&self, db: &Database) -> DatabaseStatus {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let uid = db.uid().unwrap_or_default();
        match map.get(&uid) {
            Some(written) if db.status.as_ref() == Some(written) => {
                map.remove(&uid);
                db.status.clone().unwrap_or_default()
            }
            Some(written) => written.clone(),
            None => db.status.clone().unwrap_or_default(),
        }
    }

    pub fn is_current(&self, db: &Database, status: &DatabaseStatus) -> bool {
        let map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&db.uid().unwrap_or_default()) == Some(status)
    }

    pub fn record(&self, db: &Database, status: &DatabaseStatus, cache: Option<&Store<Database>>) {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(db.uid().unwrap_or_default(), status.clone());
        let mut sweep_at = self.sweep_at.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() < (*sweep_at).max(WRITTEN_SWEEP_MIN) {
            return;
        }
        if let Some(cache) = cache {
            let caught_up: Vec<String> = cache
                .state()
                .iter()
                .filter_map(|cached| {
                    let uid = cached.metadata.uid.as_deref()?;
                    let written = map.get(uid)?;
                    (cached.status.as_ref() == Some(written)).then(|| uid.to_owned())
                })
                .collect();
            for uid in caught_up {
                map.remove(&uid);
            }
        }
        *sweep_at = map.len() * 2;
    }

    fn forget(&self, uid: &str) {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(uid);
    }
}

/// The last full check of each Database against PostgreSQL. A reconcile soon after one
/// (triggered by the controller's own status or Secret write) checks the Secret only;
/// PostgreSQL is read again at the latest one resync interval later.
#[derive(Default)]
pub struct Verified {
    inner: Mutex<HashMap<String, (i64, Provisioned, Instant)>>,
}

impl Verified {
    fn recent(&self, uid: &str, generation: i64, within: Duration) -> Option<Provisioned> {
        let map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.get(uid)
            .filter(|(g, _, at)| *g == generation && at.elapsed() < within)
            .map(|(_, p, _)| p.clone())
    }

    fn record(&self, uid: &str, generation: i64, provisioned: &Provisioned) {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(
            uid.to_string(),
            (generation, provisioned.clone(), Instant::now()),
        );
    }

    fn forget(&self, uid: &str) {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(uid);
    }
}

/// What a successful provisioning produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provisioned {
    pub provider_id: String,
    pub server_version: String,
    /// The DatabaseServer it is on, and the `host:port` applications connect to.
    pub server: String,
    pub endpoint: String,
}

pub async fn reconcile(db: Arc<Database>, ctx: Arc<Context<State>>) -> Result<Action> {
    let namespace = db.namespace().unwrap_or_default();
    let name = db.name_any();
    let api: Api<Database> = Api::namespaced(ctx.client.clone(), &namespace);
    ctx.state.prune(ctx.resync_interval);
    let _ = name;

    let migration = active_migration(&ctx, &db).await?;

    if db.metadata.deletion_timestamp.is_some() {
        return cleanup(&db, &ctx, &api, migration.as_deref()).await;
    }
    sync_finalizer(&db, &api, migration.is_some()).await?;

    let outcome = provision(&db, &ctx, migration.is_some()).await;
    status::publish(&db, &ctx, &api, &outcome, migration.as_deref()).await?;
    match outcome {
        Ok(_) => Ok(Action::requeue(ctx.resync_interval)),
        // Nothing to retry until something changes; the watches and the resync notice.
        Err(Error::Blocked { .. }) => Ok(Action::requeue(ctx.resync_interval)),
        // Transient, a breaker refusal included: the error policy's per-object backoff
        // grows (an Ok here would reset it). The server's return wakes it sooner: the
        // DatabaseServer turning Ready maps to its Databases.
        Err(e) => Err(e),
    }
}

/// The name of a Migration of this Database that has not ended.
async fn active_migration(ctx: &Context<State>, db: &Database) -> Result<Option<String>> {
    let namespace = db.namespace().unwrap_or_default();
    let name = db.name_any();
    let migrations: Vec<Arc<Migration>> = match ctx.state.migrations.get() {
        Some(store) => {
            // Before the first list, "no Migration" would be a guess; the wait is bounded.
            match tokio::time::timeout(STORE_SYNC_WAIT, store.wait_until_ready()).await {
                Ok(Ok(())) => store.state(),
                _ => {
                    return Err(Error::Retry {
                        reason: "CacheNotSynced",
                        message: "the Migration cache has not synced yet".into(),
                    });
                }
            }
        }
        None => {
            let api: Api<Migration> = Api::namespaced(ctx.client.clone(), &namespace);
            let list = api.list(&ListParams::default()).await?;
            list.items.into_iter().map(Arc::new).collect()
        }
    };
    Ok(migrations
        .into_iter()
        .find(|m| {
            m.metadata.namespace.as_deref() == Some(namespace.as_str())
                && m.spec.database_ref.name == name
                && !matches!(
                    m.status.as_ref().and_then(|s| s.phase),
                    Some(
                        MigrationPhase::Succeeded
                            | MigrationPhase::Failed
                            | MigrationPhase::RolledBack
                    )
                )
        })
        .map(|m| m.name_any()))
}

fn needs_finalizer(db: &Database, migration_active: bool) -> bool {
    db.spec.deletion_policy != DatabaseDeletionPolicy::Retain || migration_active
}

fn has_finalizer(db: &Database) -> bool {
    db.finalizers().iter().any(|f| f == FINALIZER)
}

/// The finalizer is there exactly when deletion has work to do outside the cluster.
async fn sync_finalizer(db: &Database, api: &Api<Database>, migration_active: bool) -> Result<()> {
    let want = needs_finalizer(db, migration_active);
    Ok(dbops_shared::finalizer::set(db, api, FINALIZER, want).await?)
}

async fn remove_finalizer(db: &Database, api: &Api<Database>) -> Result<()> {
    Ok(dbops_shared::finalizer::set(db, api, FINALIZER, false).await?)
}

/// A Secret from the watch's cache or, when the cache does not hold it (not synced yet,
/// or newer than the cache), from the API. A cached copy may be a little old; every change
/// to it is a watch event that reconciles the Database again.
async fn cached_secret(
    ctx: &Context<State>,
    namespace: &str,
    name: &str,
) -> Result<Option<Arc<Secret>>> {
    if let Some(found) = ctx
        .state
        .secrets
        .get()
        .and_then(|store| store.get(&ObjectRef::new(name).within(namespace)))
    {
        return Ok(Some(found));
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    Ok(secrets.get_opt(name).await?.map(Arc::new))
}

/// A server problem as this Database reports it: waiting for the platform team (or the
/// caches, which a retry cures).
fn server_error(e: ServerError) -> Error {
    if e.is_transient() {
        Error::Retry {
            reason: e.reason(),
            message: e.to_string(),
        }
    } else {
        Error::Blocked {
            reason: e.reason(),
            message: e.to_string(),
        }
    }
}

/// The Database's DatabaseServer with its endpoint and admin credentials (from caches).
async fn server_of(ctx: &Context<State>, db: &Database) -> Result<Resolved> {
    let directory = &ctx.state.directory;
    directory.synced().await.map_err(server_error)?;
    directory
        .resolve(&db.spec.server_ref.name)
        .map_err(server_error)
}

/// Whether the Database may be (or stay) on its server: one already provisioned there
/// stays admitted whatever the server's namespace selector and quota say now; a new one
/// needs a server that is not being deleted, allows its namespace and has room under
/// `limits.databasesPerNamespace` (the oldest Databases by creation time come first).
fn admit(ctx: &Context<State>, db: &Database, server: &Resolved) -> Result<()> {
    if already_on(db, &server.name) {
        return Ok(());
    }
    if server.server.metadata.deletion_timestamp.is_some() {
        return Err(server_error(ServerError::Deleting(server.name.clone())));
    }
    let namespace = db.namespace().unwrap_or_default();
    ctx.state
        .directory
        .admits(&server.server, &namespace)
        .map_err(server_error)?;
    let limit = server
        .server
        .spec
        .limits
        .as_ref()
        .and_then(|l| l.databases_per_namespace);
    if let (Some(limit), Some(store)) = (limit, ctx.state.databases.get()) {
        let peers: Vec<Arc<Database>> = store
            .state()
            .into_iter()
            .filter(|d| {
                d.metadata.namespace.as_deref() == Some(namespace.as_str())
                    && d.spec.server_ref.name == server.name
            })
            .collect();
        let (place, total) = quota_place(db, &peers, &server.name);
        if place >= usize::try_from(limit).unwrap_or(0) {
            return Err(Error::Blocked {
                reason: "QuotaExceeded",
                message: format!(
                    "DatabaseServer {:?} allows {limit} Databases per namespace and namespace {namespace:?} asks for {total}; this one is not among the {limit} oldest: nothing was created on the server",
                    server.name
                ),
            });
        }
    }
    Ok(())
}

/// Whether the Database was provisioned on DatabaseServer `server` (its status says so).
pub fn already_on(db: &Database, server: &str) -> bool {
    db.status
        .as_ref()
        .is_some_and(|s| s.server.as_deref() == Some(server) && s.provider_id.is_some())
}

/// The Database's place in its namespace's queue for `server` (0 = first) and the queue's
/// length: Databases already on the server first, then by creation time, then by name.
pub fn quota_place(db: &Database, peers: &[Arc<Database>], server: &str) -> (usize, usize) {
    let key = |d: &Database| {
        (
            !already_on(d, server),
            d.metadata.creation_timestamp.as_ref().map(|t| t.0),
            d.name_any(),
        )
    };
    let mine = key(db);
    let mut keys: Vec<_> = peers.iter().map(|d| key(d)).collect();
    if !peers.iter().any(|d| d.uid() == db.uid()) {
        keys.push(mine.clone());
    }
    keys.sort();
    let place = keys.iter().position(|k| *k == mine).unwrap_or(keys.len());
    (place, keys.len())
}

/// A session as the server's admin role.
async fn admin_session(ctx: &Context<State>, server: &Resolved, dbname: &str) -> Result<Session> {
    Ok(ctx
        .state
        .servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}

fn secret_conflict(message: String) -> Error {
    Error::Blocked {
        reason: "SecretConflict",
        message,
    }
}

fn conflict(what: &str, name: &str, server: &ServerKey) -> Error {
    Error::Blocked {
        reason: "NameConflict",
        message: format!(
            "{what} {name:?} already exists on {server} and was not created by this Database; nothing was changed"
        ),
    }
}

/// Brings the role, database, settings, extensions and connection Secret to the spec.
async fn provision(
    db: &Database,
    ctx: &Context<State>,
    migration_active: bool,
) -> Result<Provisioned> {
    let uid = db.uid().unwrap_or_default();
    let generation = db.metadata.generation.unwrap_or_default();
    if let Some(done) = ctx
        .state
        .verified
        .recent(&uid, generation, ctx.resync_interval / 2)
        && secret_is_current(db, ctx).await?
    {
        return Ok(done);
    }
    let provisioned = provision_in_postgres(db, ctx, migration_active).await;
    match &provisioned {
        Ok(p) => ctx.state.verified.record(&uid, generation, p),
        Err(_) => ctx.state.verified.forget(&uid),
    }
    provisioned
}

/// Whether the connection Secret holds the password written and everything else current.
async fn secret_is_current(db: &Database, ctx: &Context<State>) -> Result<bool> {
    let namespace = db.namespace().unwrap_or_default();
    let Some(existing) = cached_secret(ctx, &namespace, &db.connection_secret_name()).await? else {
        return Ok(false);
    };
    let Ok(target) = server_of(ctx, db).await else {
        return Ok(false);
    };
    Ok(secret::kept_password(&existing).is_some_and(|password| {
        secret::is_current(&existing, &secret::desired(db, &target, &password))
    }))
}

/// The full check: reads PostgreSQL and repairs whatever differs from the spec.
async fn provision_in_postgres(
    db: &Database,
    ctx: &Context<State>,
    migration_active: bool,
) -> Result<Provisioned> {
    let target = server_of(ctx, db).await?;
    admit(ctx, db, &target)?;
    let server = target.endpoint.key.clone();
    let uid = db.uid().unwrap_or_default();
    let mark = sql::mark(&uid);
    let (database, role) = (db.database_name(), db.owner_role());
    let namespace = db.namespace().unwrap_or_default();

    // A Secret of that name that this Database did not create is never written, and
    // nothing happens on the server either.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let existing = cached_secret(ctx, &namespace, &db.connection_secret_name()).await?;
    if let Some(found) = &existing {
        secret::check_ours(found, db).map_err(secret_conflict)?;
    }

    let mut session = admin_session(ctx, &target, "postgres").await?;
    let observed = sql::observe(&session, &role, &database).await?;

    let role_is_ours = observed
        .role
        .as_ref()
        .is_some_and(|r| sql::is_ours(r.comment.as_deref(), &uid));
    if observed.role.is_some() && !role_is_ours {
        return Err(conflict("role", &role, &server));
    }
    let db_is_ours = observed.database.as_ref().is_some_and(|d| {
        sql::is_ours(d.comment.as_deref(), &uid)
            // Created OWNER our marked role, crashed before its own mark.
            || (d.comment.is_none() && role_is_ours && d.owner == role)
    });
    if observed.database.is_some() && !db_is_ours {
        return Err(conflict("database", &database, &server));
    }
    if observed.database.is_none() && status::provider_id(db).is_some() {
        return Err(Error::Blocked {
            reason: "DatabaseMissing",
            message: format!(
                "database {database:?} was created on {server} but no longer exists; it is not re-created: restore it or delete this Database"
            ),
        });
    }

    // The password: kept while the Secret still holds the one written; otherwise new.
    let kept = existing.as_deref().and_then(secret::kept_password);
    let password = kept
        .clone()
        .unwrap_or_else(dbops_shared::postgres::generate_password);

    // Arriving on a server (a Migration's switch) the role exists with a password nobody
    // knows: it gets the Secret's, once.
    let arriving = !already_on(db, &target.name);
    if observed.role.is_none() {
        sql::create_role(&mut session, &role, &password, &mark).await?;
    } else if kept.is_none() || arriving {
        sql::set_password(&session, &role, &password).await?;
    }

    // A database made for `spec.restoreFrom` carries "restore pending" until it is filled.
    let new_mark = if db.spec.restore_from.is_some() {
        sql::restore_pending_mark(&uid)
    } else {
        mark.clone()
    };
    let restore_pending = db.spec.restore_from.is_some()
        && observed
            .database
            .as_ref()
            .is_none_or(|d| d.comment.is_none() || sql::is_restore_pending(d.comment.as_deref()));
    let mut oid = match &observed.database {
        None => {
            sql::create_database(
                &session,
                &database,
                &role,
                db.spec.connection_limit,
                &new_mark,
            )
            .await?;
            let again = sql::observe(&session, &role, &database).await?;
            again
                .database
                .map(|d| d.oid)
                .ok_or_else(|| Error::Blocked {
                    reason: "DatabaseMissing",
                    message: format!("database {database:?} vanished right after creation"),
                })?
        }
        Some(found) => {
            if found.comment.is_none() {
                // Created, then a crash before its mark: marked and closed to PUBLIC now,
                // exactly as a database created in one go.
                sql::mark_database(&session, &database, &new_mark).await?;
            }
            if found.owner != role {
                sql::set_owner(&session, &database, &role).await?;
            }
            // A Migration freezes the source with its own connection limit: not drift.
            if found.connection_limit != db.spec.connection_limit && !migration_active {
                sql::set_connection_limit(&session, &database, db.spec.connection_limit).await?;
            }
            found.oid
        }
    };
    if restore_pending {
        oid = restore(
            db,
            ctx,
            &target,
            &session,
            observed.database.is_none(),
            &password,
        )
        .await?;
    }
    drop(session);

    if !db.spec.extensions.is_empty() {
        let session = admin_session(ctx, &target, &database).await?;
        let installed = sql::installed_extensions(&session).await?;
        for ext in db.spec.extensions.iter().filter(|e| !installed.contains(e)) {
            sql::create_extension(&session, ext).await?;
        }
    }

    let desired = secret::desired(db, &target, &password);
    match &existing {
        Some(s) if secret::is_current(s, &desired) => {}
        // A new Secret: a plain create costs the apiserver less than an apply.
        None => match secrets.create(&PostParams::default(), &desired).await {
            Ok(_) => {}
            // Not in the cache, yet there: written only if it is this Database's own.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = secrets.get(&db.connection_secret_name()).await?;
                secret::check_ours(&found, db).map_err(secret_conflict)?;
                apply_secret(&secrets, db, &desired).await?
            }
            Err(e) => return Err(e.into()),
        },
        Some(_) => apply_secret(&secrets, db, &desired).await?,
    }

    Ok(Provisioned {
        provider_id: format!("{server}/{oid}"),
        server_version: observed.server_version,
        server: target.name.clone(),
        endpoint: server.to_string(),
    })
}

/// Fills a database made for `spec.restoreFrom` (see `restore`); returns its oid, which
/// changes when a half-restored database had to be made anew.
async fn restore(
    db: &Database,
    ctx: &Context<State>,
    server: &Resolved,
    session: &Session,
    fresh: bool,
    password: &str,
) -> Result<u32> {
    let artifact = restore::verify(db, &ctx.client, &ctx.state.restorer).await?;
    // Visible while pg_restore runs, which may take long.
    let api: Api<Database> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    let restoring = Err(Error::Blocked {
        reason: "Restoring",
        message: format!("restoring Backup {} (SHA-256 verified)", artifact.backup),
    });
    status::publish(db, ctx, &api, &restoring, None).await?;
    restore::restore(
        db,
        &server.endpoint,
        session,
        &ctx.state.restorer,
        &artifact,
        fresh,
        &db.owner_role(),
        password,
    )
    .await?;
    let database = db.database_name();
    let again = sql::observe(session, &db.owner_role(), &database).await?;
    again.database.map(|d| d.oid).ok_or_else(|| Error::Blocked {
        reason: "DatabaseMissing",
        message: format!("database {database:?} vanished right after its restore"),
    })
}

/// Server-side apply of the Secret: takes back every field this controller sets.
async fn apply_secret(secrets: &Api<Secret>, db: &Database, desired: &Secret) -> Result<()> {
    secrets
        .patch(
            &db.connection_secret_name(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(desired),
        )
        .await?;
    Ok(())
}

/// Deletion: what the policy asks for in PostgreSQL, then the finalizer goes.
async fn cleanup(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    migration: Option<&str>,
) -> Result<Action> {
    ctx.state.verified.forget(&db.uid().unwrap_or_default());
    if !has_finalizer(db) {
        return Ok(Action::await_change());
    }
    if let Some(migration) = migration {
        let outcome = Err(Error::Blocked {
            reason: "MigrationInProgress",
            message: format!(
                "deletion waits for Migration {migration} to end: it rolls back if it has not switched the server yet, and finishes if it has"
            ),
        });
        status::publish_deleting(db, ctx, api, &outcome).await?;
        return Ok(Action::requeue(ctx.resync_interval));
    }
    let namespace = db.namespace().unwrap_or_default();
    ctx.state.directory.synced().await.map_err(server_error)?;
    let mut note = deleted_note(db);
    let outcome = match db.spec.deletion_policy {
        DatabaseDeletionPolicy::Retain => Ok(()),
        DatabaseDeletionPolicy::Delete => drop_owned(db, ctx).await,
        // No Backup can be created in a namespace being deleted: the database is kept,
        // as Retain would, never dropped without its final snapshot, and the platform team
        // hears of it on the DatabaseServer.
        DatabaseDeletionPolicy::Snapshot
            if ctx.state.directory.namespace_terminating(&namespace) =>
        {
            note = kept_unsnapshotted(db, ctx).await;
            Ok(())
        }
        // Deleted before it was ever provisioned: nothing of its own to snapshot (the
        // backup-controller dumps only a provisioned database), so what it made is dropped.
        DatabaseDeletionPolicy::Snapshot if nothing_to_snapshot(db, ctx).await? => {
            note = format!(
                "database {} was never provisioned: no final Backup (nothing of its own to keep); what it had made is dropped",
                db.database_name()
            );
            drop_owned(db, ctx).await
        }
        DatabaseDeletionPolicy::Snapshot => match final_snapshot(db, ctx).await {
            Ok(()) => drop_owned(db, ctx).await,
            Err(Error::Kube(kube::Error::Api(e)))
                if e.code == 403 && e.message.contains("being terminated") =>
            {
                note = kept_unsnapshotted(db, ctx).await;
                Ok(())
            }
            Err(e) => Err(e),
        },
    };
    match outcome {
        Ok(()) => {
            remove_finalizer(db, api).await?;
            ctx.state.written.forget(&db.uid().unwrap_or_default());
            status::event(ctx, db, true, "Deleted", &note).await;
            Ok(Action::await_change())
        }
        Err(e) => {
            status::publish_deleting(db, ctx, api, &Err::<(), _>(e.clone_for_status())).await?;
            match e {
                Error::Blocked { .. } => Ok(Action::requeue(ctx.resync_interval)),
                e => Err(e),
            }
        }
    }
}

fn deleted_note(db: &Database) -> String {
    match db.spec.deletion_policy {
        DatabaseDeletionPolicy::Retain => {
            format!("database {} retained in PostgreSQL", db.database_name())
        }
        _ => format!(
            "database {} and role {} dropped",
            db.database_name(),
            db.owner_role()
        ),
    }
}

/// A Snapshot-policy Database deleted with its namespace: its database is kept, and a
/// Warning Event on its DatabaseServer says so (the namespace and its Events are going).
async fn kept_unsnapshotted(db: &Database, ctx: &Context<State>) -> String {
    let note = format!(
        "Database {}/{} (deletionPolicy Snapshot) was deleted with its namespace, where no final Backup can be made: database {} and role {} are kept on the server (drop them by hand once they are not needed)",
        db.namespace().unwrap_or_default(),
        db.name_any(),
        db.database_name(),
        db.owner_role()
    );
    if let Some(server) = ctx.state.directory.get(&db.spec.server_ref.name) {
        dbops_shared::events::publish(
            &ctx.state.recorder,
            server.as_ref(),
            false,
            "Delete",
            "KeptWithoutFinalSnapshot",
            &note,
        )
        .await;
    }
    tracing::warn!(database = db.database_name(), "{note}");
    note
}

/// Whether a Snapshot-policy Database being deleted holds nothing a final Backup would
/// keep: it was never provisioned (no `status.providerId`) and its server has no database
/// of its own that is whole: none at all, one half made (created, not marked yet) or half
/// restored (`restore=pending`), or one that is not its own. A database that is whole but
/// whose provisioning was not recorded (a crash after the connection Secret was written)
/// still gets its final Backup.
async fn nothing_to_snapshot(db: &Database, ctx: &Context<State>) -> Result<bool> {
    if status::provider_id(db).is_some() {
        return Ok(false);
    }
    let target = match server_of(ctx, db).await {
        // Refused (namespace, quota) or no such server: nothing was made there.
        Err(Error::Blocked { .. }) => return Ok(true),
        other => other?,
    };
    let uid = db.uid().unwrap_or_default();
    let session = admin_session(ctx, &target, "postgres").await?;
    let observed = sql::observe(&session, &db.owner_role(), &db.database_name()).await?;
    Ok(match &observed.database {
        None => true,
        Some(found) => {
            let comment = found.comment.as_deref();
            comment.is_none() || !sql::is_ours(comment, &uid) || sql::is_restore_pending(comment)
        }
    })
}

/// Drops the database and role if (and only if) this Database created them. A Database
/// that never got onto its server (refused, or its server is gone) has nothing there.
async fn drop_owned(db: &Database, ctx: &Context<State>) -> Result<()> {
    let provisioned = db.status.as_ref().is_some_and(|s| s.provider_id.is_some());
    let target = match server_of(ctx, db).await {
        Err(Error::Blocked { reason, message }) if !provisioned => {
            tracing::info!(
                reason,
                message,
                "nothing to drop: the database was never provisioned"
            );
            return Ok(());
        }
        other => other?,
    };
    let server = target.endpoint.key.clone();
    let uid = db.uid().unwrap_or_default();
    let (database, role) = (db.database_name(), db.owner_role());
    let session = admin_session(ctx, &target, "postgres").await?;
    let observed = sql::observe(&session, &role, &database).await?;
    let role_is_ours = observed
        .role
        .as_ref()
        .is_some_and(|r| sql::is_ours(r.comment.as_deref(), &uid));
    if let Some(found) = &observed.database {
        let ours = sql::is_ours(found.comment.as_deref(), &uid)
            || (found.comment.is_none() && role_is_ours && found.owner == role);
        if ours {
            sql::drop_database(&session, &database).await?;
        } else {
            tracing::info!(%server, database, "not dropping a database this Database did not create");
        }
    }
    if role_is_ours {
        sql::drop_role(&session, &role).await?;
    }
    Ok(())
}

/// The name of a Database's final snapshot: `<name>-final-<first 8 characters of its
/// UID>`, so a Database created again under the same name never finds the Backup of an
/// earlier one in its place.
pub fn final_snapshot_name(db: &Database) -> String {
    let uid = db.uid().unwrap_or_default();
    let suffix: String = uid.chars().filter(|c| *c != '-').take(8).collect();
    let name = db.name_any();
    // An object name has at most 253 characters; the suffix takes 15.
    let mut head: String = name.chars().take(253 - 15).collect();
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    format!("{head}-final-{suffix}")
}

/// What the Backup found under a Database's final snapshot name is to its deletion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinalSnapshot {
    /// Made for this deletion and Ready: the dump of this very Database.
    Ready,
    /// Made for this deletion, not finished yet.
    Pending,
    /// Made for this deletion and Failed (the reason is given).
    Failed(String),
    /// Not provably a final snapshot of this Database (why is given): never trusted.
    Foreign(String),
}

/// Judges `backup` as the final snapshot of `db` (pure). It is one only if it names this
/// Database's UID (annotation and label), was created after the deletion began, refers to
/// this Database, and, once Ready, says it dumped this UID (`status.databaseUID`).
pub fn judge_final_snapshot(db: &Database, backup: &Backup) -> FinalSnapshot {
    use dbops_api::marks;
    let uid = db.uid().unwrap_or_default();
    let name = backup.name_any();
    if backup.annotations().get(marks::DATABASE_UID) != Some(&uid)
        || backup.labels().get(marks::FINAL_SNAPSHOT_OF) != Some(&uid)
    {
        return FinalSnapshot::Foreign(format!(
            "Backup {name} was not made as the final snapshot of this Database (UID {uid})"
        ));
    }
    if backup.spec.database_ref.name != db.name_any() {
        return FinalSnapshot::Foreign(format!(
            "Backup {name} refers to Database {}",
            backup.spec.database_ref.name
        ));
    }
    let created = backup.creation_timestamp().map(|t| t.0);
    let deleting = db.metadata.deletion_timestamp.as_ref().map(|t| t.0);
    if let (Some(created), Some(deleting)) = (created, deleting)
        && created < deleting
    {
        return FinalSnapshot::Foreign(format!(
            "Backup {name} was created at {created}, before this Database's deletion began at {deleting}"
        ));
    }
    let status = backup.status.clone().unwrap_or_default();
    if dbops_shared::conditions::is_true(&status.conditions, dbops_api::condition::READY) {
        return match status.database_uid.as_deref() {
            Some(dumped) if dumped == uid => FinalSnapshot::Ready,
            other => FinalSnapshot::Foreign(format!(
                "Backup {name} is Ready but says it dumped the Database with UID {}, not {uid}",
                other.unwrap_or("<none>")
            )),
        };
    }
    match dbops_shared::conditions::get(&status.conditions, dbops_api::condition::FAILED) {
        Some(c) if c.status == "True" => {
            FinalSnapshot::Failed(format!("{}: {}", c.reason, c.message))
        }
        _ => FinalSnapshot::Pending,
    }
}

/// Ensures the final Backup of this deletion exists; Ok once it is Ready. A Backup of
/// that name that is not provably this Database's final snapshot is never trusted: the
/// database is kept and the Database says why.
async fn final_snapshot(db: &Database, ctx: &Context<State>) -> Result<()> {
    use dbops_api::marks;
    let namespace = db.namespace().unwrap_or_default();
    let backups: Api<Backup> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = final_snapshot_name(db);
    let uid = db.uid().unwrap_or_default();
    let backup = match backups.get_opt(&name).await? {
        Some(b) => b,
        None => {
            let mut b: Backup = serde_json::from_value(json!({
                "apiVersion": "dbops.dev/v1alpha1",
                "kind": "Backup",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {marks::FINAL_SNAPSHOT_OF: uid},
                    "annotations": {marks::DATABASE_UID: uid},
                },
                "spec": {"databaseRef": {"name": db.name_any()}, "deletionPolicy": "Retain"},
            }))
            .map_err(|e| Error::Internal(e.to_string()))?;
            // The backup-controller continues this reconcile's trace.
            if let Some((key, value)) = dbops_shared::telemetry::trace_annotation() {
                b.annotations_mut().insert(key, value);
            }
            match backups.create(&PostParams::default(), &b).await {
                Ok(created) => created,
                // Made by an earlier reconcile whose write the cache had not seen.
                Err(kube::Error::Api(e)) if e.code == 409 => backups.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    match judge_final_snapshot(db, &backup) {
        FinalSnapshot::Ready => Ok(()),
        FinalSnapshot::Pending => Err(Error::Blocked {
            reason: "WaitingForFinalBackup",
            message: format!(
                "waiting for the final Backup {name} to be Ready before dropping the database"
            ),
        }),
        FinalSnapshot::Failed(why) => Err(Error::Blocked {
            reason: "WaitingForFinalBackup",
            message: format!(
                "final Backup {name} failed ({why}); the database is kept until a final Backup is Ready (delete Backup {name} to try again)"
            ),
        }),
        FinalSnapshot::Foreign(why) => Err(Error::Blocked {
            reason: "FinalSnapshotConflict",
            message: format!(
                "{why}; it is not trusted as this Database's final snapshot and the database is kept: delete or rename Backup {name} so that a final snapshot of this Database can be taken"
            ),
        }),
    }
}

impl Error {
    /// A copy for the status (kube and SQL errors keep their message only).
    fn clone_for_status(&self) -> Error {
        match self {
            Error::Blocked { reason, message } => Error::Blocked {
                reason,
                message: message.clone(),
            },
            other => Error::Blocked {
                reason: dbops_shared::controller::ReconcileError::reason(other),
                message: other.to_string(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_server(name: &str, created: &str, provisioned_on: Option<&str>) -> Arc<Database> {
        let mut db: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
                         "creationTimestamp": created},
            "spec": {"serverRef": {"name": "pg-main"}}
        }))
        .unwrap();
        if let Some(server) = provisioned_on {
            db.status = Some(DatabaseStatus {
                server: Some(server.into()),
                provider_id: Some("h:5432/1".into()),
                ..DatabaseStatus::default()
            });
        }
        Arc::new(db)
    }

    #[test]
    fn the_quota_serves_databases_already_there_then_the_oldest() {
        let old = on_server("old", "2026-11-23T10:00:00Z", None);
        let new = on_server("new", "2026-11-23T11:00:00Z", None);
        // Created last but already provisioned there (before a quota was set): first.
        let there = on_server("there", "2026-11-23T12:00:00Z", Some("pg-main"));
        let peers = vec![old.clone(), new.clone(), there.clone()];
        assert_eq!(quota_place(&there, &peers, "pg-main"), (0, 3));
        assert_eq!(quota_place(&old, &peers, "pg-main"), (1, 3));
        assert_eq!(quota_place(&new, &peers, "pg-main"), (2, 3));
        // Same creation time: by name, so every replica decides alike.
        let twin = on_server("a-twin", "2026-11-23T10:00:00Z", None);
        let peers = vec![old.clone(), twin.clone()];
        assert_eq!(quota_place(&twin, &peers, "pg-main"), (0, 2));
        // A Database the cache does not hold yet still gets its place.
        assert_eq!(
            quota_place(&new, std::slice::from_ref(&old), "pg-main"),
            (1, 2)
        );
        assert!(already_on(&there, "pg-main") && !already_on(&there, "pg-other"));
    }

    fn deleting_database(uid: &str) -> Database {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "shop", "uid": uid,
                         "deletionTimestamp": "2026-11-23T10:00:00Z"},
            "spec": {"serverRef": {"name": "pg-main"},
                     "deletionPolicy": "Snapshot"}
        }))
        .unwrap()
    }

    fn final_backup(db_uid: &str, created: &str, status: serde_json::Value) -> Backup {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
            "metadata": {"name": "orders-final-11112222", "namespace": "shop",
                         "creationTimestamp": created,
                         "labels": {"dbops.dev/final-snapshot-of": db_uid},
                         "annotations": {"dbops.dev/database-uid": db_uid}},
            "spec": {"databaseRef": {"name": "orders"}},
            "status": status,
        }))
        .unwrap()
    }

    fn ready(uid: Option<&str>) -> serde_json::Value {
        serde_json::json!({"databaseUID": uid, "conditions": [{"type": "Ready", "status": "True",
            "reason": "Completed", "message": "", "lastTransitionTime": "2026-11-23T10:00:05Z"}]})
    }

    #[test]
    fn the_final_snapshot_name_carries_the_uid_and_stays_an_object_name() {
        let db = deleting_database("1111-2222-3333");
        assert_eq!(final_snapshot_name(&db), "orders-final-11112222");
        let mut long = db.clone();
        long.metadata.name = Some(format!("{}.x", "a".repeat(236)));
        let name = final_snapshot_name(&long);
        assert!(name.len() <= 253, "{}", name.len());
        assert!(name.ends_with("-final-11112222"));
        assert!(!name.contains(".-"), "{name}");
    }

    #[test]
    fn only_a_snapshot_made_for_this_deletion_of_this_database_is_trusted() {
        let db = deleting_database("uid-now");
        let after = "2026-11-23T10:00:01Z";
        assert_eq!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, ready(Some("uid-now")))),
            FinalSnapshot::Ready
        );
        assert_eq!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, serde_json::json!({}))),
            FinalSnapshot::Pending
        );
        // Left by an earlier Database of the same name.
        assert!(matches!(
            judge_final_snapshot(
                &db,
                &final_backup("uid-before", after, ready(Some("uid-before")))
            ),
            FinalSnapshot::Foreign(_)
        ));
        // Made before this deletion began.
        assert!(matches!(
            judge_final_snapshot(
                &db,
                &final_backup("uid-now", "2026-11-23T09:59:59Z", ready(Some("uid-now")))
            ),
            FinalSnapshot::Foreign(_)
        ));
        // Ready, but of another Database (or saying nothing about it).
        assert!(matches!(
            judge_final_snapshot(
                &db,
                &final_backup("uid-now", after, ready(Some("uid-other")))
            ),
            FinalSnapshot::Foreign(_)
        ));
        assert!(matches!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, ready(None))),
            FinalSnapshot::Foreign(_)
        ));
        // Made by hand under that name, without the marks.
        let mut by_hand = final_backup("uid-now", after, ready(Some("uid-now")));
        by_hand.metadata.annotations = None;
        assert!(matches!(
            judge_final_snapshot(&db, &by_hand),
            FinalSnapshot::Foreign(_)
        ));
        let failed = serde_json::json!({"conditions": [{"type": "Failed", "status": "True",
            "reason": "DumpFailed", "message": "boom", "lastTransitionTime": after}]});
        assert!(matches!(
            judge_final_snapshot(&db, &final_backup("uid-now", after, failed)),
            FinalSnapshot::Failed(why) if why.contains("DumpFailed")
        ));
    }

    #[test]
    fn a_verification_is_recent_only_for_its_generation_and_window() {
        let verified = Verified::default();
        let p = Provisioned {
            provider_id: "h:5432/1".into(),
            server_version: "15".into(),
            server: "pg-main".into(),
            endpoint: "h:5432".into(),
        };
        verified.record("uid-1", 1, &p);
        assert_eq!(
            verified.recent("uid-1", 1, Duration::from_secs(60)),
            Some(p.clone())
        );
        assert_eq!(
            verified.recent("uid-1", 2, Duration::from_secs(60)),
            None,
            "a new generation needs a full check"
        );
        assert_eq!(
            verified.recent("uid-1", 1, Duration::ZERO),
            None,
            "outside the window"
        );
        verified.forget("uid-1");
        assert_eq!(verified.recent("uid-1", 1, Duration::from_secs(60)), None);
    }

    #[test]
    fn a_written_status_is_remembered_until_the_cache_shows_it() {
        let written = Written::default();
        let cached = on_server("a", "2026-11-23T10:00:00Z", None);
        let mine = DatabaseStatus {
            observed_generation: Some(1),
            ..DatabaseStatus::default()
        };
        written.record(&cached, &mine, None);
        assert_eq!(
            written.latest(&cached),
            mine,
            "the cache is older: ours counts"
        );
        assert!(written.is_current(&cached, &mine));
        let mut caught_up = (*cached).clone();
        caught_up.status = Some(mine.clone());
        assert_eq!(written.latest(&caught_up), mine);
        assert!(
            written.inner.lock().unwrap().is_empty(),
            "nothing kept once the cache holds it"
        );
    }

    #[test]
    fn a_burst_of_writes_is_swept_once_the_cache_shows_them() {
        use kube::runtime::{reflector, watcher};
        let (cache, mut writer) = reflector::store::<Database>();
        let written = Written::default();
        let mine = DatabaseStatus {
            observed_generation: Some(1),
            ..DatabaseStatus::default()
        };
        for i in 0..WRITTEN_SWEEP_MIN {
            let db = on_server(&format!("db-{i}"), "2026-11-23T10:00:00Z", None);
            // The watch shows every write but the first one's.
            if i > 0 {
                let mut shown = (*db).clone();
                shown.status = Some(mine.clone());
                writer.apply_watcher_event(&watcher::Event::Apply(shown));
            }
            written.record(&db, &mine, Some(&cache));
        }
        let left: Vec<String> = written.inner.lock().unwrap().keys().cloned().collect();
        assert_eq!(left, ["uid-db-0"], "only the write the cache has not shown");
    }
}
