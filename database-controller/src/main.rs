//! dbops database-controller: turns each `Database` (dbops.dev/v1alpha1) into a role, a
//! database, its extensions and settings on the PostgreSQL server its `spec.serverRef`
//! names, and a connection Secret `<name>-connection`; repairs drift every
//! `--resync-interval`; reports a vanished database without re-creating it; and on
//! deletion does what `spec.deletionPolicy` says (Retain, Delete, or Snapshot: a final
//! Backup, then drop). A second controller in the process, `server` (`server-controller`),
//! probes each DatabaseServer and keeps it while Databases are on it.
//!
//! Watches: Databases; the connection Secrets it owns (label
//! `app.kubernetes.io/managed-by=dbops`: no other tenant Secret is cached), one watch per
//! namespace where a Database needs them, through a RoleBinding it makes there
//! (`tenant_secrets`: its token reads no Secret anywhere else); DatabaseServers
//! (`--server-selector`; a change of generation or readiness maps to the server's
//! Databases); namespaces' labels (a change maps to the namespace's Databases that are not
//! Ready, for `allowedNamespaces`); Migrations (their Database gets `MigrationInProgress`
//! and its freeze is not "repaired"); and final snapshot Backups (label
//! `dbops.dev/final-snapshot-of=<Database uid>`) and Backups that a Database waits to be
//! restored from (`spec.restoreFrom`). Admin and CA Secrets are read from a cache of the
//! controllers' own namespace (`--controller-namespace`) only.

mod admit;
mod connection;
mod delete;
mod error;
mod finalizer;
mod limits;
mod live;
mod owner_logins;
mod plan;
mod provision;
mod reconcile;
mod restore;
mod rotation;
mod secret;
mod server;
mod server_access;
mod sql;
mod state;
mod status;
mod template;
mod tenant_secrets;
mod user;

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};

use clap::Parser;
use dbops_api::{Backup, Database, DatabaseServer, DatabaseUser, Migration};
use dbops_shared::cli::{BackupStoreArgs, CommonArgs, PostgresArgs};
use dbops_shared::controller::{self, Context, ControllerError, Process, Trigger};
use dbops_shared::events::Recorder;
use dbops_shared::telemetry;
use dbops_shared::watch_health::WatchHealth;
use futures::StreamExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::{self, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};

use dbops_shared::server::Directory;
use k8s_openapi::api::core::v1::Namespace;
use kube::core::PartialObjectMeta;

use crate::state::{State, Verified, Written};

/// The controller name: metrics label, Lease `dbops-database-controller`, Event reporter.
const CONTROLLER: &str = "database-controller";

#[derive(Parser, Debug)]
#[command(
    name = "dbops-database-controller",
    version,
    about = "Reconciles dbops.dev Database objects"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    #[command(flatten)]
    postgres: PostgresArgs,

    #[command(flatten)]
    store: BackupStoreArgs,

    /// The pg_restore program (a path, or a name looked up in PATH); its major version
    /// must be at least the one of the pg_dump that made the artifact.
    #[arg(long, env = "DBOPS_PG_RESTORE", default_value = "pg_restore")]
    pg_restore: std::path::PathBuf,

    /// Directories of more pg_restore programs, one major each (for example
    /// `/usr/lib/postgresql/13/bin,...,/usr/lib/postgresql/18/bin`): each restore takes
    /// one that reads the artifact and whose settings the server has.
    #[arg(long = "pg-bin-dir", env = "DBOPS_PG_BIN_DIRS", value_delimiter = ',')]
    pg_bin_dirs: Vec<std::path::PathBuf>,

    /// How many DatabaseServers are probed at the same time (at least 1): the server
    /// controller's own concurrency (its backoff is its own too).
    #[arg(long, env = "DBOPS_SERVER_CONCURRENCY", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(1..))]
    server_concurrency: u16,

    /// The ServiceAccount this process runs as, `<namespace>/<name>` or `<name>` (in
    /// `--controller-namespace`): the subject of the RoleBindings
    /// `dbops-database-controller-tenant-secrets` that let it reach the connection Secrets
    /// of the namespaces where Databases need them. When absent, the apiserver is asked
    /// who the process's credentials are; credentials that are no ServiceAccount (a
    /// user's kubeconfig) get no RoleBinding.
    #[arg(long, env = "DBOPS_SERVICE_ACCOUNT", value_parser = tenant_secrets::ServiceAccountArg::parse)]
    service_account: Option<tenant_secrets::ServiceAccountArg>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _telemetry = match telemetry::init("dbops-database-controller", &args.common) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("dbops-database-controller: {error}");
            return ExitCode::FAILURE;
        }
    };
    controller::exit_code(run(args).await)
}

/// Two controllers, until SIGTERM: Databases (with the watches of [`watches`]) and the
/// server controller (`server`), which probes each DatabaseServer and keeps it while
/// Databases are on it. Both read one Directory of the servers, the Database store and the
/// Migration store.
async fn run(args: Args) -> Result<(), ControllerError> {
    let process = Process::start::<Database>(CONTROLLER, &args.common).await?;
    // Checked before the controllers start: the store restores read is writable and the
    // one the backup-controller writes (registered in the ConfigMap dbops-backup-store).
    let store = args.store.backup_store.clone();
    // The servers' caches fill while the backup store is checked and the Lease is taken.
    let directory = Directory::for_process(process.client(), &args.common);
    let service_account = args
        .service_account
        .as_ref()
        .map(|a| a.in_namespace(&args.common.controller_namespace));
    process
        .run(Some(&store), |run| async move {
            let client = run.client().clone();
            let servers = Arc::new(args.postgres.servers());
            // Filled by `watches` below.
            let databases: Arc<OnceLock<reflector::Store<Database>>> = Arc::default();
            let migrations: Arc<OnceLock<reflector::Store<Migration>>> = Arc::default();
            // Only while leading: the state (and the watches in it) goes with the lead.
            let tenants = tenant_secrets::TenantSecrets::new(
                client.clone(),
                directory.clone(),
                databases.clone(),
                run.namespace(),
                service_account,
            );
            let state = State {
                servers: servers.clone(),
                directory: directory.clone(),
                recorder: Recorder::new(client.clone(), controller::reporter(CONTROLLER)),
                migrations: migrations.clone(),
                verified: Verified::default(),
                written: Written::default(),
                databases: databases.clone(),
                tenants: tenants.clone(),
                last_prune: std::sync::Mutex::new(None),
                sizes: std::sync::Mutex::default(),
                restorer: restore::Restorer {
                    store: args.store.backup_store,
                    clients: dbops_shared::pg_tools::Clients::new(
                        None,
                        Some(args.pg_restore),
                        &args.pg_bin_dirs,
                    ),
                },
            };
            let ctx = run.context(CONTROLLER, state);
            // The connection Secrets' changes, to the Database or the DatabaseUser that
            // owns each.
            let (db_secrets, user_secrets) = split_by_owner(tenants.triggers());
            // Status writes are the controller's own; Secrets, admin Secrets, Migrations
            // and final Backups have watches of their own, and the resync requeues.
            // Annotations too: `dbops.dev/rotate` asks for a rotation of the owner's password.
            let dbs = run.controller(watcher::Config::default(), Trigger::GenerationOrAnnotations);
            let dbs = watches(dbs, &ctx, run.namespace(), db_secrets);

            // DatabaseUsers: a new generation or annotation (`dbops.dev/rotate`) of their
            // own, any change of their Database, their connection Secrets.
            let user_state = user::State {
                servers: servers.clone(),
                directory: directory.clone(),
                recorder: Recorder::new(client.clone(), controller::reporter(user::CONTROLLER)),
                databases: databases.clone(),
                tenants: tenants.clone(),
                written: dbops_shared::memo::Memo::default(),
            };
            let user_ctx = run.context(user::CONTROLLER, user_state);
            let users = run.controller::<DatabaseUser>(
                watcher::Config::default(),
                Trigger::GenerationOrAnnotations,
            );
            let users = user_watches(users, &client, run.namespace(), user_secrets);

            let recorder = Recorder::new(client, controller::reporter(server::CONTROLLER));
            let server_state =
                server::State::new(directory.clone(), servers, recorder, databases, migrations);
            let server_ctx = run.context(server::CONTROLLER, server_state);
            let concurrency = args.server_concurrency;
            let dbservers = run
                .controller(directory.server_config(), Trigger::GenerationChange)
                .with_config(kube::runtime::controller::Config::default().concurrency(concurrency));
            let dbservers = server::watches(dbservers, &server_ctx, &directory, run.namespace());

            // The tenant namespaces' set-ups follow the Databases for as long as the two
            // controllers run (they end on SIGTERM or a lost Lease).
            tokio::select! {
                _ = async {
                    tokio::join!(
                        run.drive(dbs, ctx, reconcile::reconcile),
                        run.drive(dbservers, server_ctx, server::reconcile),
                        run.drive(users, user_ctx, user::reconcile),
                    )
                } => {}
                () = tenants.follow() => {}
            }
        })
        .await
}

/// Runs a watch that only fills a store, for the life of the process: a failure is
/// logged and counted in the process's watch health, and retried with backoff.
fn in_background<T: Send + 'static>(
    watch: &'static str,
    events: impl futures::Stream<Item = Result<T, watcher::Error>> + Send + 'static,
) {
    tokio::spawn(events.for_each(move |event| {
        if let Err(error) = &event {
            tracing::warn!(%error, watch, "watch failed; retrying with backoff");
        }
        WatchHealth::process().observe(watch, &event);
        std::future::ready(())
    }));
}

/// Owned connection Secrets (the watches of `tenant_secrets`), DatabaseServers,
/// namespaces, Migrations and final snapshot Backups.
fn watches(
    c: kube::runtime::Controller<Database>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    secrets: impl futures::Stream<Item = Result<k8s_openapi::api::core::v1::Secret, watcher::Error>>
    + Send
    + 'static,
) -> kube::runtime::Controller<Database> {
    let client = ctx.client.clone();
    let databases = c.store();
    let _ = ctx.state.databases.set(databases.clone());

    // Every Migration in a store, so a reconcile asks "is one running?" without a list.
    let (reader, writer) = reflector::store();
    let _ = ctx.state.migrations.set(reader);
    let migrations = reflector(
        writer,
        watcher(
            controller::scoped_api::<Migration>(client.clone(), namespace),
            watcher::Config::default(),
        ),
    )
    .default_backoff();
    in_background("Migration", migrations);
    let on_server = databases.clone();
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let in_namespace = databases.clone();
    let waiting = databases.clone();
    let over_quota = databases.clone();
    // The connection Secrets, watched in each namespace where Databases need them.
    c.owns_stream(secrets)
        .watches(
            Api::<DatabaseServer>::all(client.clone()),
            ctx.state.directory.server_config(),
            move |server: DatabaseServer| {
                // Only a new generation or readiness concerns the Databases: the count in
                // the status changes with every Database and must not wake them all.
                let name = server.metadata.name.clone().unwrap_or_default();
                let ready = server.status.as_ref().and_then(|s| {
                    dbops_shared::conditions::get(&s.conditions, dbops_api::condition::READY)
                        .map(|c| (c.status.clone(), c.reason.clone()))
                });
                let now = (
                    server.metadata.generation,
                    ready,
                    server.metadata.deletion_timestamp.is_some(),
                );
                let changed = {
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    seen.insert(name.clone(), now.clone()) != Some(now)
                };
                let hit: Vec<ObjectRef<Database>> = if changed {
                    on_server
                        .state()
                        .iter()
                        .filter(|db| db.spec.server_ref.name == name)
                        .map(|db| ObjectRef::from_obj(db.as_ref()))
                        .collect()
                } else {
                    Vec::new()
                };
                hit
            },
        )
        .watches_stream(
            watcher(
                Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
                watcher::Config::default(),
            )
            .default_backoff()
            .touched_objects(),
            move |ns: PartialObjectMeta<Namespace>| {
                // A namespace's labels may now match a server's allowedNamespaces.
                let name = ns.metadata.name.clone().unwrap_or_default();
                let refused: Vec<ObjectRef<Database>> = in_namespace
                    .state()
                    .iter()
                    .filter(|db| db.metadata.namespace.as_deref() == Some(name.as_str()))
                    .filter(|db| {
                        !db.status.as_ref().is_some_and(|s| {
                            dbops_shared::conditions::is_true(
                                &s.conditions,
                                dbops_api::condition::READY,
                            )
                        })
                    })
                    .map(|db| ObjectRef::from_obj(db.as_ref()))
                    .collect();
                refused
            },
        )
        .watches_stream(
            // Metadata only: the namespace and uid are all it needs, and a second full
            // copy of every Database in flight would cost memory for nothing.
            watcher(
                controller::scoped_api::<PartialObjectMeta<Database>>(client.clone(), namespace),
                watcher::Config::default().page_size(controller::LIST_PAGE_SIZE),
            )
            .default_backoff()
            .touched_objects(),
            move |db: PartialObjectMeta<Database>| {
                // A Database that goes (or moves) may make room under a server's quota for
                // the ones refused in its namespace.
                let ns = db.metadata.namespace.clone().unwrap_or_default();
                let waiting: Vec<ObjectRef<Database>> = over_quota
                    .state()
                    .iter()
                    .filter(|other| {
                        other.metadata.namespace.as_deref() == Some(ns.as_str())
                            && other.uid() != db.uid()
                            && other.status.as_ref().is_some_and(|s| {
                                dbops_shared::conditions::get(
                                    &s.conditions,
                                    dbops_api::condition::READY,
                                )
                                .is_some_and(|c| c.reason == "QuotaExceeded")
                            })
                    })
                    .map(|other| ObjectRef::from_obj(other.as_ref()))
                    .collect();
                waiting
            },
        )
        .watches(
            controller::scoped_api::<Migration>(client.clone(), namespace),
            watcher::Config::default(),
            |m: Migration| {
                let ns = m.metadata.namespace.clone().unwrap_or_default();
                Some(ObjectRef::new(&m.spec.database_ref.name).within(&ns))
            },
        )
        .watches(
            controller::scoped_api::<Backup>(client.clone(), namespace),
            watcher::Config::default(),
            move |b: Backup| {
                let ns = b.metadata.namespace.clone().unwrap_or_default();
                let name = b.metadata.name.clone().unwrap_or_default();
                // The Database this final snapshot is for ...
                let final_of = b
                    .labels()
                    .contains_key(dbops_api::marks::FINAL_SNAPSHOT_OF)
                    .then(|| ObjectRef::new(&b.spec.database_ref.name).within(&ns));
                // ... and the Databases waiting to be restored from it.
                let restoring: Vec<ObjectRef<Database>> = waiting
                    .state()
                    .iter()
                    .filter(|db| restore::waits_for(db, &ns, &name))
                    .map(|db| ObjectRef::from_obj(db.as_ref()))
                    .collect();
                final_of.into_iter().chain(restoring)
            },
        )
}

type SecretEvents =
    futures::stream::BoxStream<'static, Result<k8s_openapi::api::core::v1::Secret, watcher::Error>>;

/// The connection Secrets' changes split in two: those owned by a DatabaseUser, and the
/// rest (a Database's). A bounded channel each; a full one waits (the watch slows down
/// rather than losing an event).
fn split_by_owner(
    secrets: impl futures::Stream<Item = Result<k8s_openapi::api::core::v1::Secret, watcher::Error>>
    + Send
    + 'static,
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
fn user_watches(
    c: kube::runtime::Controller<DatabaseUser>,
    client: &kube::Client,
    namespace: Option<&str>,
    secrets: SecretEvents,
) -> kube::runtime::Controller<DatabaseUser> {
    let users = c.store();
    c.owns_stream(secrets).watches_stream(
        watcher(
            controller::scoped_api::<PartialObjectMeta<Database>>(client.clone(), namespace),
            watcher::Config::default().page_size(controller::LIST_PAGE_SIZE),
        )
        .default_backoff()
        .touched_objects(),
        move |db: PartialObjectMeta<Database>| {
            let ns = db.metadata.namespace.clone().unwrap_or_default();
            let name = db.metadata.name.clone().unwrap_or_default();
            let hit: Vec<ObjectRef<DatabaseUser>> = users
                .state()
                .iter()
                .filter(|u| {
                    u.metadata.namespace.as_deref() == Some(ns.as_str())
                        && u.spec.database_ref.name == name
                })
                .map(|u| ObjectRef::from_obj(u.as_ref()))
                .collect();
            hit
        },
    )
}
