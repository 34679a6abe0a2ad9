//! dbops database-controller: turns each `Database` (dbops.dev/v1alpha1) into a role, a
//! database, its extensions and settings on a PostgreSQL server, and a connection
//! Secret `<name>-connection`; repairs drift every `--resync-interval`; reports a
//! vanished database without re-creating it; and on deletion does what
//! `spec.deletionPolicy` says (Retain, Delete, or Snapshot: a final Backup, then drop).
//!
//! Watches: Databases; the connection Secrets it owns; admin Secrets (mapped to their
//! Databases through an index on `spec.server.adminSecretRef`); Migrations (their
//! Database gets `MigrationInProgress` and its freeze is not "repaired"); and final
//! snapshot Backups (label `dbops.dev/final-snapshot-of=<Database uid>`) and Backups that a Database
//! waits to be restored from (`spec.restoreFrom`).

mod error;
mod reconcile;
mod restore;
mod secret;
mod sql;
mod status;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dbops_api::{Backup, Database, Migration};
use dbops_shared::cli::{BackupStoreArgs, CommonArgs, PostgresArgs};
use dbops_shared::controller::{self, Configure, Context};
use dbops_shared::telemetry;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::{self, reflector};
use kube::runtime::{WatchStreamExt, watcher};

use crate::reconcile::{AdminSecretIndex, State, Verified, Written};

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
    let servers = args.postgres.servers();
    // Checked before the controller starts: the store restores read is writable and the
    // one the backup-controller writes (registered in the ConfigMap dbops-backup-store).
    let options = controller::Options {
        backup_store: Some(args.store.backup_store.clone()),
        ..controller::Options::default()
    };
    let namespace = args.common.watch_namespace.clone();
    let configure: Configure<Database, State> =
        Box::new(move |c, ctx| watches(c, ctx, namespace.as_deref()));
    let state = move |client: kube::Client, reporter| State {
        servers,
        recorder: Recorder::new(client, reporter),
        admin_secrets: AdminSecretIndex::default(),
        migrations: std::sync::OnceLock::new(),
        verified: Verified::default(),
        written: Written::default(),
        databases: std::sync::OnceLock::new(),
        secrets: std::sync::OnceLock::new(),
        last_prune: std::sync::Mutex::new(None),
        restorer: restore::Restorer {
            store: args.store.backup_store.clone(),
            pg_restore: args.pg_restore.clone(),
        },
    };
    controller::exit_code(
        controller::run_with::<Database, _, _, _, _>(
            CONTROLLER,
            &args.common,
            state,
            // Status writes are the controller's own; Secrets, admin Secrets, Migrations and
            // final Backups have watches of their own, and the resync requeues.
            controller::Trigger::GenerationChange,
            configure,
            reconcile::reconcile,
            options,
        )
        .await,
    )
}

/// Owned connection Secrets, admin Secrets, Migrations and final snapshot Backups.
fn watches(
    c: kube::runtime::Controller<Database>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
) -> kube::runtime::Controller<Database> {
    let client = ctx.client.clone();
    let index = ctx.clone();
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
    tokio::spawn(async move {
        migrations
            .for_each(|event| {
                if let Err(error) = event {
                    tracing::warn!(%error, "Migration watch failed; retrying with backoff");
                }
                std::future::ready(())
            })
            .await;
    });
    // One watch of Secrets feeds a cache (admin and connection Secrets are read from it,
    // not fetched per reconcile) and two triggers: owned connection Secrets, and admin
    // Secrets mapped to their Databases.
    let (secret_store, secret_writer) = reflector::store_shared::<Secret>(1024);
    let _ = ctx.state.secrets.set(secret_store);
    let (Some(owned_secrets), Some(admin_secrets)) =
        (secret_writer.subscribe(), secret_writer.subscribe())
    else {
        unreachable!("a shared store can be subscribed to");
    };
    let secrets = watcher(
        controller::scoped_api::<Secret>(client.clone(), namespace),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|s| {
        s.managed_fields_mut().clear();
    })
    .reflect_shared(secret_writer);
    tokio::spawn(async move {
        secrets
            .for_each(|event| {
                if let Err(error) = event {
                    tracing::warn!(%error, "Secret watch failed; retrying with backoff");
                }
                std::future::ready(())
            })
            .await;
    });
    c.owns_shared_stream(owned_secrets)
        .watches_shared_stream(admin_secrets, move |secret: Arc<Secret>| {
            let ns = secret.metadata.namespace.clone().unwrap_or_default();
            let name = secret.metadata.name.clone().unwrap_or_default();
            index
                .state
                .admin_secrets
                .referrers_of(&ns, &name)
                .into_iter()
                .map(move |db| ObjectRef::new(&db).within(&ns))
        })
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
                let restoring: Vec<ObjectRef<Database>> = databases
                    .state()
                    .iter()
                    .filter(|db| restore::waits_for(db, &ns, &name))
                    .map(|db| ObjectRef::from_obj(db.as_ref()))
                    .collect();
                final_of.into_iter().chain(restoring)
            },
        )
}
