//! dbops migration-controller: moves a `Database` (dbops.dev/v1alpha1) to another
//! PostgreSQL server as a resumable saga, one `Migration` at a time per Database, in the
//! mode Preflight chooses (`spec.mode`, recorded in `status.mode`):
//! - Dump: Preflight → Snapshot → FreezeSource → ProvisionTarget → CopyData → Verify →
//!   SwitchTraffic → Cleanup;
//! - Logical: Preflight → Snapshot → ProvisionTarget → Replicate → FreezeSource →
//!   CatchUp → Verify → SwitchTraffic → Cleanup (the source writable until the freeze);
//!
//! with compensations in reverse order when a step before SwitchTraffic fails. See `saga`
//! for the driver, `steps` for the steps, `replicate` for the Logical mode's.
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

mod copy;
mod error;
mod logical;
mod progress;
mod replicate;
mod replication;
mod saga;
mod sql;
mod steps;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use dbops_api::{Backup, Database, DatabaseServer, Migration, MigrationStep};
use dbops_shared::cli::{CommonArgs, PostgresArgs};
use dbops_shared::controller::{self, Context, ControllerError, Process, Trigger};
use dbops_shared::events::Recorder;
use dbops_shared::server::Directory;
use dbops_shared::telemetry;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::saga::{CrashPoint, DatabaseIndex, Moment, State};

/// The controller name: metrics label, Lease `dbops-migration-controller`, Event reporter.
const CONTROLLER: &str = dbops_shared::metrics::MIGRATION_CONTROLLER;

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

fn parse_step(step: &str) -> Result<MigrationStep, String> {
    MigrationStep::ALL
        .into_iter()
        .find(|s| s.as_str() == step)
        .ok_or_else(|| format!("unknown step {step:?}"))
}

fn parse_crash_point(value: &str) -> Result<CrashPoint, String> {
    let (step, point) = value
        .split_once(':')
        .ok_or_else(|| format!("expected <Step>:started or <Step>:done, got {value:?}"))?;
    let step = parse_step(step)?;
    let moment = match point {
        "started" => Moment::Started,
        "done" => Moment::Done,
        "slot-created" if step == MigrationStep::Replicate => Moment::SlotCreated,
        "slot-created" => return Err("slot-created is a moment of Replicate only".into()),
        other => {
            return Err(format!(
                "expected started, done or slot-created, got {other:?}"
            ));
        }
    };
    Ok(CrashPoint { step, moment })
}

fn parse_fail_point(value: &str) -> Result<MigrationStep, String> {
    let step = parse_step(value)?;
    if matches!(step, MigrationStep::SwitchTraffic | MigrationStep::Cleanup) {
        return Err(format!(
            "{value} is past the point of no return: a failure there is retried, never rolled back"
        ));
    }
    Ok(step)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _telemetry = match telemetry::init("dbops-migration-controller", &args.common) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("dbops-migration-controller: {error}");
            return ExitCode::FAILURE;
        }
    };
    controller::exit_code(run(args).await)
}

/// The Migration controller, until SIGTERM. It watches the snapshot Backups its Migrations
/// own, the DatabaseServers they move Databases between, and the Databases they move (in
/// a store Preflight reads).
async fn run(args: Args) -> Result<(), ControllerError> {
    let process = Process::start::<Migration>(CONTROLLER, &args.common).await?;
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
                index: DatabaseIndex::default(),
                clients: dbops_shared::pg_tools::Clients::new(
                    Some(args.pg_dump.clone()),
                    Some(args.pg_restore.clone()),
                    &args.pg_bin_dirs,
                ),
                pg_dump: args.pg_dump,
                pg_restore: args.pg_restore,
                max_attempts: args.step_max_attempts,
                crash_at: args.debug_exit_at,
                fail_at: args.debug_fail_at,
            };
            let ctx = run.context(CONTROLLER, state);
            // Status writes are the controller's own; Backups and Databases have watches
            // of their own, and waits requeue after the resync interval.
            let migrations = run.controller(watcher::Config::default(), Trigger::GenerationChange);
            let migrations = watches(migrations, &ctx, run.namespace(), databases_writer);
            run.drive(migrations, ctx, saga::reconcile).await;
        })
        .await
}

/// The snapshot Backups the Migrations own, the Databases they move (into the store of
/// `databases`) and the DatabaseServers they move them between.
fn watches(
    c: kube::runtime::Controller<Migration>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    databases: reflector::store::Writer<Database>,
) -> kube::runtime::Controller<Migration> {
    let client = ctx.client.clone();
    let index = ctx.clone();
    let migrations = c.store();
    let database_watch = watcher(
        controller::scoped_api::<Database>(client.clone(), namespace),
        watcher::Config::default(),
    )
    .default_backoff()
    // The store keeps what Preflight reads; managedFields is most of an object.
    .modify(|d| d.managed_fields_mut().clear());
    let database_events = reflector::reflector(databases, database_watch).touched_objects();
    c.owns(
        controller::scoped_api::<Backup>(client.clone(), namespace),
        watcher::Config::default().labels(steps::SNAPSHOT_LABEL),
    )
    .watches(
        Api::<DatabaseServer>::all(client),
        ctx.state.directory.server_config(),
        move |server: DatabaseServer| migrations_using(&migrations, &server.name_any()),
    )
    .watches_stream(database_events, move |db: Database| {
        let ns = db.metadata.namespace.clone().unwrap_or_default();
        let name = db.metadata.name.clone().unwrap_or_default();
        index
            .state
            .index
            .referrers_of(&ns, &name)
            .into_iter()
            .map(move |m| ObjectRef::new(&m).within(&ns))
    })
}

/// The unfinished Migrations of `migrations` that move a Database to or from `server`.
fn migrations_using(migrations: &Store<Migration>, server: &str) -> Vec<ObjectRef<Migration>> {
    migrations
        .state()
        .iter()
        .filter(|m| uses_server(m, server))
        .map(|m| ObjectRef::from_obj(m.as_ref()))
        .collect()
}

/// Whether `m` has not ended and `server` is its target or its recorded source.
fn uses_server(m: &Migration, server: &str) -> bool {
    let status = m.status.as_ref();
    let source = status.and_then(|s| s.source_server.as_ref());
    !status.is_some_and(progress::is_terminal)
        && (m.spec.target.server_ref.name == server || source.is_some_and(|s| s.name == server))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_debug_exit_point_names_a_step_and_a_moment() {
        assert_eq!(
            parse_crash_point("CopyData:done"),
            Ok(CrashPoint {
                step: MigrationStep::CopyData,
                moment: Moment::Done
            })
        );
        assert_eq!(
            parse_crash_point("Preflight:started"),
            Ok(CrashPoint {
                step: MigrationStep::Preflight,
                moment: Moment::Started
            })
        );
        assert_eq!(
            parse_crash_point("Replicate:slot-created"),
            Ok(CrashPoint {
                step: MigrationStep::Replicate,
                moment: Moment::SlotCreated
            })
        );
        assert!(parse_crash_point("CopyData:slot-created").is_err());
        assert!(parse_crash_point("Copy:done").is_err());
        assert!(parse_crash_point("CopyData").is_err());
        assert!(parse_crash_point("CopyData:later").is_err());
    }

    #[test]
    fn a_failure_is_injected_only_before_the_point_of_no_return() {
        assert_eq!(parse_fail_point("CatchUp"), Ok(MigrationStep::CatchUp));
        assert_eq!(parse_fail_point("Preflight"), Ok(MigrationStep::Preflight));
        assert!(parse_fail_point("SwitchTraffic").is_err());
        assert!(parse_fail_point("Cleanup").is_err());
        assert!(parse_fail_point("Replicate:done").is_err());
    }

    fn migration(target: &str, source: Option<&str>, phase: Option<&str>) -> Migration {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Migration",
            "metadata": {"name": "m", "namespace": "shop"},
            "spec": {"databaseRef": {"name": "orders"}, "target": {"serverRef": {"name": target}}},
            "status": {
                "phase": phase,
                "sourceServer": source.map(|s| serde_json::json!({"name": s})),
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_server_maps_to_the_unfinished_migrations_to_or_from_it() {
        let running = migration("pg-17", Some("pg-16"), Some("Running"));
        assert!(uses_server(&running, "pg-17"), "its target");
        assert!(uses_server(&running, "pg-16"), "its recorded source");
        assert!(!uses_server(&running, "pg-15"));
        let pending = migration("pg-17", None, None);
        assert!(uses_server(&pending, "pg-17"));
        assert!(!uses_server(&pending, "pg-16"));
        for done in ["Succeeded", "Failed", "RolledBack"] {
            let m = migration("pg-17", Some("pg-16"), Some(done));
            assert!(!uses_server(&m, "pg-17"), "{done}");
            assert!(!uses_server(&m, "pg-16"), "{done}");
        }
    }

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
