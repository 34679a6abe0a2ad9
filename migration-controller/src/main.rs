//! dbops migration-controller: reconciles `Migration` objects (dbops.dev/v1alpha1).
//!
//! For now the reconcile does only honest minimal work: it logs at debug
//! "observed Migration <namespace>/<name> generation <g>" and requeues after
//! `--resync-interval`. It makes NO writes, to the API or to PostgreSQL; the real logic
//! comes in later issues. It will later also watch Databases and Backups (the migration snapshot); not yet.
//!
//! Startup: telemetry, a Kubernetes client (KUBECONFIG or in-cluster), a check that the
//! CRD migrations.dbops.dev is served (exit 1 with "CRD migrations.dbops.dev is not installed" otherwise), the health
//! and metrics server, then the controller until SIGTERM/SIGINT, after which the process
//! exits 0 once in-flight reconciles have finished.

use std::{process::ExitCode, sync::Arc};

use clap::Parser;
use dbops_api::Migration;
use dbops_shared::{
    cli::CommonArgs,
    controller::{self, Context},
    telemetry,
};
use kube::{ResourceExt, runtime::controller::Action};

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
    controller::exit_code(
        controller::run::<Migration, _, _, _, _>(
            CONTROLLER,
            &args.common,
            move |_, _| (),
            controller::Trigger::AnyChange,
            controller::no_extra_watches(),
            reconcile,
        )
        .await,
    )
}

/// Observes the object and does nothing else yet.
async fn reconcile(
    obj: Arc<Migration>,
    ctx: Arc<Context<()>>,
) -> Result<Action, std::convert::Infallible> {
    tracing::debug!(
        "observed Migration {}/{} generation {}",
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
        let args = Args::try_parse_from(["dbops-migration-controller"]).unwrap();
        let ctx: Arc<Context<()>> = Arc::new(Context::new(
            CONTROLLER,
            Client::new(service, "default"),
            &args.common,
            HealthState::new(false),
            Arc::new(Metrics::new(CONTROLLER)),
            (),
        ));
        let obj: Migration = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Migration",
            "metadata": {"name": "orders-to-target", "namespace": "default", "uid": "uid-1", "generation": 1},
            "spec": {
                "databaseRef": {"name": "orders"},
                "target": {"server": {"host": "127.0.0.1", "adminSecretRef": {"name": "pg-target-admin"}}}
            }
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
