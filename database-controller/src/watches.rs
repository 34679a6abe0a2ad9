//! What wakes the controllers in this process, besides their own objects: each watch and
//! its mapper, a named function from the object that changed to the objects to reconcile.
//!
//! The kinds two controllers of the process follow are watched once ([`Watches`]: one
//! watch each of Databases, DatabaseUsers, DatabaseServers and Migrations, which every
//! controller subscribes to), and the mappers that would otherwise scan every Database at
//! every change read an index instead ([`Indexes`]).
//!
//! Databases ([`databases`]): their connection Secrets (the watches of `tenant_secrets`,
//! through [`split_by_owner`]), DatabaseServers ([`on_server`]: a new generation or
//! readiness), namespaces ([`not_ready_in`]: labels may now match `allowedNamespaces`),
//! other Databases ([`over_quota_beside`]: one that goes may make room under a quota),
//! Migrations ([`of_migration`]) and Backups ([`of_backup`]: final snapshots, restores).
//! DatabaseUsers ([`users`]): their connection Secrets and their Databases ([`users_of`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dbops_api::reasons::DatabaseReason;
use dbops_api::{Backup, Database, DatabaseServer, DatabaseUser, Migration, condition};
use dbops_shared::conditions;
use dbops_shared::controller::{self, Context, Running};
use dbops_shared::shared_watch::{Index, SharedWatch, WatchTask};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::ResourceExt;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};

use crate::restore;
use crate::state::State;

/// A stream of connection Secrets' changes.
pub type SecretEvents = futures::stream::BoxStream<'static, Result<Secret, watcher::Error>>;

/// The process's one watch of each kind that more than one of its controllers follows.
pub struct Watches {
    pub databases: SharedWatch<Database>,
    pub users: SharedWatch<DatabaseUser>,
    pub migrations: SharedWatch<Migration>,
    pub indexes: Indexes,
}

/// The answers the mappers need, kept as the watches go (none scans the store).
#[derive(Clone)]
pub struct Indexes {
    /// Databases that are not Ready, by namespace.
    pub not_ready: Index<Database>,
    /// Databases a server's quota refused, by namespace.
    pub over_quota: Index<Database>,
    /// Databases still to be restored, by `<namespace>/<backup>`.
    pub restoring: Index<Database>,
    /// DatabaseUsers by `<namespace>/<database>`.
    pub users: Index<DatabaseUser>,
    /// Migrations by `<namespace>/<database>`.
    pub migrations: Index<Migration>,
}

fn ready(db: &Database) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    db.status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, condition::READY))
}

fn namespace_of(db: &Database) -> Vec<String> {
    db.metadata.namespace.clone().into_iter().collect()
}

impl Watches {
    /// The watches (nothing runs before [`Watches::start`]). DatabaseServers, the
    /// Secrets of the controllers' namespace and namespaces are the `Directory`'s.
    pub fn new(run: &Running) -> Self {
        let databases = run.shared_watch::<Database>(watcher::Config::default());
        let users = run.shared_watch::<DatabaseUser>(watcher::Config::default());
        let migrations = run.shared_watch::<Migration>(watcher::Config::default());
        let indexes = Indexes {
            not_ready: databases.index(|db| {
                if ready(db).is_some_and(|c| c.status == "True") {
                    Vec::new()
                } else {
                    namespace_of(db)
                }
            }),
            over_quota: databases.index(|db| {
                if ready(db).is_some_and(|c| c.reason == DatabaseReason::QuotaExceeded) {
                    namespace_of(db)
                } else {
                    Vec::new()
                }
            }),
            restoring: databases.index(|db| {
                match (db.backup_to_restore(), &db.metadata.namespace) {
                    (Some(backup), Some(ns))
                        if db.status.as_ref().is_none_or(|s| s.provider_id.is_none()) =>
                    {
                        vec![format!("{ns}/{backup}")]
                    }
                    _ => Vec::new(),
                }
            }),
            users: users.index(|u| {
                vec![format!(
                    "{}/{}",
                    u.metadata.namespace.as_deref().unwrap_or_default(),
                    u.spec.database_ref.name
                )]
            }),
            migrations: migrations.index(|m| {
                vec![format!(
                    "{}/{}",
                    m.metadata.namespace.as_deref().unwrap_or_default(),
                    m.spec.database_ref.name
                )]
            }),
        };
        Self {
            databases,
            users,
            migrations,
            indexes,
        }
    }

    /// Runs the watches; they end when the tasks are dropped.
    pub fn start(&self) -> [WatchTask; 3] {
        [
            self.databases.start(),
            self.users.start(),
            self.migrations.start(),
        ]
    }
}

/// The Database controller's watches: its connection Secrets (`secrets`), DatabaseServers,
/// namespaces, other Databases, Migrations and Backups. Sets the state's caches of
/// Databases and Migrations.
pub fn databases(
    c: Controller<Database>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    secrets: SecretEvents,
    w: &Watches,
) -> Controller<Database> {
    let client = ctx.client.clone();
    let databases = c.store();
    let _ = ctx.state.databases.set(databases.clone());
    let _ = ctx.state.migrations.set(w.migrations.store());
    let seen = Arc::new(ServersSeen::default());
    let (not_ready, over_quota, restoring, awaiting) = (
        w.indexes.not_ready.clone(),
        w.indexes.over_quota.clone(),
        w.indexes.restoring.clone(),
        w.indexes.restoring.clone(),
    );
    let directory = &ctx.state.directory;
    let c = match ctx.state.restorer.identities_secret.clone() {
        Some(name) => c.watches_shared_stream(
            directory
                .secrets_watch()
                .touched()
                .filter(move |s| std::future::ready(s.metadata.name.as_deref() == Some(&*name))),
            move |_: Arc<Secret>| awaiting_restore(&awaiting),
        ),
        None => c,
    };
    // A clone that waited for a place on its server, when one comes back.
    let c = match ctx.state.clones.wakes() {
        Some(wakes) => {
            c.reconcile_on(wakes.map(|(namespace, name)| ObjectRef::new(&name).within(&namespace)))
        }
        None => c,
    };
    c.owns_stream(secrets)
        .watches_shared_stream(
            directory.servers_watch().touched(),
            move |server: Arc<DatabaseServer>| on_server(&server, &databases, &seen),
        )
        .watches_shared_stream(
            directory.namespaces_watch().touched(),
            move |ns: Arc<PartialObjectMeta<Namespace>>| not_ready_in(&ns.name_any(), &not_ready),
        )
        .watches_shared_stream(w.databases.touched(), move |db: Arc<Database>| {
            over_quota_beside(&db, &over_quota)
        })
        .watches_shared_stream(w.migrations.touched(), |m: Arc<Migration>| {
            Some(of_migration(&m))
        })
        .watches_stream(
            controller::trigger(
                controller::scoped_api::<Backup>(client, namespace),
                watcher::Config::default(),
            ),
            move |b: Backup| of_backup(&b, &restoring),
        )
}

/// What each DatabaseServer last showed its Databases: generation, Ready (status and
/// reason), being deleted, what its admin may do.
type ServerView = (
    Option<i64>,
    Option<(String, String)>,
    bool,
    Option<dbops_api::ServerCapabilities>,
    Option<String>,
);

#[derive(Default)]
struct ServersSeen(Mutex<HashMap<String, ServerView>>);

/// A DatabaseServer → its Databases, only when its generation, readiness, deletion,
/// admin's capabilities or pooler changed: the count in its status changes with every Database
/// and must not wake them all. The one mapper that scans the store: it runs on those rare
/// changes only, and an index of every Database by server would cost each Database its
/// memory for them.
fn on_server(
    server: &DatabaseServer,
    databases: &Store<Database>,
    seen: &ServersSeen,
) -> Vec<ObjectRef<Database>> {
    let name = server.name_any();
    let ready = server.status.as_ref().and_then(|s| {
        conditions::get(&s.conditions, condition::READY)
            .map(|c| (c.status.clone(), c.reason.clone()))
    });
    let now = (
        server.metadata.generation,
        ready,
        server.metadata.deletion_timestamp.is_some(),
        server.status.as_ref().and_then(|s| s.capabilities.clone()),
        // The pooler's host: its connection Secret keys come and go with it.
        server
            .status
            .as_ref()
            .and_then(|s| s.pooler.as_ref())
            .map(|p| p.host.clone()),
    );
    let changed = {
        let mut seen = seen.0.lock().unwrap_or_else(|e| e.into_inner());
        seen.insert(name.clone(), now.clone()) != Some(now)
    };
    if !changed {
        return Vec::new();
    }
    databases
        .state()
        .iter()
        .filter(|db| db.spec.server_ref.name == name)
        .map(|db| ObjectRef::from_obj(db.as_ref()))
        .collect()
}

/// A namespace → its Databases that are not Ready: its labels may now match a server's
/// allowedNamespaces.
fn not_ready_in(namespace: &str, not_ready: &Index<Database>) -> Vec<ObjectRef<Database>> {
    not_ready
        .get(namespace)
        .iter()
        .map(|db| ObjectRef::from_obj(db.as_ref()))
        .collect()
}

/// A Database that changed (or went) → the others of its namespace refused by a server's
/// quota: it may have made room for them.
fn over_quota_beside(db: &Database, over_quota: &Index<Database>) -> Vec<ObjectRef<Database>> {
    let namespace = db.metadata.namespace.clone().unwrap_or_default();
    over_quota
        .get(&namespace)
        .iter()
        .filter(|other| other.uid() != db.uid())
        .map(|other| ObjectRef::from_obj(other.as_ref()))
        .collect()
}

/// A Migration → the Database it moves (`MigrationInProgress`, its freeze).
fn of_migration(m: &Migration) -> ObjectRef<Database> {
    ObjectRef::new(&m.spec.database_ref.name).within(&m.namespace().unwrap_or_default())
}

/// A Backup → the Database it is the final snapshot of, and the Databases waiting to be
/// restored from it.
fn of_backup(b: &Backup, restoring: &Index<Database>) -> Vec<ObjectRef<Database>> {
    let (namespace, name) = (b.namespace().unwrap_or_default(), b.name_any());
    let final_of = b
        .labels()
        .contains_key(dbops_api::names::label::FINAL_SNAPSHOT_OF)
        .then(|| ObjectRef::new(&b.spec.database_ref.name).within(&namespace));
    let restoring = restoring
        .get(&format!("{namespace}/{name}"))
        .into_iter()
        .filter(|db| restore::waits_for(db, &namespace, &name))
        .map(|db| ObjectRef::from_obj(db.as_ref()));
    final_of.into_iter().chain(restoring).collect()
}

/// A change of the identities → the Databases still to be restored (one that waits with
/// `DecryptionKeyMissing` is tried again at once, not at its resync).
fn awaiting_restore(restoring: &Index<Database>) -> Vec<ObjectRef<Database>> {
    restoring
        .all()
        .iter()
        .map(|db| ObjectRef::from_obj(db.as_ref()))
        .collect()
}

/// The connection Secrets' changes split in two: those owned by a DatabaseUser, and the
/// rest (a Database's). A bounded channel each; a full one waits (the watch slows down
/// rather than losing an event).
pub fn split_by_owner(
    secrets: impl Stream<Item = Result<Secret, watcher::Error>> + Send + 'static,
) -> (SecretEvents, SecretEvents) {
    let (to_dbs, dbs) = tokio::sync::mpsc::channel(256);
    let (to_users, users) = tokio::sync::mpsc::channel(256);
    tokio::spawn(async move {
        let mut secrets = std::pin::pin!(secrets);
        while let Some(event) = secrets.next().await {
            let of_user = event.as_ref().is_ok_and(|s| {
                s.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|r| r.kind == "DatabaseUser")
            });
            let sent = if of_user {
                to_users.send(event).await
            } else {
                to_dbs.send(event).await
            };
            if sent.is_err() {
                break;
            }
        }
    });
    let stream = |mut rx: tokio::sync::mpsc::Receiver<_>| -> SecretEvents {
        Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
    };
    (stream(dbs), stream(users))
}

/// The DatabaseUsers' watches: their connection Secrets, and their Databases (any
/// change, status included, maps to the Database's users).
pub fn users(
    c: Controller<DatabaseUser>,
    secrets: SecretEvents,
    w: &Watches,
) -> Controller<DatabaseUser> {
    let users = w.indexes.users.clone();
    c.owns_stream(secrets)
        .watches_shared_stream(w.databases.touched(), move |db: Arc<Database>| {
            users_of(&db, &users)
        })
}

/// A Database → its DatabaseUsers.
fn users_of(db: &Database, users: &Index<DatabaseUser>) -> Vec<ObjectRef<DatabaseUser>> {
    let (namespace, name) = (db.namespace().unwrap_or_default(), db.name_any());
    users
        .get(&format!("{namespace}/{name}"))
        .iter()
        .map(|u| ObjectRef::from_obj(u.as_ref()))
        .collect()
}
