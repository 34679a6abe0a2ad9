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
mod clone;
mod clone_slots;
mod connection;
mod delete;
mod error;
mod expiry;
mod finalizer;
mod limits;
mod live;
mod metrics;
mod owner_logins;
mod plan;
mod pooler;
mod provision;
mod reconcile;
mod restore;
mod role_sql;
mod rotation;
mod routine;
mod secret;
mod server;
mod server_access;
mod sql;
mod state;
mod status;
mod template;
mod tenant_secrets;
mod user;
mod watches;

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};

use clap::Parser;
use dbops_api::{Database, DatabaseUser, Migration};
use dbops_shared::controller::{self, Context, ControllerError, Process, Trigger};
use dbops_shared::events::Recorder;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;
use dbops_shared::startup::{self, StoreControllerArgs};
use futures::StreamExt;
use kube::runtime::reflector::Store;

use crate::state::{State, Verified};
use crate::tenant_secrets::TenantSecrets;

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
    base: StoreControllerArgs,

    /// The pg_restore program (a path, or a name looked up in PATH); its major version
    /// must be at least the one of the pg_dump that made the artifact.
    #[arg(long, env = "DBOPS_PG_RESTORE", default_value = "pg_restore")]
    pg_restore: std::path::PathBuf,

    /// The pg_dump program for `spec.cloneFrom.databaseRef` (a path, or a name looked up in
    /// PATH), with psql beside it: a clone takes one that dumps the source's major (see
    /// `--pg-bin-dir`).
    #[arg(long, env = "DBOPS_PG_DUMP", default_value = "pg_dump")]
    pg_dump: std::path::PathBuf,

    /// Directories of more pg_restore programs, one major each (for example
    /// `/usr/lib/postgresql/13/bin,...,/usr/lib/postgresql/18/bin`): each restore takes
    /// one that reads the artifact and whose settings the server has.
    #[arg(long = "pg-bin-dir", env = "DBOPS_PG_BIN_DIRS", value_delimiter = ',')]
    pg_bin_dirs: Vec<std::path::PathBuf>,

    /// pg_restore's parallel jobs for `spec.restoreFrom` (1 to 16). Above 1 the artifact
    /// is first copied (decrypted) to `--restore-scratch-dir`, which needs room for it: the
    /// custom format restores in parallel from a file only, and not in one transaction
    /// (a failed restore is made anew at the next attempt either way).
    #[arg(long, env = "DBOPS_RESTORE_JOBS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    restore_jobs: u16,

    /// Where a parallel restore keeps its copy of the artifact (removed after).
    #[arg(long, env = "DBOPS_RESTORE_SCRATCH_DIR", default_value_os_t = std::env::temp_dir())]
    restore_scratch_dir: std::path::PathBuf,

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

    /// The image of the pooler Pods of DatabaseServers with `spec.pooler` (PgBouncer,
    /// built from deploy/docker/dbops-pgbouncer.Dockerfile).
    #[arg(
        long,
        env = "DBOPS_POOLER_IMAGE",
        default_value = "ghcr.io/dbops/dbops-pgbouncer:0.1.0"
    )]
    pooler_image: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let Some(_telemetry) = startup::telemetry("dbops-database-controller", &args.base.common)
    else {
        return ExitCode::FAILURE;
    };
    controller::exit_code(run(args).await)
}

/// What the three controllers of the process share: the servers' sessions and Directory,
/// the caches of Databases and Migrations (filled by `watches::databases`) and the
/// tenant namespaces' connection Secrets (only while leading: the state, and the watches
/// in it, go with the lead).
struct Shared {
    client: kube::Client,
    servers: Arc<Servers>,
    directory: Directory,
    databases: Arc<OnceLock<Store<Database>>>,
    migrations: Arc<OnceLock<Store<Migration>>>,
    tenants: TenantSecrets,
}

impl Shared {
    /// The Database controller's state.
    fn database_state(&self, args: &Args) -> State {
        State {
            servers: self.servers.clone(),
            directory: self.directory.clone(),
            recorder: Recorder::new(self.client.clone(), controller::reporter(CONTROLLER)),
            migrations: self.migrations.clone(),
            verified: Verified::default(),
            expiry_warned: Default::default(),
            statuses: dbops_shared::status::StatusWriter::default(),
            databases: self.databases.clone(),
            tenants: self.tenants.clone(),
            last_prune: std::sync::Mutex::new(None),
            routine: Default::default(),
            sizes: std::sync::Mutex::default(),
            clones: Default::default(),
            restorer: restore::Restorer {
                store: args.base.store.backup_store.clone(),
                clients: dbops_shared::pg_tools::Clients::new(
                    Some(args.pg_dump.clone()),
                    Some(args.pg_restore.clone()),
                    &args.pg_bin_dirs,
                ),
                identities_secret: args.base.store.backup_identities_secret.clone(),
                jobs: args.restore_jobs,
                scratch: args.restore_scratch_dir.clone(),
            },
        }
    }

    /// The DatabaseUser controller's state.
    fn user_state(&self) -> user::State {
        user::State {
            servers: self.servers.clone(),
            directory: self.directory.clone(),
            recorder: Recorder::new(self.client.clone(), controller::reporter(user::CONTROLLER)),
            databases: self.databases.clone(),
            tenants: self.tenants.clone(),
            written: Default::default(),
        }
    }

    /// The DatabaseServer controller's state.
    fn server_state(
        &self,
        pooler_image: &str,
        users: kube::runtime::reflector::Store<DatabaseUser>,
    ) -> server::State {
        let recorder = Recorder::new(
            self.client.clone(),
            controller::reporter(server::CONTROLLER),
        );
        server::State::new(
            self.directory.clone(),
            self.servers.clone(),
            recorder,
            self.databases.clone(),
            self.migrations.clone(),
        )
        .with_poolers(
            pooler::Poolers {
                image: pooler_image.to_string(),
                verifiers: Default::default(),
                users: Some(users),
            },
            self.tenants.clone(),
        )
    }
}

/// Three controllers, until SIGTERM: Databases (with the watches of `watches`),
/// DatabaseUsers, and the server controller (`server`), which probes each DatabaseServer
/// and keeps it while Databases are on it. They read one Directory of the servers, the
/// Database store and the Migration store.
async fn run(args: Args) -> Result<(), ControllerError> {
    let process = Process::start::<Database>(CONTROLLER, &args.base.common).await?;
    process.metrics().register(metrics::register);
    // Checked before the controllers start: the store restores read is writable and the
    // one the backup-controller writes (registered in the ConfigMap dbops-backup-store).
    let store = args.base.store.backup_store.clone();
    // The servers' caches fill while the backup store is checked and the Lease is taken.
    let directory = Directory::for_process(process.client(), &args.base.common);
    let service_account = args
        .service_account
        .as_ref()
        .map(|a| a.in_namespace(&args.base.common.controller_namespace));
    process
        .run(Some(&store), |run| async move {
            let client = run.client().clone();
            let databases: Arc<OnceLock<Store<Database>>> = Arc::default();
            let shared = Shared {
                servers: Arc::new(args.base.postgres.servers()),
                tenants: TenantSecrets::new(
                    client.clone(),
                    directory.clone(),
                    databases.clone(),
                    run.namespace(),
                    service_account,
                ),
                directory,
                databases,
                migrations: Arc::default(),
                client,
            };
            let ctx = run.context(CONTROLLER, shared.database_state(&args));
            // One watch of each kind the controllers share (subscribed to before it starts).
            let w = watches::Watches::new(&run);
            // The connection Secrets' changes, to the Database or the DatabaseUser that
            // owns each.
            let (db_secrets, user_secrets) = watches::split_by_owner(shared.tenants.triggers());
            // Status writes are the controller's own; Secrets, admin Secrets, Migrations
            // and final Backups have watches of their own, and the resync requeues.
            // Annotations too: `dbops.dev/rotate` asks for a rotation of the owner's password.
            let dbs = run.controller_on(&w.databases, Trigger::GenerationOrAnnotations);
            let dbs = watches::databases(dbs, &ctx, run.namespace(), db_secrets, &w);

            // DatabaseUsers: a new generation or annotation (`dbops.dev/rotate`) of their
            // own, any change of their Database, their connection Secrets.
            let user_ctx = run.context(user::CONTROLLER, shared.user_state());
            let users = run.controller_on(&w.users, Trigger::GenerationOrAnnotations);
            let users = watches::users(users, user_secrets, &w);
            forget_writes_seen(&w, &ctx, &user_ctx);

            let server_ctx = run.context(
                server::CONTROLLER,
                shared.server_state(&args.pooler_image, users.store()),
            );
            let dbservers = run
                .controller_on(shared.directory.servers_watch(), Trigger::GenerationChange)
                .with_config(
                    kube::runtime::controller::Config::default()
                        .concurrency(args.server_concurrency),
                );
            let dbservers = server::watches(dbservers, &shared.directory, followed(&w));
            let _watching = w.start();

            // The tenant namespaces' set-ups follow the Databases for as long as the
            // controllers run (they end on SIGTERM or a lost Lease).
            tokio::select! {
                _ = async {
                    tokio::join!(
                        run.drive(dbs, ctx, reconcile::reconcile),
                        run.drive(dbservers, server_ctx, server::reconcile),
                        run.drive(users, user_ctx, user::reconcile),
                    )
                } => {}
                () = shared.tenants.follow() => {}
            }
        })
        .await
}

/// Each status write of the Database and DatabaseUser controllers is forgotten once their
/// watch shows it. Weak handles: the watches do not keep the controllers' state alive.
fn forget_writes_seen(
    w: &watches::Watches,
    databases: &Arc<Context<State>>,
    users: &Arc<Context<user::State>>,
) {
    let statuses = Arc::downgrade(databases);
    w.databases.on_change(move |db| {
        if let Some(ctx) = statuses.upgrade() {
            ctx.state.statuses.seen(db);
        }
    });
    let written = Arc::downgrade(users);
    w.users.on_change(move |user| {
        if let Some(ctx) = written.upgrade() {
            ctx.state.written.seen(user);
        }
    });
}

/// What the server controller follows of the process's shared watches.
fn followed(w: &watches::Watches) -> server::Followed {
    server::Followed {
        databases: w.databases.touched().boxed(),
        users: w.users.touched().boxed(),
        migrations: w.migrations.touched().boxed(),
        migrations_by_database: w.indexes.migrations.clone(),
    }
}
