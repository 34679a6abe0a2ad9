//! dbops backup-controller: reconciles `Backup` objects (dbops.dev/v1alpha1).
//!
//! For now the reconcile does only honest minimal work: it logs at debug
//! "observed Backup <namespace>/<name> generation <g>" and requeues after
//! `--resync-interval`. It makes NO writes, to the API, to PostgreSQL or to the backup
//! store; the real logic comes in later issues. `--backup-store` and
//! `--max-concurrent-backups` are parsed, validated and logged, not used yet. It will
//! later also watch Databases (`spec.databaseRef` index) and run scheduled backups; not yet.
//!
//! Startup: telemetry, a Kubernetes client (KUBECONFIG or in-cluster), a check that the
//! CRD backups.dbops.dev is served (exit 1 with "CRD backups.dbops.dev is not installed"
//! otherwise), the health and metrics server, then the controller until SIGTERM/SIGINT,
//! after which the process exits 0 once in-flight reconciles have finished.

mod backup_store;

use std::{process::ExitCode, sync::Arc};

use clap::Parser;
use dbops_api::Backup;
use dbops_shared::{
    cli::CommonArgs,
    controller::{self, Context},
    telemetry,
};
use kube::{ResourceExt, runtime::controller::Action};

use crate::backup_store::BackupStore;

/// The controller name: metrics label, Lease `dbops-backup-controller`, Event reporter.
const CONTROLLER: &str = "backup-controller";

#[derive(Parser, Debug)]
#[command(
    name = "dbops-backup-controller",
    version,
    about = "Reconciles dbops.dev Backup objects"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// Where backup artifacts go: file:///absolute/path or s3://bucket/prefix.
    #[arg(
        long,
        env = "DBOPS_BACKUP_STORE",
        default_value = "file:///var/lib/dbops/backups"
    )]
    backup_store: BackupStore,

    /// How many pg_dump runs may be in flight at once (at least 1).
    #[arg(long, env = "DBOPS_MAX_CONCURRENT_BACKUPS", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(1..))]
    max_concurrent_backups: u16,
}

/// This controller's own settings, handed to every reconcile.
#[derive(Debug)]
#[expect(
    dead_code,
    reason = "read by the backup logic of the next issues; only logged for now"
)]
struct State {
    backup_store: BackupStore,
    max_concurrent_backups: u16,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _telemetry = match telemetry::init("dbops-backup-controller", &args.common) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("dbops-backup-controller: {error}");
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(
        backup_store = %args.backup_store,
        max_concurrent_backups = args.max_concurrent_backups,
        "backup settings"
    );
    let state = State {
        backup_store: args.backup_store,
        max_concurrent_backups: args.max_concurrent_backups,
    };
    match controller::run::<Backup, _, _, _, _>(
        CONTROLLER,
        &args.common,
        move |_, _| state,
        controller::no_extra_watches(),
        reconcile,
    )
    .await
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error}");
            ExitCode::FAILURE
        }
    }
}

/// Observes the object and does nothing else yet.
async fn reconcile(
    obj: Arc<Backup>,
    ctx: Arc<Context<State>>,
) -> Result<Action, std::convert::Infallible> {
    tracing::debug!(
        "observed Backup {}/{} generation {}",
        obj.namespace().unwrap_or_default(),
        obj.name_any(),
        obj.metadata.generation.unwrap_or_default()
    );
    Ok(Action::requeue(ctx.resync_interval))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dbops_shared::{health::HealthState, metrics::Metrics};
    use http::{Request, Response};
    use kube::{Client, client::Body};

    use super::*;

    /// Unit test with a mocked API (tower-test), not an integration test: the reconcile,
    /// run through the shared wrapper, requeues after the resync interval and sends nothing
    /// to the API server.
    #[tokio::test]
    async fn reconcile_observes_and_makes_no_api_call() {
        let (service, mut api) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let args = Args::try_parse_from(["dbops-backup-controller"]).unwrap();
        let ctx: Arc<Context<State>> = Arc::new(Context::new(
            CONTROLLER,
            Client::new(service, "default"),
            &args.common,
            HealthState::new(false),
            Arc::new(Metrics::new(CONTROLLER)),
            State {
                backup_store: args.backup_store,
                max_concurrent_backups: args.max_concurrent_backups,
            },
        ));
        let obj: Backup = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
            "metadata": {"name": "orders-manual-1", "namespace": "default", "uid": "uid-1", "generation": 1},
            "spec": {"databaseRef": {"name": "orders"}}
        }))
        .unwrap();

        let work = reconcile(Arc::new(obj.clone()), ctx.clone());
        let action = controller::instrumented_reconcile(Arc::new(obj), ctx.clone(), work)
            .await
            .unwrap();
        assert_eq!(action, Action::requeue(args.common.resync_interval));

        drop(ctx);
        let next = tokio::time::timeout(Duration::from_secs(5), api.next_request()).await;
        assert!(matches!(next, Ok(None)), "reconcile called the API");
    }
}
