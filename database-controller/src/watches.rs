//! What wakes the controllers in this process, besides their own objects: each watch and
//! its mapper, a named function from the object that changed to the objects to reconcile.
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
use dbops_shared::controller::{self, Context};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

use crate::restore;
use crate::state::State;

/// A stream of connection Secrets' changes.
pub type SecretEvents = futures::stream::BoxStream<'static, Result<Secret, watcher::Error>>;

/// Runs a watch that only fills a store, for the life of the process: a failure is
/// logged (the client tells the watch health) and retried with backoff.
fn in_background<T: Send + 'static>(
    watch: &'static str,
    events: impl Stream<Item = Result<T, watcher::Error>> + Send + 'static,
) {
    tokio::spawn(events.for_each(move |event| {
        if let Err(error) = &event {
            tracing::warn!(%error, watch, "watch failed; retrying with backoff");
        }
        std::future::ready(())
    }));
}

/// Every Migration in a store (set in the state), so a reconcile asks "is one running?"
/// without a list.
fn keep_migrations(ctx: &Context<State>, namespace: Option<&str>) {
    let (reader, writer) = reflector::store();
    let _ = ctx.state.migrations.set(reader);
    let migrations = reflector(
        writer,
        watcher(
            controller::scoped_api::<Migration>(ctx.client.clone(), namespace),
            watcher::Config::default(),
        ),
    )
    .default_backoff();
    in_background("Migration", migrations);
}

/// The Databases' metadata (the namespace, name and uid are all a mapper needs, and a
/// second full copy of every Database in flight would cost memory for nothing).
fn database_metadata(
    client: &Client,
    namespace: Option<&str>,
) -> impl Stream<Item = Result<PartialObjectMeta<Database>, watcher::Error>> + Send + 'static {
    watcher(
        controller::scoped_api::<PartialObjectMeta<Database>>(client.clone(), namespace),
        watcher::Config::default().page_size(controller::LIST_PAGE_SIZE),
    )
    .default_backoff()
    .touched_objects()
}

/// The Database controller's watches: its connection Secrets (`secrets`), DatabaseServers,
/// namespaces, other Databases, Migrations and Backups. Sets the state's caches of
/// Databases and Migrations.
pub fn databases(
    c: Controller<Database>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    secrets: SecretEvents,
) -> Controller<Database> {
    let client = ctx.client.clone();
    let databases = c.store();
    let _ = ctx.state.databases.set(databases.clone());
    keep_migrations(ctx, namespace);
    let seen = Arc::new(ServersSeen::default());
    let (on, waiting, over_quota, restoring, keyed) = (
        databases.clone(),
        databases.clone(),
        databases.clone(),
        databases.clone(),
        databases,
    );
    let c = match &ctx.state.restorer.identities_secret {
        Some(name) => c.watches_stream(
            identities_secret(&client, ctx.state.directory.controller_namespace(), name),
            move |_: Secret| awaiting_restore(&keyed),
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
        .watches_stream(
            controller::trigger(
                Api::<DatabaseServer>::all(client.clone()),
                ctx.state.directory.server_config(),
            ),
            move |server: DatabaseServer| on_server(&server, &on, &seen),
        )
        .watches_stream(
            watcher(
                Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
                watcher::Config::default(),
            )
            .default_backoff()
            .touched_objects(),
            move |ns: PartialObjectMeta<Namespace>| not_ready_in(&ns.name_any(), &waiting),
        )
        .watches_stream(
            database_metadata(&client, namespace),
            move |db: PartialObjectMeta<Database>| over_quota_beside(&db, &over_quota),
        )
        .watches_stream(
            controller::trigger(
                controller::scoped_api::<Migration>(client.clone(), namespace),
                watcher::Config::default(),
            ),
            |m: Migration| Some(of_migration(&m)),
        )
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
/// and must not wake them all.
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
fn not_ready_in(namespace: &str, databases: &Store<Database>) -> Vec<ObjectRef<Database>> {
    databases
        .state()
        .iter()
        .filter(|db| db.metadata.namespace.as_deref() == Some(namespace))
        .filter(|db| {
            !db.status
                .as_ref()
                .is_some_and(|s| conditions::is_true(&s.conditions, condition::READY))
        })
        .map(|db| ObjectRef::from_obj(db.as_ref()))
        .collect()
}

/// A Database that changed (or went) → the others of its namespace refused by a server's
/// quota: it may have made room for them.
fn over_quota_beside(
    db: &PartialObjectMeta<Database>,
    databases: &Store<Database>,
) -> Vec<ObjectRef<Database>> {
    let namespace = db.metadata.namespace.clone().unwrap_or_default();
    databases
        .state()
        .iter()
        .filter(|other| {
            other.metadata.namespace.as_deref() == Some(namespace.as_str())
                && other.uid() != db.uid()
                && other.status.as_ref().is_some_and(|s| {
                    conditions::get(&s.conditions, condition::READY)
                        .is_some_and(|c| c.reason == DatabaseReason::QuotaExceeded)
                })
        })
        .map(|other| ObjectRef::from_obj(other.as_ref()))
        .collect()
}

/// A Migration → the Database it moves (`MigrationInProgress`, its freeze).
fn of_migration(m: &Migration) -> ObjectRef<Database> {
    ObjectRef::new(&m.spec.database_ref.name).within(&m.namespace().unwrap_or_default())
}

/// A Backup → the Database it is the final snapshot of, and the Databases waiting to be
/// restored from it.
fn of_backup(b: &Backup, databases: &Store<Database>) -> Vec<ObjectRef<Database>> {
    let (namespace, name) = (b.namespace().unwrap_or_default(), b.name_any());
    let final_of = b
        .labels()
        .contains_key(dbops_api::names::label::FINAL_SNAPSHOT_OF)
        .then(|| ObjectRef::new(&b.spec.database_ref.name).within(&namespace));
    let restoring = databases
        .state()
        .into_iter()
        .filter(|db| restore::waits_for(db, &namespace, &name))
        .map(|db| ObjectRef::from_obj(db.as_ref()));
    final_of.into_iter().chain(restoring).collect()
}

/// The Secret of `--backup-identities-secret` (by name, in the controllers' namespace):
/// the keys that open encrypted artifacts.
fn identities_secret(
    client: &kube::Client,
    controller_namespace: &str,
    name: &str,
) -> impl Stream<Item = Result<Secret, watcher::Error>> + Send + 'static {
    controller::trigger(
        Api::<Secret>::namespaced(client.clone(), controller_namespace),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
}

/// A change of the identities → the Databases still to be restored (one that waits with
/// `DecryptionKeyMissing` is tried again at once, not at its resync).
fn awaiting_restore(databases: &Store<Database>) -> Vec<ObjectRef<Database>> {
    databases
        .state()
        .into_iter()
        .filter(|db| {
            db.backup_to_restore().is_some()
                && db.status.as_ref().is_none_or(|s| s.provider_id.is_none())
        })
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

/// The DatabaseUsers' watches: their connection Secrets, and their Databases (metadata
/// only: any change, status included, maps to the Database's users).
pub fn users(
    c: Controller<DatabaseUser>,
    client: &Client,
    namespace: Option<&str>,
    secrets: SecretEvents,
) -> Controller<DatabaseUser> {
    let users = c.store();
    c.owns_stream(secrets).watches_stream(
        database_metadata(client, namespace),
        move |db: PartialObjectMeta<Database>| users_of(&db, &users),
    )
}

/// A Database → its DatabaseUsers.
fn users_of(
    db: &PartialObjectMeta<Database>,
    users: &Store<DatabaseUser>,
) -> Vec<ObjectRef<DatabaseUser>> {
    let (namespace, name) = (db.namespace().unwrap_or_default(), db.name_any());
    users
        .state()
        .iter()
        .filter(|u| {
            u.metadata.namespace.as_deref() == Some(namespace.as_str())
                && u.spec.database_ref.name == name
        })
        .map(|u| ObjectRef::from_obj(u.as_ref()))
        .collect()
}
