//! dbops migration-controller: moves a `Database` (dbops.dev/v1alpha1) to another
//! PostgreSQL server as a resumable saga, one `Migration` at a time per Database, in the
//! mode Preflight chooses (`spec.mode`, recorded in `status.mode`):
//! - Dump: Preflight → Snapshot → FreezeSource → ProvisionTarget → CopyData → Verify →
//!   SwitchTraffic → Cleanup;
//! - Logical: Preflight → Snapshot → ProvisionTarget → Replicate → FreezeSource →
//!   CatchUp → Verify → SwitchTraffic → Cleanup (the source writable until the freeze);
//!
//! with compensations in reverse order when a step before SwitchTraffic fails.
//!
//! The modules, each importing only those below it (`e2e/house` checks that no two
//! modules or folders import each other):
//! - `watches`: what brings a Migration back to the reconcile; `main` wires it all;
//! - `saga/`: the reconcile as a state machine: `drive` executes the move `next_move`
//!   decides (pure) over the status record of `progress`; `rollback`;
//! - `steps/`: the steps both modes run (Preflight, Snapshot, FreezeSource,
//!   ProvisionTarget, Verify, SwitchTraffic, Cleanup) and the dispatch of every step;
//! - `replication/`: the Logical mode's Replicate and CatchUp, the replication's checks,
//!   teardown and SQL;
//! - `dump/`: the Dump mode's CopyData, its pg_dump | pg_restore pipe and programs;
//! - `pooled`: the cutover through the source server's pooler (its Pods' consoles:
//!   `PAUSE` in FreezeSource, the route to the target and `RESUME` in SwitchTraffic);
//!   `servers`: the two servers as a step reaches them;
//! - `context`: the controller's `State`, the `Saga` a step is handed (the Migration,
//!   its guarded status write, Events) and its `StepOutcome`;
//! - `debug`: the testing flags; `error`: why a step did not finish (the copy's failures
//!   included);
//! - pure, importing nothing of the crate: `progress` (the saga's status as functions:
//!   which step is next, a step starting, finishing, failing), `counts` (row counts
//!   without counting in the freeze), `logical` (whether a source can replicate), `sql`.
//!
//! Watches: Migrations (new generations: spec changes and deletion); the snapshot Backups
//! they own; Databases, mapped to their Migrations through an index on
//! `spec.databaseRef` (the switch completes when the Database is Ready on the target) and
//! kept in a store (Preflight counts those on the target for its quota); DatabaseServers
//! (matching `--server-selector`), mapped to the unfinished Migrations whose target
//! (`spec.target.serverRef`) or recorded source (`status.sourceServer`) they are.
//! DatabaseServers, their admin and CA Secrets (in the controllers' namespace only) and
//! the namespaces' labels are also cached by `dbops_shared::server::Directory`, from
//! which each step resolves its servers.
//!
//! Startup: telemetry, a Kubernetes client (KUBECONFIG or in-cluster), a check that the
//! CRD migrations.dbops.dev is served (exit 1 with "CRD migrations.dbops.dev is not
//! installed" otherwise), the health and metrics server, then the controller until
//! SIGTERM/SIGINT. A step interrupted by a shutdown or a crash is resumed by the next
//! process from the record in the Migration's status.

mod context;
mod counts;
mod debug;
mod dump;
mod error;
mod logical;
mod metrics;
mod pooled;
mod progress;
mod replication;
mod saga;
mod servers;
mod sql;
mod steps;
mod watches;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use dbops_api::{Database, Migration, MigrationStep};
use dbops_shared::cli::{CommonArgs, PostgresArgs};
use dbops_shared::controller::{self, ControllerError, Process, Trigger};
use dbops_shared::events::Recorder;
use dbops_shared::server::Directory;
use dbops_shared::startup;
use dbops_shared::status::StatusWriter;
use kube::runtime::reflector;
use kube::runtime::watcher;

use crate::context::{DatabaseIndex, State};
use crate::debug::{CrashPoint, parse_crash_point, parse_fail_point};

/// The controller name: metrics label, Lease `dbops-migration-controller`, Event reporter.
const CONTROLLER: &str = "migration-controller";

#[derive(Parser, Debug)]
#[command(
    name = "dbops-migration-controller",
    version,
    about = "Reconciles dbops.dev Migration objects"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// The pg_dump program (a path, or a name looked up in PATH); at least the source's
    /// major version.
    #[arg(long, env = "DBOPS_PG_DUMP", default_value = "pg_dump")]
    pg_dump: PathBuf,

    /// The pg_restore program (a path, or a name looked up in PATH).
    #[arg(long, env = "DBOPS_PG_RESTORE", default_value = "pg_restore")]
    pg_restore: PathBuf,

    /// Directories of more pg_dump and pg_restore programs, one major each (for example
    /// `/usr/lib/postgresql/13/bin,...,/usr/lib/postgresql/18/bin`): a Dump mode copy
    /// takes the target's major, else the nearest that dumps the source and restores into
    /// the target.
    #[arg(long = "pg-bin-dir", env = "DBOPS_PG_BIN_DIRS", value_delimiter = ',')]
    pg_bin_dirs: Vec<PathBuf>,

    /// Failed attempts of a step before SwitchTraffic after which the Migration is rolled
    /// back (retries follow the --backoff-base/--backoff-max curve).
    #[arg(long, env = "DBOPS_STEP_MAX_ATTEMPTS", default_value_t = 3,
          value_parser = clap::value_parser!(i32).range(1..))]
    step_max_attempts: i32,

    #[command(flatten)]
    postgres: PostgresArgs,

    /// Testing only: exit with code 86 at `<Step>:started` (the step's Running record is
    /// written, nothing done yet), `<Step>:done` (its effects are done, its Succeeded
    /// record not yet written) or `Replicate:slot-created` (CREATE SUBSCRIPTION created
    /// the replication slot on the source, nothing recorded of it yet), to prove that a
    /// new process resumes from there.
    #[arg(long, hide = true, value_parser = parse_crash_point)]
    debug_exit_at: Option<CrashPoint>,

    /// Testing only: the step `<Step>` (one before SwitchTraffic) fails for good
    /// (`InjectedFailure`) once its effects are done, to prove the rollback from there.
    #[arg(long, hide = true, value_parser = parse_fail_point)]
    debug_fail_at: Option<MigrationStep>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let Some(_telemetry) = startup::telemetry("dbops-migration-controller", &args.common) else {
        return ExitCode::FAILURE;
    };
    controller::exit_code(run(args).await)
}

/// The Migration controller, until SIGTERM. It watches the snapshot Backups its Migrations
/// own, the DatabaseServers they move Databases between, and the Databases they move (in
/// a store Preflight reads).
async fn run(args: Args) -> Result<(), ControllerError> {
    let process = Process::start::<Migration>(CONTROLLER, &args.common).await?;
    let saga_metrics = process
        .metrics()
        .register(metrics::MigrationMetrics::register);
    // The servers' caches fill while the Lease is taken.
    let directory = Directory::for_process(process.client(), &args.common);
    process
        .run(None, |run| async move {
            let client = run.client().clone();
            let (databases, databases_writer) = reflector::store::<Database>();
            let state = State {
                servers: args.postgres.servers(),
                directory,
                databases,
                recorder: Recorder::new(client.clone(), controller::reporter(CONTROLLER)),
                status_writer: StatusWriter::default(),
                index: DatabaseIndex::default(),
                clients: dbops_shared::pg_tools::Clients::new(
                    Some(args.pg_dump.clone()),
                    Some(args.pg_restore.clone()),
                    &args.pg_bin_dirs,
                ),
                pg_dump: args.pg_dump,
                pg_restore: args.pg_restore,
                max_attempts: args.step_max_attempts,
                baselines: Default::default(),
                crash_at: args.debug_exit_at,
                fail_at: args.debug_fail_at,
                metrics: saga_metrics,
            };
            let ctx = run.context(CONTROLLER, state);
            // Status writes are the controller's own; Backups and Databases have watches
            // of their own, and waits requeue after the resync interval.
            let migrations = run.controller(watcher::Config::default(), Trigger::GenerationChange);
            let migrations = watches::watches(migrations, &ctx, run.namespace(), databases_writer);
            run.drive(migrations, ctx, saga::reconcile).await;
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_have_sensible_defaults() {
        let args = Args::try_parse_from(["dbops-migration-controller"]).unwrap();
        assert_eq!(args.step_max_attempts, 3);
        assert_eq!(args.pg_dump, PathBuf::from("pg_dump"));
        assert!(args.pg_bin_dirs.is_empty());
        let dirs = Args::try_parse_from(["x", "--pg-bin-dir=/pg/15/bin,/pg/18/bin"]).unwrap();
        assert_eq!(
            dirs.pg_bin_dirs,
            [PathBuf::from("/pg/15/bin"), PathBuf::from("/pg/18/bin")]
        );
        assert!(args.debug_exit_at.is_none());
        assert!(
            Args::try_parse_from(["x", "--step-max-attempts=0"]).is_err(),
            "at least one attempt"
        );
    }
}
