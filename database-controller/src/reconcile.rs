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

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{Database, DatabaseDeletionPolicy, DatabaseStatus, Migration, MigrationPhase};
use dbops_shared::controller::Context;
use dbops_shared::events::Recorder;
use dbops_shared::memo::Memo;
use dbops_shared::postgres::{Servers, Session, extensions};
use dbops_shared::server::{Directory, Resolved, ServerError};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::delete::cleanup;
use crate::error::{Error, Result};
use crate::plan::{self, Action as Step};
use crate::{limits, owner_logins, restore, secret, sql, status};

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
    /// The connection Secrets (label `app.kubernetes.io/managed-by=dbops`), one cache per
    /// namespace where Databases need them, reached through a RoleBinding made there; no
    /// other Secret of a tenant is cached.
    pub tenants: crate::tenant_secrets::TenantSecrets,
    pub last_prune: Mutex<Option<Instant>>,
    /// The backup store and pg_restore, for `spec.restoreFrom`.
    pub restorer: restore::Restorer,
    /// The Databases (namespace, name) with a `dbops_database_size_bytes` series, so
    /// [`State::prune`] drops those of Databases that are gone.
    pub sizes: Mutex<HashSet<(String, String)>>,
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
            .checks
            .retain(|uid, (_, _, at)| live.contains(uid) && at.elapsed() < every);
        self.written.statuses.retain(|uid, _| live.contains(uid));
        let named: HashSet<(String, String)> = store
            .state()
            .iter()
            .map(|d| (d.namespace().unwrap_or_default(), d.name_any()))
            .collect();
        self.sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(namespace, name)| {
                let keep = named.contains(&(namespace.clone(), name.clone()));
                if !keep {
                    dbops_shared::metrics::forget_database_size(namespace, name);
                }
                keep
            });
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
    statuses: Memo<DatabaseStatus>,
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
        let uid = db.uid().unwrap_or_default();
        let cached = || db.status.clone().unwrap_or_default();
        if self
            .statuses
            .forget_if(&uid, |written| db.status.as_ref() == Some(written))
        {
            return cached();
        }
        self.statuses
            .get(&uid, DatabaseStatus::clone)
            .unwrap_or_else(cached)
    }

    pub fn is_current(&self, db: &Database, status: &DatabaseStatus) -> bool {
        self.statuses
            .is(&db.uid().unwrap_or_default(), |written| written == status)
    }

    pub fn record(&self, db: &Database, status: &DatabaseStatus, cache: Option<&Store<Database>>) {
        let len = self
            .statuses
            .insert(&db.uid().unwrap_or_default(), status.clone());
        let mut sweep_at = self.sweep_at.lock().unwrap_or_else(|e| e.into_inner());
        if len < (*sweep_at).max(WRITTEN_SWEEP_MIN) {
            return;
        }
        if let Some(cache) = cache {
            for cached in cache.state() {
                if let Some(uid) = cached.metadata.uid.as_deref() {
                    self.statuses
                        .forget_if(uid, |written| cached.status.as_ref() == Some(written));
                }
            }
        }
        *sweep_at = self.statuses.len() * 2;
    }

    pub(crate) fn forget(&self, uid: &str) {
        self.statuses.forget(uid);
    }
}

/// The last full check of each Database against PostgreSQL. A reconcile soon after one
/// (triggered by the controller's own status or Secret write) checks the Secret only;
/// PostgreSQL is read again at the latest one resync interval later.
#[derive(Default)]
pub struct Verified {
    checks: Memo<(i64, Provisioned, Instant)>,
}

impl Verified {
    fn recent(&self, uid: &str, generation: i64, within: Duration) -> Option<Provisioned> {
        self.checks
            .get(uid, |(g, p, at)| {
                (*g == generation && at.elapsed() < within).then(|| p.clone())
            })
            .flatten()
    }

    fn record(&self, uid: &str, generation: i64, provisioned: &Provisioned) {
        self.checks
            .insert(uid, (generation, provisioned.clone(), Instant::now()));
    }

    pub(crate) fn forget(&self, uid: &str) {
        self.checks.forget(uid);
    }
}

/// What a successful provisioning produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Provisioned {
    pub provider_id: String,
    pub server_version: String,
    /// The DatabaseServer it is on, and the `host:port` applications connect to.
    pub server: String,
    pub endpoint: String,
    /// `pg_database_size` at the check, and the server's `limits.databaseSize`.
    pub size_bytes: i64,
    pub size_limit: Option<i64>,
    /// The login in the connection Secret, and the rotation's state.
    pub logins: crate::owner_logins::Logins,
}

pub async fn reconcile(db: Arc<Database>, ctx: Arc<Context<State>>) -> Result<Action> {
    match reconcile_held(&db, &ctx).await {
        // What this reconcile waited for outlasted the object it read: the object of that
        // name now (if any) is reconciled in its own right, this one is left alone.
        Err(Error::Superseded(why)) => {
            tracing::info!(
                why,
                "reconcile abandoned: the Database it read is no longer the live one; nothing was changed for it"
            );
            ctx.state.verified.forget(&db.uid().unwrap_or_default());
            Ok(Action::requeue(SUPERSEDED_REQUEUE))
        }
        other => other,
    }
}

/// How soon the name of a Database whose reconcile was abandoned ([`Error::Superseded`]) is
/// looked at again (its watch event usually comes first).
const SUPERSEDED_REQUEUE: Duration = Duration::from_secs(1);

async fn reconcile_held(db: &Database, ctx: &Context<State>) -> Result<Action> {
    let namespace = db.namespace().unwrap_or_default();
    let api: Api<Database> = Api::namespaced(ctx.client.clone(), &namespace);
    ctx.state.prune(ctx.resync_interval);

    let migration = active_migration(ctx, db).await?;

    if db.metadata.deletion_timestamp.is_some() {
        return cleanup(db, ctx, &api, migration.as_deref()).await;
    }
    sync_finalizer(db, &api, migration.is_some()).await?;

    let outcome = provision(db, ctx, migration.is_some()).await;
    if let Err(Error::Superseded(why)) = outcome {
        return Err(Error::Superseded(why));
    }
    status::publish(db, ctx, &api, &outcome, migration.as_deref()).await?;
    match outcome {
        Ok(p) => Ok(Action::requeue(
            p.logins
                .next
                .map_or(ctx.resync_interval, |n| n.min(ctx.resync_interval)),
        )),
        // Nothing to retry until something changes; the watches and the resync notice.
        Err(Error::Blocked { .. }) => Ok(Action::requeue(ctx.resync_interval)),
        // Transient, a breaker refusal included: the error policy's per-object backoff
        // grows (an Ok here would reset it). The server's return wakes it sooner: the
        // DatabaseServer turning Ready maps to its Databases.
        Err(e) => Err(e),
    }
}

/// Confirms that `db`, the Database this reconcile read when it began, is still the live
/// object of its name: the same UID, not being deleted, at the same generation. Called
/// before each change on the server (and before its connection Secret is written), so
/// after whatever the reconcile waited for on the way: its namespace's connection Secrets
/// (`tenant_secrets`: a RoleBinding in force, a first list), a session slot on the
/// server, a restore's checksum. A Database deleted and created again with the same name
/// meanwhile must not get the role and database of the one that went (marked as the
/// deleted UID's, they would belong to nobody and block the new one). Otherwise
/// [`Error::Superseded`], which abandons the reconcile without writing anything.
///
/// A read of the API, not of the cache (which is what the reconcile began with): a list
/// by name, since the controller's RBAC has no `get` on Databases.
pub(crate) async fn confirm_live(ctx: &Context<State>, db: &Database) -> Result<()> {
    let api: Api<Database> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    let by_name = ListParams::default().fields(&format!("metadata.name={}", db.name_any()));
    let live = api.list(&by_name).await?.items.into_iter().next();
    match superseded(db, live.as_ref()) {
        Some(why) => Err(Error::Superseded(why)),
        None => Ok(()),
    }
}

/// Why `held`, the object a reconcile read (a Database, a DatabaseUser), is no longer the
/// one to act for, given `live`, the object of that name now (`None`: there is none);
/// `None` while it still is.
pub(crate) fn superseded<K>(held: &K, live: Option<&K>) -> Option<String>
where
    K: kube::Resource<DynamicType = ()>,
{
    let what = format!(
        "{} {}/{} (UID {})",
        K::kind(&()),
        held.namespace().unwrap_or_default(),
        held.name_any(),
        held.uid().unwrap_or_default()
    );
    let Some(live) = live else {
        return Some(format!("{what} is gone"));
    };
    if live.uid() != held.uid() {
        return Some(format!(
            "{what} was deleted; the {} of that name now is UID {}",
            K::kind(&()),
            live.uid().unwrap_or_default()
        ));
    }
    if live.meta().deletion_timestamp.is_some() && held.meta().deletion_timestamp.is_none() {
        return Some(format!("{what} is being deleted"));
    }
    if live.meta().generation != held.meta().generation {
        return Some(format!(
            "{what} is at generation {} now; this reconcile read generation {}",
            live.meta().generation.unwrap_or_default(),
            held.meta().generation.unwrap_or_default()
        ));
    }
    None
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
                && !m
                    .status
                    .as_ref()
                    .and_then(|s| s.phase)
                    .is_some_and(MigrationPhase::is_final)
        })
        .map(|m| m.name_any()))
}

fn needs_finalizer(db: &Database, migration_active: bool) -> bool {
    db.spec.deletion_policy != DatabaseDeletionPolicy::Retain || migration_active
}

pub(crate) fn has_finalizer(db: &Database) -> bool {
    db.finalizers().iter().any(|f| f == FINALIZER)
}

/// The finalizer is there exactly when deletion has work to do outside the cluster.
async fn sync_finalizer(db: &Database, api: &Api<Database>, migration_active: bool) -> Result<()> {
    let want = needs_finalizer(db, migration_active);
    Ok(dbops_shared::finalizer::set(db, api, FINALIZER, want).await?)
}

pub(crate) async fn remove_finalizer(db: &Database, api: &Api<Database>) -> Result<()> {
    Ok(dbops_shared::finalizer::set(db, api, FINALIZER, false).await?)
}

/// The Database's connection Secret from its namespace's watch cache (set up at once when
/// the namespace is not yet, see `tenant_secrets`) or, when the cache does not hold it
/// (newer than the cache), from the API. A cached copy may be a little old; every change
/// to it is a watch event that reconciles the Database again.
async fn cached_secret(ctx: &Context<State>, db: &Database) -> Result<Option<Arc<Secret>>> {
    let namespace = db.namespace().unwrap_or_default();
    let name = db.connection_secret_name();
    let store = ctx.state.tenants.secrets_for(db).await?;
    if let Some(found) = store.get(&ObjectRef::new(&name).within(&namespace)) {
        return Ok(Some(found));
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    Ok(secrets.get_opt(&name).await?.map(Arc::new))
}

/// A server problem as this Database reports it: waiting for the platform team (or the
/// caches, which a retry cures).
pub(crate) fn server_error(e: ServerError) -> Error {
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
pub(crate) async fn server_of(ctx: &Context<State>, db: &Database) -> Result<Resolved> {
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
pub(crate) async fn admin_session(
    ctx: &Context<State>,
    server: &Resolved,
    dbname: &str,
) -> Result<Session> {
    Ok(ctx
        .state
        .servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}

/// A `spec.secretTemplate` that does not render: refused, naming the key.
pub(crate) fn template_error(e: crate::template::TemplateError) -> Error {
    Error::Blocked {
        reason: "InvalidSecretTemplate",
        message: format!("{e}; nothing was written"),
    }
}

fn secret_conflict(message: String) -> Error {
    Error::Blocked {
        reason: "SecretConflict",
        message,
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
        && !owner_logins::due(
            db,
            &ctx.state.written.latest(db),
            crate::rotation::secs_now(),
        )
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
    // Not reachable (yet): the full check says why.
    let Ok(Some(existing)) = cached_secret(ctx, db).await else {
        return Ok(false);
    };
    let Ok(target) = server_of(ctx, db).await else {
        return Ok(false);
    };
    let login = secret::username(&existing).unwrap_or_else(|| db.owner_role());
    Ok(secret::kept_password(&existing).is_some_and(|password| {
        secret::desired_for(
            &secret::Owner::database(db),
            &db.database_name(),
            &login,
            &target,
            &password,
        )
        .is_ok_and(|desired| secret::is_current(&existing, &desired))
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
    // Refused before anything is written: templates that do not render, requests over
    // the server's ceilings.
    crate::template::check(&db.spec.secret_template).map_err(template_error)?;
    let connection_limit = limits::connection_limit(
        db.spec.connection_limit,
        &target.server,
        "spec.connectionLimit",
    )?;
    let settings = limits::settings(db.spec.settings.as_ref(), &target.server, "spec.settings")?;
    let server = target.endpoint.key.clone();
    let uid = db.uid().unwrap_or_default();
    let (database, role) = (db.database_name(), db.owner_role());
    let namespace = db.namespace().unwrap_or_default();

    // A Secret of that name that this Database did not create is never written, and
    // nothing happens on the server either.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let existing = cached_secret(ctx, db).await?;
    // The cache may not show the Secret written last yet (its watch lags under load): when
    // it names another login than the latest status, it is read from the API, or a
    // rotation would be undone (the previous login given out again, the new one retired).
    let latest_login = ctx.state.written.latest(db).login;
    let existing = match (existing, latest_login.as_deref()) {
        (Some(found), Some(login)) if secret::username(&found).is_some_and(|u| u != login) => {
            secrets
                .get_opt(&db.connection_secret_name())
                .await?
                .map(Arc::new)
        }
        (existing, _) => existing,
    };
    if let Some(found) = &existing {
        secret::check_ours(found, db).map_err(secret_conflict)?;
    }

    // Observe.
    let mut session = admin_session(ctx, &target, "postgres").await?;
    let observed = sql::observe(&session, &role, &database).await?;
    let kept = existing.as_deref().and_then(secret::kept_password);
    // The login the Secret names: the owner, or one of its rotation logins.
    let kept_login = existing.as_deref().and_then(|s| {
        Some(owner_logins::Kept {
            login: secret::username(s)?,
            password: secret::kept_password(s)?,
        })
    });
    let owner_in_use = kept_login.as_ref().is_none_or(|k| k.login == role);

    // Plan (pure, see `plan`).
    let plan = plan::plan(
        &plan::Inputs {
            uid: &uid,
            role: &role,
            database: &database,
            server: &server.to_string(),
            connection_limit,
            restore_from: db.spec.restore_from.is_some(),
            provisioned_before: status::provider_id(db).is_some(),
            // The owner's password matters only while the Secret names the owner.
            arriving: !already_on(db, &target.name) && owner_in_use,
            migration_active,
            password_kept: kept.is_some() || !owner_in_use,
        },
        &observed,
    )?;
    // Extensions: one the server does not allow is refused before anything changes there.
    let extensions = allowed_extensions(db, &target, &session).await?;
    // The password: kept while the Secret still holds the one written; otherwise new.
    let password = match kept {
        Some(kept) if !plan.new_password && owner_in_use => kept,
        _ => dbops_shared::postgres::generate_password(),
    };

    // Apply, in order, for the Database that is still the live one.
    if !plan.actions.is_empty() {
        confirm_live(ctx, db).await?;
    }
    let oid = apply(
        db,
        ctx,
        &target,
        &mut session,
        &plan.actions,
        &password,
        &observed,
    )
    .await?;
    // The owner's session settings (the server's sessionLimits, the spec's settings).
    let current = crate::user::sql::role_settings(&session, &role).await?;
    let changes = crate::user::sql::settings_statements(&role, &settings, &current);
    if !changes.is_empty() {
        confirm_live(ctx, db).await?;
        crate::user::sql::apply_settings(&mut session, &role, &changes).await?;
    }
    // Password rotation: the owner's logins.
    let logins = if owner_logins::in_play(db, kept_login.as_ref()) {
        let mark = sql::mark(&uid);
        owner_logins::converge(
            db,
            &ctx.state.written.latest(db),
            &mut session,
            kept_login.as_ref(),
            &password,
            &settings,
            &mark,
            || confirm_live(ctx, db),
        )
        .await?
    } else {
        owner_logins::Logins {
            login: role.clone(),
            password: password.clone(),
            ..owner_logins::Logins::default()
        }
    };
    // Its size, for the status, the metric and the server's limits.databaseSize.
    let size_bytes = sql::database_size(&session, oid).await?;
    dbops_shared::metrics::set_database_size(&namespace, &db.name_any(), size_bytes);
    ctx.state
        .sizes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((namespace.clone(), db.name_any()));
    drop(session);

    if !extensions.is_empty() {
        let session = admin_session(ctx, &target, &database).await?;
        let installed = sql::installed_extensions(&session).await?;
        let missing = plan::missing_extensions(&db.spec.extensions, &installed);
        if !missing.is_empty() {
            confirm_live(ctx, db).await?;
        }
        for name in missing {
            if let Some(ext) = extensions.iter().find(|e| &e.name == name) {
                extensions::create(&session, ext).await?;
            }
        }
    }

    let desired = secret::desired_for(
        &secret::Owner::database(db),
        &database,
        &logins.login,
        &target,
        &logins.password,
    )
    .map_err(template_error)?;
    write_secret(ctx, &secrets, db, existing.as_deref(), &desired).await?;

    Ok(Provisioned {
        provider_id: format!("{server}/{oid}"),
        server_version: observed.server_version,
        server: target.name.clone(),
        endpoint: server.to_string(),
        size_bytes,
        size_limit: target
            .server
            .spec
            .limits
            .as_ref()
            .and_then(|l| l.database_size.as_deref())
            .and_then(limits::quantity_bytes),
        logins,
    })
}

/// The server's word on each extension of the spec, once every one is allowed there
/// (`dbops_shared::postgres::extensions`); a refusal blocks the Database, naming them.
async fn allowed_extensions(
    db: &Database,
    target: &Resolved,
    session: &Session,
) -> Result<Vec<extensions::Available>> {
    if db.spec.extensions.is_empty() {
        return Ok(Vec::new());
    }
    let offered = extensions::available(session, &db.spec.extensions).await?;
    let allowed = target.server.spec.allowed_extensions.as_deref();
    match extensions::refusal(&db.spec.extensions, allowed, &offered, &target.name) {
        Some(refused) => Err(Error::Blocked {
            reason: refused.reason,
            message: refused.message,
        }),
        None => Ok(offered),
    }
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
    // The checksum read the whole artifact from the store, which may take long.
    confirm_live(ctx, db).await?;
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

/// Takes the plan's actions in order on the admin's session; returns the database's oid.
async fn apply(
    db: &Database,
    ctx: &Context<State>,
    target: &Resolved,
    session: &mut Session,
    actions: &[Step],
    password: &str,
    observed: &dbops_shared::postgres::ddl::Observed,
) -> Result<u32> {
    let uid = db.uid().unwrap_or_default();
    let (database, role) = (db.database_name(), db.owner_role());
    let server = &target.endpoint.key;
    let mut oid = observed.database.as_ref().map(|d| d.oid);
    for action in actions {
        match action {
            Step::CreateRole => {
                sql::create_role(session, &role, password, &sql::mark(&uid)).await?
            }
            Step::SetPassword => sql::set_password(session, &role, password).await?,
            Step::CreateDatabase {
                mark,
                connection_limit,
            } => {
                sql::create_database(session, &database, &role, *connection_limit, mark).await?;
                let again = sql::observe(session, &role, &database).await?;
                oid = Some(
                    again
                        .database
                        .map(|d| d.oid)
                        .ok_or_else(|| Error::Blocked {
                            reason: "DatabaseMissing",
                            message: format!("database {database:?} vanished right after creation"),
                        })?,
                );
            }
            Step::MarkDatabase { mark } => {
                // Created, then a crash before its mark: marked and closed to PUBLIC now,
                // exactly as a database created in one go.
                sql::mark_database(session, &database, mark).await?
            }
            Step::SetOwner => sql::set_owner(session, &database, &role).await?,
            Step::SetConnectionLimit(limit) => {
                sql::set_connection_limit(session, &database, *limit).await?
            }
            Step::Restore { fresh } => {
                oid = Some(restore(db, ctx, target, session, *fresh, password).await?)
            }
        }
    }
    // Every plan without CreateDatabase starts from an observed database.
    oid.ok_or_else(|| Error::Blocked {
        reason: "DatabaseMissing",
        message: format!("database {database:?} is not on {server}"),
    })
}

/// Writes the connection Secret unless `existing` already carries `desired`, for the
/// Database that is still the live one.
async fn write_secret(
    ctx: &Context<State>,
    secrets: &Api<Secret>,
    db: &Database,
    existing: Option<&Secret>,
    desired: &Secret,
) -> Result<()> {
    if existing.is_some_and(|s| secret::is_current(s, desired)) {
        return Ok(());
    }
    confirm_live(ctx, db).await?;
    match existing {
        // A new Secret: a plain create costs the apiserver less than an apply.
        None => match secrets.create(&PostParams::default(), desired).await {
            Ok(_) => Ok(()),
            // Not in the cache, yet there: written only if it is this Database's own.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = secrets.get(&db.connection_secret_name()).await?;
                secret::check_ours(&found, db).map_err(secret_conflict)?;
                apply_secret(secrets, db, &found, desired).await
            }
            Err(e) => Err(e.into()),
        },
        Some(found) => apply_secret(secrets, db, found, desired).await,
    }
}

/// Server-side apply of the Secret: takes back every field this controller sets. Only
/// over `found`, the Secret checked to be this Database's: its UID is a precondition (a
/// Secret of that name made since by someone else is refused, never taken over).
async fn apply_secret(
    secrets: &Api<Secret>,
    db: &Database,
    found: &Secret,
    desired: &Secret,
) -> Result<()> {
    let mut desired = desired.clone();
    desired.metadata.uid = found.metadata.uid.clone();
    secrets
        .patch(
            &db.connection_secret_name(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await?;
    Ok(())
}

impl Error {
    /// A copy for the status (kube and SQL errors keep their message only).
    pub(crate) fn clone_for_status(&self) -> Error {
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

    #[test]
    fn a_reconcile_acts_only_for_the_live_database_of_its_name() {
        let mut held = (*on_server("orders", "2026-11-23T10:00:00Z", None)).clone();
        held.metadata.generation = Some(1);
        // Still the live one (its status may have moved on): nothing to say.
        let mut live = held.clone();
        live.metadata.resource_version = Some("42".into());
        assert_eq!(superseded(&held, Some(&live)), None);
        // Gone.
        let gone = superseded(&held, None).unwrap();
        assert!(
            gone.contains("uid-orders") && gone.contains("gone"),
            "{gone}"
        );
        // Deleted and created again with the same name: another UID.
        let mut successor = held.clone();
        successor.metadata.uid = Some("uid-successor".into());
        let replaced = superseded(&held, Some(&successor)).unwrap();
        assert!(replaced.contains("uid-successor"), "{replaced}");
        // Being deleted since.
        let mut deleting = held.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(superseded(&held, Some(&deleting)).is_some());
        // Its spec changed since: the next reconcile acts on the new generation.
        let mut changed = held.clone();
        changed.metadata.generation = Some(2);
        assert!(superseded(&held, Some(&changed)).is_some_and(|m| m.contains("generation 2")));
    }

    #[test]
    fn a_verification_is_recent_only_for_its_generation_and_window() {
        let verified = Verified::default();
        let p = Provisioned {
            provider_id: "h:5432/1".into(),
            server_version: "15".into(),
            server: "pg-main".into(),
            endpoint: "h:5432".into(),
            size_bytes: 0,
            size_limit: None,
            logins: crate::owner_logins::Logins::default(),
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
            written.statuses.is_empty(),
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
        let left: Vec<String> = written.statuses.uids();
        assert_eq!(left, ["uid-db-0"], "only the write the cache has not shown");
    }
}
