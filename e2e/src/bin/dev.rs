//! `dbops-dev`: the process behind `e2e/dev`. `dbops-dev up` starts the control plane,
//! two PostgreSQL servers with admin Secrets, Jaeger, and the three controllers exporting
//! their traces to it, all under
//! `<state-dir>`, then stays in the foreground until SIGTERM or Ctrl-C stops everything.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use dbops_e2e::controlplane::Options;
use dbops_e2e::jaeger::{self, Jaeger};
use dbops_e2e::{ControlPlane, ControllerProcess, PgServer};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};

#[derive(Parser, Debug)]
#[command(
    name = "dbops-dev",
    about = "The dbops development environment (use e2e/dev)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start everything and stay in the foreground.
    Up(UpArgs),
}

#[derive(clap::Args, Debug)]
struct UpArgs {
    /// Where state, logs and the kubeconfig go; emptied first.
    #[arg(long, default_value = ".dev")]
    state_dir: PathBuf,
    /// kube-apiserver port on 127.0.0.1.
    #[arg(long, default_value_t = 56443)]
    apiserver_port: u16,
    /// Port of the main PostgreSQL server (Secret pg-main-admin).
    #[arg(long, default_value_t = 55432)]
    pg_main_port: u16,
    /// Port of the second PostgreSQL server, a migration target (Secret pg-target-admin).
    #[arg(long, default_value_t = 55433)]
    pg_target_port: u16,
    /// First of three ports for the controllers' health and metrics servers.
    #[arg(long, default_value_t = 18081)]
    metrics_base_port: u16,
    /// Jaeger's query API and UI on 127.0.0.1.
    #[arg(long, default_value_t = 16686)]
    jaeger_query_port: u16,
    /// Jaeger's OTLP/gRPC receiver on 127.0.0.1 (the controllers' --otlp-endpoint).
    #[arg(long, default_value_t = 4317)]
    jaeger_otlp_port: u16,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_client::client::builder=off".into()),
        )
        .init();
    match Cli::parse().command {
        Command::Up(args) => up(args).await,
    }
}

async fn up(args: UpArgs) -> Result<()> {
    let started = Instant::now();
    let state = std::path::absolute(&args.state_dir)?;
    if state.exists() {
        std::fs::remove_dir_all(&state).with_context(|| format!("emptying {}", state.display()))?;
    }
    let logs = state.join("logs");
    std::fs::create_dir_all(&logs)?;

    let cp = ControlPlane::start(Options {
        dir: state.join("controlplane"),
        apiserver_port: Some(args.apiserver_port),
    })
    .await?;
    let kubeconfig = state.join("kubeconfig");
    std::fs::copy(cp.kubeconfig(), &kubeconfig)?;

    let (main_dir, target_dir) = (state.join("pg-main"), state.join("pg-target"));
    let (main, target) = tokio::join!(
        PgServer::start_in("main", &main_dir, Some(args.pg_main_port)),
        PgServer::start_in("target", &target_dir, Some(args.pg_target_port)),
    );
    let (main, target) = (main?, target?);
    let client = cp.client().await?;
    for (name, server) in [("pg-main-admin", &main), ("pg-target-admin", &target)] {
        apply_admin_secret(&client, "default", name, server).await?;
    }

    let jaeger_dir = state.join("jaeger");
    std::fs::create_dir_all(&jaeger_dir)?;
    let jaeger = Jaeger::start_on(
        &jaeger_dir,
        jaeger::Ports {
            otlp_grpc: args.jaeger_otlp_port,
            query_http: args.jaeger_query_port,
            query_grpc: dbops_e2e::process::free_port()?,
            health: dbops_e2e::process::free_port()?,
        },
    )?;

    let backups = state.join("backups");
    std::fs::create_dir_all(&backups)?;
    let controllers = start_controllers(
        &kubeconfig,
        &logs,
        &backups,
        args.metrics_base_port,
        &jaeger.otlp_endpoint(),
    )?;

    let summary = format!(
        "dbops dev environment is up ({:.0}s)\n\
         \n  export KUBECONFIG={kubeconfig}\n  kubectl apply -f deploy/examples/\n\n\
         kube-apiserver  {server}\n\
         PostgreSQL      main 127.0.0.1:{main_port} (Secret default/pg-main-admin), \
         target 127.0.0.1:{target_port} (Secret default/pg-target-admin)\n\
         controllers     {controllers}\n\
         Jaeger          {jaeger} (API: {jaeger}/api/services, {jaeger}/api/traces?service=dbops-database-controller)\n\
         logs            {logs}\n",
        started.elapsed().as_secs_f64(),
        kubeconfig = kubeconfig.display(),
        server = cp.server(),
        main_port = main.port(),
        target_port = target.port(),
        controllers = controllers
            .iter()
            .map(|c| format!(
                "{} http://127.0.0.1:{}/metrics",
                c.process.name(),
                c.metrics_port
            ))
            .collect::<Vec<_>>()
            .join(", "),
        jaeger = jaeger.query_url(),
        logs = logs.display(),
    );
    std::fs::write(state.join("ready"), &summary)?;
    println!("{summary}");

    wait_for_stop_signal().await?;
    println!("stopping the dev environment");
    std::fs::remove_file(state.join("ready")).ok();
    drop(controllers);
    drop(jaeger);
    drop((main, target));
    drop(cp);
    Ok(())
}

fn start_controllers(
    kubeconfig: &Path,
    logs: &Path,
    backups: &Path,
    base_port: u16,
    otlp_endpoint: &str,
) -> Result<Vec<ControllerProcess>> {
    let store = format!("--backup-store=file://{}", backups.display());
    let otlp = format!("--otlp-endpoint={otlp_endpoint}");
    let bin = dbops_e2e::paths::postgres_bin_dir()?;
    let pg_dump = format!("--pg-dump={}", bin.join("pg_dump").display());
    let pg_restore = format!("--pg-restore={}", bin.join("pg_restore").display());
    [
        // The database-controller restores `spec.restoreFrom` from the same store.
        (
            "database-controller",
            vec![store.clone(), pg_restore.clone()],
        ),
        ("backup-controller", vec![store, pg_dump.clone()]),
        ("migration-controller", vec![pg_dump, pg_restore]),
    ]
    .into_iter()
    .zip(base_port..)
    .map(|((name, mut args), port)| {
        args.push(otlp.clone());
        // The controllers' own namespace (Leases, the backup store's registration
        // ConfigMap), here `default`, where the admin Secrets are too.
        args.push("--controller-namespace=default".to_string());
        ControllerProcess::start_on(name, kubeconfig, logs, port, &args)
    })
    .collect()
}

async fn apply_admin_secret(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    server: &PgServer,
) -> Result<()> {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "stringData": {
            "username": dbops_e2e::postgres::SUPERUSER,
            "password": server.superuser_password(),
        },
    }))?;
    Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(
            name,
            &PatchParams::apply("dbops-dev").force(),
            &Patch::Apply(&secret),
        )
        .await
        .with_context(|| format!("creating Secret {namespace}/{name}"))?;
    Ok(())
}

async fn wait_for_stop_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r?,
    }
    Ok(())
}
