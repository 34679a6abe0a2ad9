//! dbops backup-controller: turns each `Backup` (dbops.dev/v1alpha1) into one logical
//! dump (`pg_dump --format=custom`) of its Database in the backup store named by
//! `--backup-store`, with a manifest and a SHA-256 checksum beside it; retries transient
//! failures up to `spec.maxRetries`; and on deletion removes the artifact when
//! `spec.deletionPolicy` is Delete. See `reconcile` for the steps.
//!
//! A second controller in the same process, `schedule` (`backup-scheduler`), creates
//! the scheduled Backups of Databases with `spec.backup` and prunes them by retention.
//!
//! Watches: Backups; Databases, mapped to the Backups waiting for them through an index
//! on `spec.databaseRef`; DatabaseServers (`--server-selector`), mapped to the unfinished
//! Backups of their Databases; admin and CA Secrets are read from a cache of the
//! controllers' namespace only (`--controller-namespace`). At most `--max-concurrent-backups` dumps run at once, and one
//! per PostgreSQL server.
//!
//! Startup: telemetry, a Kubernetes client (KUBECONFIG or in-cluster), a check that the
//! CRD backups.dbops.dev is served (exit 1 with "CRD backups.dbops.dev is not installed"
//! otherwise), the health and metrics server, a check of the backup store (writable, and
//! the one registered in the ConfigMap `dbops-backup-store` of `--controller-namespace`;
//! not ready until it passes), then the controller until SIGTERM/SIGINT.
//! A dump still running after the shutdown grace period is abandoned (pg_dump is
//! killed); the next process finds its Backup Running and starts it over.

mod attempt;
mod cleanup;
mod dereference;
mod dump;
mod error;
mod finish;
mod inventory;
mod metrics;
mod reconcile;
mod retries;
mod runner;
mod schedule;
mod slots;
mod state;
mod status;
mod verify;
mod verifying;
mod write;

use std::path::PathBuf;
use std::time::Duration;
use std::{process::ExitCode, sync::Arc};

use clap::Parser;
use dbops_api::{Backup, Database, DatabaseServer};
use dbops_shared::events::Recorder;
use dbops_shared::{
    backoff::Backoff,
    controller::{self, Context, ControllerError, Process, Trigger},
    server::Directory,
    startup::{self, StoreControllerArgs},
};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;

use crate::retries::Retries;
use crate::slots::Slots;
use crate::state::{DatabaseIndex, State, Verification};

// The program's name is the package's (`dbops-backup-controller`), its `about` the doc
// comment's one line.
/// Reconciles dbops.dev Backup objects
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    base: StoreControllerArgs,

    /// How many pg_dump runs may be in flight at once (at least 1).
    #[arg(long, env = "DBOPS_MAX_CONCURRENT_BACKUPS", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(1..))]
    max_concurrent_backups: u16,

    /// The pg_dump program (a path, or a name looked up in PATH).
    #[arg(long, env = "DBOPS_PG_DUMP", default_value = "pg_dump")]
    pg_dump: PathBuf,

    /// Directories of more pg_dump programs, one major each (for example
    /// `/usr/lib/postgresql/13/bin,...,/usr/lib/postgresql/18/bin`): each dump takes the
    /// oldest major that dumps its server, so that the server's own major restores it.
    #[arg(long = "pg-bin-dir", env = "DBOPS_PG_BIN_DIRS", value_delimiter = ',')]
    pg_bin_dirs: Vec<PathBuf>,

    /// The pg_restore program a verification restores with (a path, or a name looked up in
    /// PATH), beside those of `--pg-bin-dir`.
    #[arg(long, env = "DBOPS_PG_RESTORE", default_value = "pg_restore")]
    pg_restore: PathBuf,

    /// The DatabaseServer (one that admits no tenant: `allowedNamespaces` unset) on which
    /// Backups with `spec.verify` are restored into a scratch database and checked.
    /// Unset: such Backups report `VerificationUnavailable`.
    #[arg(long, env = "DBOPS_VERIFY_SERVER")]
    verify_server: Option<String>,

    /// The longest a verification may take (restore and checks), and a dump's count of
    /// its rows; the scratch database is dropped when it runs out.
    #[arg(long, env = "DBOPS_VERIFY_TIMEOUT", default_value = "30m", value_parser = dbops_shared::cli::parse_duration)]
    verify_timeout: Duration,

    /// Artifacts larger than this are not verified (`VerificationTooLarge`): the scratch
    /// database would need about as much space, and more.
    #[arg(long, env = "DBOPS_VERIFY_MAX_BYTES", default_value_t = 10 * 1024 * 1024 * 1024)]
    verify_max_bytes: u64,

    /// Whether every dump counts what it saw (rows per table, objects, extensions, in the
    /// dump's own snapshot, while it runs), so that any Backup can be verified later, not
    /// only those created with `spec.verify` (which always count). It reads each table
    /// once more: 0.85 of a plain dump's throughput at 1 GB on 2 cores, against 0.94.
    #[arg(long, env = "DBOPS_DUMP_INVENTORY", default_value_t = false, action = clap::ArgAction::Set)]
    dump_inventory: bool,

    /// How long a Database whose schedule verifies (`spec.backup.verify`) may go without
    /// a passed verification: the value of `dbops_backup_verification_max_age_seconds`,
    /// which the alert `DbopsBackupNotVerified` compares with the last one.
    #[arg(long, env = "DBOPS_VERIFICATION_MAX_AGE", default_value = "192h", value_parser = dbops_shared::cli::parse_duration)]
    verification_max_age: Duration,
}

/// The controller name: metrics label, Lease `dbops-backup-controller`, Event reporter.
const CONTROLLER: &str = "backup-controller";

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let Some(_telemetry) = startup::telemetry("dbops-backup-controller", &args.base.common) else {
        return ExitCode::FAILURE;
    };
    tracing::info!(
        backup_store = %args.base.store.backup_store,
        max_concurrent_backups = args.max_concurrent_backups,
        pg_dump = %args.pg_dump.display(),
        pg_bin_dirs = ?args.pg_bin_dirs,
        "backup settings"
    );
    controller::exit_code(run(args).await)
}

/// Two controllers, until SIGTERM: Backups (watching Databases and DatabaseServers), and
/// the scheduler of Databases with `spec.backup`, reconciled when their spec changes, when
/// one of their scheduled Backups changes, and at each slot.
async fn run(args: Args) -> Result<(), ControllerError> {
    let process = Process::start::<Backup>(CONTROLLER, &args.base.common).await?;
    let backup_metrics = process.metrics().register(metrics::BackupMetrics::register);
    // Writable, and the store the database-controller reads restores from.
    let store = args.base.store.backup_store.clone();
    // The servers' caches fill while the backup store is checked and the Lease is taken.
    let directory = Directory::for_process(process.client(), &args.base.common);
    process
        .run(Some(&store), |run| async move {
            let client = run.client().clone();
            let backups = run.controller(watcher::Config::default(), Trigger::AnyChange);
            // One watch of Databases for both controllers (the scheduler's own kind, and
            // what wakes the Backups that refer to one).
            let databases = run.shared_watch::<Database>(watcher::Config::default());
            let state = State {
                cache: backups.store(),
                store: args.base.store.backup_store,
                recipients_secret: args.base.store.backup_recipients_secret,
                clients: dbops_shared::pg_tools::Clients::new(
                    Some(args.pg_dump),
                    Some(args.pg_restore),
                    &args.pg_bin_dirs,
                ),
                servers: args.base.postgres.servers(),
                directory,
                slots: Slots::new(usize::from(args.max_concurrent_backups)),
                backoff: Backoff {
                    base: args.base.common.backoff_base,
                    max: args.base.common.backoff_max,
                },
                recorder: Recorder::new(client.clone(), controller::reporter(CONTROLLER)),
                databases: DatabaseIndex::default(),
                statuses: Default::default(),
                retries: Retries::default(),
                identity: dbops_shared::leader::identity(),
                metrics: backup_metrics.clone(),
                verification: Verification {
                    server: args.verify_server,
                    timeout: args.verify_timeout,
                    max_bytes: args.verify_max_bytes,
                    identities_secret: args.base.store.backup_identities_secret,
                    inventory: args.dump_inventory,
                    running: Arc::new(tokio::sync::Semaphore::new(1)),
                },
            };
            let ctx = run.context(CONTROLLER, state);
            let backups = watches(backups, &ctx, databases.touched());

            let (scheduled, writer) = reflector::store::<Backup>();
            let recorder = Recorder::new(client, controller::reporter(schedule::CONTROLLER));
            let mut schedule_state = schedule::State::new(scheduled, recorder, backup_metrics);
            schedule_state.verification_max_age = args.verification_max_age;
            let schedule_ctx = run.context(schedule::CONTROLLER, schedule_state);
            let scheduler = run.controller_on(&databases, Trigger::GenerationChange);
            let scheduler = schedule::watches(scheduler, &schedule_ctx, run.namespace(), writer);
            let _watching = databases.start();

            tokio::join!(
                run.drive(backups, ctx, reconcile::reconcile),
                run.drive(scheduler, schedule_ctx, schedule::reconcile),
            );
        })
        .await
}

/// Databases, mapped to the unfinished Backups that refer to them.
fn watches(
    c: kube::runtime::Controller<Backup>,
    ctx: &Arc<Context<State>>,
    databases: impl futures::Stream<Item = Arc<Database>> + Send + 'static,
) -> kube::runtime::Controller<Backup> {
    let index = ctx.clone();
    let backups = c.store();
    // The process's one watch of DatabaseServers: its Directory's.
    c.watches_shared_stream(
        ctx.state.directory.servers_watch().touched(),
        move |_server: Arc<DatabaseServer>| {
            // The unfinished Backups (few: Pending or Running), whichever server their
            // Database is on: a server's change is rare, a Database lookup per Backup is not
            // needed to find them.
            let waiting: Vec<ObjectRef<Backup>> = backups
                .state()
                .iter()
                .filter(|b| {
                    !matches!(
                        b.status.as_ref().and_then(|s| s.phase),
                        Some(dbops_api::BackupPhase::Completed | dbops_api::BackupPhase::Failed)
                    )
                })
                .map(|b| ObjectRef::from_obj(b.as_ref()))
                .collect();
            waiting
        },
    )
    .watches_shared_stream(databases, move |db: Arc<Database>| {
        let ns = db.metadata.namespace.clone().unwrap_or_default();
        let name = db.metadata.name.clone().unwrap_or_default();
        index
            .state
            .databases
            .referrers_of(&ns, &name)
            .into_iter()
            .map(move |backup| ObjectRef::new(&backup).within(&ns))
    })
}

#[cfg(test)]
mod tests {
    use dbops_shared::backup_store::BackupStore;

    use super::*;

    #[test]
    fn the_program_is_named_and_described() {
        use clap::CommandFactory;
        let command = Args::command();
        assert_eq!(command.get_name(), "dbops-backup-controller");
        let about = command.get_about().map(ToString::to_string);
        assert_eq!(
            about.as_deref(),
            Some("Reconciles dbops.dev Backup objects")
        );
        assert_eq!(command.get_long_about(), None);
    }

    #[test]
    fn the_flags_have_their_documented_defaults() {
        let args = Args::try_parse_from(["dbops-backup-controller"]).unwrap();
        assert_eq!(
            args.base.store.backup_store,
            BackupStore::File {
                root: "/var/lib/dbops/backups".into()
            }
        );
        assert_eq!(args.max_concurrent_backups, 2);
        assert_eq!(args.pg_dump, PathBuf::from("pg_dump"));
        assert_eq!(args.pg_restore, PathBuf::from("pg_restore"));
        assert!(args.pg_bin_dirs.is_empty());
        assert_eq!(args.verify_server, None);
        assert!(!args.dump_inventory);
        assert_eq!(args.verify_timeout, Duration::from_secs(1800));
        assert_eq!(args.verify_max_bytes, 10 << 30);
        assert_eq!(
            args.verification_max_age,
            Duration::from_secs(8 * 24 * 3600)
        );
        let args = Args::try_parse_from([
            "dbops-backup-controller",
            "--pg-bin-dir=/usr/lib/postgresql/13/bin,/usr/lib/postgresql/18/bin",
            "--pg-bin-dir",
            "/opt/pg/bin",
        ])
        .unwrap();
        assert_eq!(
            args.pg_bin_dirs,
            [
                PathBuf::from("/usr/lib/postgresql/13/bin"),
                "/usr/lib/postgresql/18/bin".into(),
                "/opt/pg/bin".into()
            ]
        );
        assert!(
            Args::try_parse_from(["dbops-backup-controller", "--max-concurrent-backups=0"])
                .is_err()
        );
    }
}
