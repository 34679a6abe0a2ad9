//! `dbops-dev`: the process behind `e2e/dev`. `dbops-dev up` starts the control plane;
//! two PostgreSQL servers speaking TLS with certificates for `localhost` signed by a CA of
//! its own (pg-main Debian's 15, pg-target [`TARGET_MAJOR`]), both logging every statement
//! and keeping them in `pg_stat_statements` too; in `dbops-system`, the controllers'
//! namespace, the servers' admin Secrets and the CA Secret; the DatabaseServers of
//! `deploy/examples/databaseserver.yaml`; Jaeger; and the three controllers exporting
//! their traces to it, all under `<state-dir>`, then stays in the foreground until
//! SIGTERM or Ctrl-C stops everything.
//!
//! `dbops-dev audit` looks for every password the environment handed out (admin and
//! connection Secrets, subscriptions' connection strings) in the servers' and the
//! controllers' logs and in `pg_stat_statements`, and checks that the servers keep SCRAM
//! verifiers only (`e2e/tour` runs it beside the tour, with `--watch`).

use std::path::{Path, PathBuf};
use std::time::Instant;

#[path = "dev/audit.rs"]
mod audit;
#[path = "dev/pooler.rs"]
mod pooler;
#[path = "dev/supervise.rs"]
mod supervise;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use dbops_e2e::controlplane::Options;
use dbops_e2e::jaeger::{self, Jaeger};
use dbops_e2e::tls::TestCa;
use dbops_e2e::{ControlPlane, ControllerProcess, Kubectl, PgServer};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, Patch, PatchParams};
use serde::Deserialize;

/// The controllers' own namespace, as in `deploy/`: their Leases, the backup store's
/// registration, and the DatabaseServers' admin and CA Secrets.
const CONTROLLER_NAMESPACE: &str = "dbops-system";

/// The host name the servers' certificates are for, and the DatabaseServers' `spec.host`.
const PG_HOST: &str = "localhost";

/// The Secrets of the backups' encryption keys (`--backup-recipients-secret`,
/// `--backup-identities-secret`).
const BACKUP_RECIPIENTS: &str = "dbops-backup-recipients";
const BACKUP_IDENTITIES: &str = "dbops-backup-identities";

/// The CA Secret (key `ca.crt`) both DatabaseServers name in `spec.tls.caSecretRef`.
const CA_SECRET: &str = "pg-ca";

/// The DatabaseServers the dev environment creates, from this file.
const SERVERS_EXAMPLE: &str = "deploy/examples/databaseserver.yaml";

/// The major of the migration target, pg-target (pg-main is Debian's, 15): Logical
/// Migrations go only to 16 and newer, whose subscriptions apply as each table's owner.
const TARGET_MAJOR: u32 = 17;

/// Each DatabaseServer and its PostgreSQL server's name (`<state-dir>/<DatabaseServer>/`
/// holds its data and its log `postgres-<name>.log`).
const SERVERS: [(&str, &str); 2] = [("pg-main", "main"), ("pg-target", "target")];
/// The DatabaseServer Backups with `verify: true` are restored on (`--verify-server`):
/// pg-target's PostgreSQL again, admitting no namespace.
const VERIFY_SERVER: &str = "pg-verify";

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
    /// Look for the environment's passwords where none may be (the servers' and the
    /// controllers' logs, pg_stat_statements) and for passwords kept otherwise than as
    /// SCRAM verifiers; exit 1 on any finding. Never prints a password.
    Audit(AuditArgs),
}

#[derive(clap::Args, Debug)]
struct AuditArgs {
    /// The dev environment's state directory.
    #[arg(long, default_value = ".dev")]
    state_dir: PathBuf,
    /// Gather passwords until SIGTERM or Ctrl-C (every version of every Secret, every
    /// subscription's connection string), then audit: for short-lived secrets.
    #[arg(long)]
    watch: bool,
    /// With --watch: created once the watch has started.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Fail unless secrets of this kind were gathered (repeatable): `connection-secret`
    /// (a Database's `<name>-connection`), `subscription` (a Logical Migration's).
    #[arg(long = "expect")]
    expect: Vec<String>,
}

#[derive(clap::Args, Debug)]
struct UpArgs {
    /// Where state, logs and the kubeconfig go; emptied first.
    #[arg(long, default_value = ".dev")]
    state_dir: PathBuf,
    /// kube-apiserver port on 127.0.0.1.
    #[arg(long, default_value_t = 16443)]
    apiserver_port: u16,
    /// Port of the main PostgreSQL server (DatabaseServer pg-main; the example says 15432).
    #[arg(long, default_value_t = 15432)]
    pg_main_port: u16,
    /// Port of the second PostgreSQL server, a migration target (DatabaseServer
    /// pg-target; the example says 15433).
    #[arg(long, default_value_t = 15433)]
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
    /// Port on 127.0.0.1 of pg-main's pooler (PgBouncer on the pooler's Secret, standing
    /// in for its Pod).
    #[arg(long, default_value_t = 16432)]
    pooler_port: u16,
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
        Command::Audit(args) => {
            if audit::run(args).await? {
                Ok(())
            } else {
                std::process::exit(1)
            }
        }
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

    // One CA; one certificate for `localhost` and 127.0.0.1 serves both servers (they
    // differ by port only). ca.crt is also left in the state directory for psql:
    // `psql "host=localhost port=15432 sslmode=verify-full sslrootcert=.dev/ca.crt ..."`.
    let ca = TestCa::new("dbops dev CA")?;
    let cert = ca.server_cert(&[PG_HOST], &[std::net::Ipv4Addr::LOCALHOST.into()])?;
    std::fs::write(state.join("ca.crt"), ca.pem())?;
    let (main_dir, target_dir) = (state.join(SERVERS[0].0), state.join(SERVERS[1].0));
    // Both with wal_level=logical: Migrations between them (deploy/examples/) run in
    // Logical mode, the source writable until a short freeze. Both record every
    // statement (the log, pg_stat_statements): `dbops-dev audit` finds no password there.
    let settings = |bin: &Path| {
        let mut settings = dbops_e2e::postgres::LOGICAL_REPLICATION.to_vec();
        settings.extend(dbops_e2e::postgres::statement_recording(bin));
        settings
    };
    let main_settings = settings(&dbops_e2e::paths::postgres_bin_dir()?);
    let target_settings = settings(&dbops_e2e::postgres::bin_dir(TARGET_MAJOR)?);
    let (main, target) = tokio::join!(
        PgServer::start_in_with(
            SERVERS[0].1,
            &main_dir,
            Some(args.pg_main_port),
            Some(&cert),
            &main_settings
        ),
        PgServer::start_major_in_with(
            SERVERS[1].1,
            TARGET_MAJOR,
            &target_dir,
            Some(args.pg_target_port),
            Some(&cert),
            &target_settings
        ),
    );
    let (main, target) = (main?, target?);
    let mut versions = Vec::new();
    for server in [&main, &target] {
        versions.push(prepare_server(server).await?);
    }
    let client = cp.client().await?;
    apply_namespace(&client, CONTROLLER_NAMESPACE).await?;
    for (name, server) in [("pg-main-admin", &main), ("pg-target-admin", &target)] {
        apply_secret(
            &client,
            CONTROLLER_NAMESPACE,
            name,
            serde_json::json!({
                "username": dbops_e2e::postgres::SUPERUSER,
                "password": server.superuser_password(),
            }),
        )
        .await?;
    }
    apply_secret(
        &client,
        CONTROLLER_NAMESPACE,
        CA_SECRET,
        serde_json::json!({"ca.crt": ca.pem()}),
    )
    .await?;
    let port_warnings = apply_servers(
        &Kubectl::new(&kubeconfig),
        &[
            ("pg-main", main.port()),
            ("pg-target", target.port()),
            (VERIFY_SERVER, target.port()),
        ],
    )?;

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

    let backup_key = apply_backup_keys(&client, &state).await?;
    let backups = state.join("backups");
    std::fs::create_dir_all(&backups)?;
    let mut controllers = start_controllers(
        &kubeconfig,
        &logs,
        &backups,
        args.metrics_base_port,
        &jaeger.otlp_endpoint(),
    )?;

    let pooler_dir = state.join("pooler");
    let pooler = pooler::start(
        &client,
        CONTROLLER_NAMESPACE,
        SERVERS[0].0,
        ca.pem(),
        &pooler_dir,
        args.pooler_port,
        std::time::Duration::from_secs(90),
    )
    .await?;
    let pooler_addr = format!("&hostaddr=127.0.0.1&port={}", pooler.bouncer.port());
    std::fs::write(state.join("pooler-addr"), &pooler_addr)?;

    let mut summary = format!(
        "dbops dev environment is up ({:.0}s)\n\
         \n  export KUBECONFIG={kubeconfig}\n  kubectl apply -f deploy/examples/\n\n\
         kube-apiserver  {server}\n\
         PostgreSQL      DatabaseServer pg-main {host}:{main_port} ({main_version}), pg-target {host}:{target_port} ({target_version}) \
         (TLS verify-full, wal_level=logical, every statement logged; Secrets {ns}/pg-main-admin, {ns}/pg-target-admin, {ns}/{ca_secret}; CA also in {ca_file})\n\
         pooler          PgBouncer of pg-main on 127.0.0.1:{pooler_port}, standing in for the Pod of Service {ns}/{pooler_service} \
         (the Secrets' pooler-uri names the Service: append $DBOPS_POOLER_ADDR, {pooler_addr})\n\
         backups         {backups}, encrypted to {backup_key} (age; the identity in {ns}/{identities} and {identity_file})\n\
         controllers     {controllers}\n\
         Jaeger          {jaeger} (API: {jaeger}/api/services, {jaeger}/api/traces?service=dbops-database-controller)\n\
         logs            {logs}\n",
        started.elapsed().as_secs_f64(),
        kubeconfig = kubeconfig.display(),
        server = cp.server(),
        host = PG_HOST,
        main_port = main.port(),
        target_port = target.port(),
        main_version = versions[0],
        target_version = versions[1],
        ns = CONTROLLER_NAMESPACE,
        ca_secret = CA_SECRET,
        ca_file = state.join("ca.crt").display(),
        pooler_port = pooler.bouncer.port(),
        pooler_service = dbops_shared::pooler::object_name(SERVERS[0].0),
        controllers = controllers
            .iter()
            .map(|c| format!("{} http://127.0.0.1:{}/metrics", c.name, c.port))
            .collect::<Vec<_>>()
            .join(", "),
        jaeger = jaeger.query_url(),
        logs = logs.display(),
        backups = backups.display(),
        identities = BACKUP_IDENTITIES,
        identity_file = state.join("backup-identity.txt").display(),
    );
    for warning in port_warnings {
        summary.push_str(&format!("note            {warning}\n"));
    }
    std::fs::write(state.join("ready"), &summary)?;
    println!("{summary}");

    // Until SIGTERM or Ctrl-C: a controller that exits is started again (with backoff).
    let paths = supervise::Paths {
        kubeconfig: kubeconfig.clone(),
        logs: logs.clone(),
        state: state.clone(),
    };
    std::fs::remove_file(supervise::restarts_file(&state)).ok();
    supervise::supervise(&mut controllers, &paths, wait_for_stop_signal()).await?;
    println!("stopping the dev environment");
    std::fs::remove_file(state.join("ready")).ok();
    drop(controllers);
    drop(pooler);
    drop(jaeger);
    drop((main, target));
    drop(cp);
    Ok(())
}

/// Creates `pg_stat_statements` in the `postgres` database where the server loads it;
/// returns the server's version (`PostgreSQL 17.10`).
async fn prepare_server(server: &PgServer) -> Result<String> {
    let client = server.connect_as_superuser().await?;
    let row = client
        .query_one(
            "SELECT current_setting('server_version'), \
                    current_setting('shared_preload_libraries') LIKE '%pg_stat_statements%'",
            &[],
        )
        .await?;
    let (version, pgss): (String, bool) = (row.get(0), row.get(1));
    if pgss {
        client
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await
            .context("creating pg_stat_statements")?;
    }
    Ok(format!("PostgreSQL {version}"))
}

fn start_controllers(
    kubeconfig: &Path,
    logs: &Path,
    backups: &Path,
    base_port: u16,
    otlp_endpoint: &str,
) -> Result<Vec<supervise::Supervisee>> {
    let store = format!("--backup-store=file://{}", backups.display());
    let recipients = format!("--backup-recipients-secret={BACKUP_RECIPIENTS}");
    let identities = format!("--backup-identities-secret={BACKUP_IDENTITIES}");
    let otlp = format!("--otlp-endpoint={otlp_endpoint}");
    let bin = dbops_e2e::paths::postgres_bin_dir()?;
    let pg_dump = format!("--pg-dump={}", bin.join("pg_dump").display());
    let pg_restore = format!("--pg-restore={}", bin.join("pg_restore").display());
    [
        // The database-controller restores `spec.restoreFrom` from the same store, and
        // copies `spec.cloneFrom` with pg_dump and the psql beside it.
        (
            "database-controller",
            vec![
                store.clone(),
                pg_restore.clone(),
                pg_dump.clone(),
                identities.clone(),
            ],
        ),
        // It verifies Backups on pg-verify, opening encrypted ones with the identities.
        (
            "backup-controller",
            vec![
                store,
                pg_dump.clone(),
                pg_restore.clone(),
                recipients,
                identities.clone(),
                format!("--verify-server={VERIFY_SERVER}"),
            ],
        ),
        ("migration-controller", vec![pg_dump, pg_restore]),
    ]
    .into_iter()
    .zip(base_port..)
    .map(|((name, mut args), port)| {
        args.push(otlp.clone());
        // The controllers' own namespace, as in a cluster: Leases, the backup store's
        // registration ConfigMap, and the DatabaseServers' admin and CA Secrets.
        args.push(format!("--controller-namespace={CONTROLLER_NAMESPACE}"));
        let process = ControllerProcess::start_on(name, kubeconfig, logs, port, &args)?;
        Ok(supervise::Supervisee::new(name, port, args, process))
    })
    .collect()
}

/// The Secrets of the backups' encryption (a new age key pair each `up`, as the store is
/// new too): the public key for the backup-controller, the secret key for the
/// database-controller, and the secret key in the state directory for `age -d` by hand.
/// Returns the public key.
async fn apply_backup_keys(client: &kube::Client, state: &Path) -> Result<String> {
    let (identity, public) = dbops_shared::sealing::Identities::generate();
    apply_secret(
        client,
        CONTROLLER_NAMESPACE,
        BACKUP_RECIPIENTS,
        serde_json::json!({ dbops_shared::sealing::RECIPIENTS_KEY: public }),
    )
    .await?;
    apply_secret(
        client,
        CONTROLLER_NAMESPACE,
        BACKUP_IDENTITIES,
        serde_json::json!({ dbops_shared::sealing::IDENTITIES_KEY: identity }),
    )
    .await?;
    let file = state.join("backup-identity.txt");
    std::fs::write(&file, format!("# public key: {public}\n{identity}\n"))?;
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(public)
}

async fn apply_namespace(client: &kube::Client, name: &str) -> Result<()> {
    let namespace: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "dbops"}},
    }))?;
    Api::<Namespace>::all(client.clone())
        .patch(
            name,
            &PatchParams::apply("dbops-dev").force(),
            &Patch::Apply(&namespace),
        )
        .await
        .with_context(|| format!("creating Namespace {name}"))?;
    Ok(())
}

async fn apply_secret(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    string_data: serde_json::Value,
) -> Result<()> {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "stringData": string_data,
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

/// `kubectl apply` of the DatabaseServers in `deploy/examples/databaseserver.yaml`, each
/// with the port its server got (the example's, unless `--pg-*-port` says otherwise), so
/// that `kubectl apply -f deploy/examples/` later finds them as it would have made them.
/// Returns a warning for each port that differs from the example's (applying the example
/// again would point the server at the example's port).
fn apply_servers(kubectl: &Kubectl, ports: &[(&str, u16)]) -> Result<Vec<String>> {
    let path = dbops_e2e::paths::repo_root().join(SERVERS_EXAMPLE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (mut docs, mut warnings) = (Vec::new(), Vec::new());
    for doc in serde_norway::Deserializer::from_str(&text) {
        let mut server = serde_json::Value::deserialize(doc)
            .with_context(|| format!("parsing {}", path.display()))?;
        let name = server["metadata"]["name"].as_str().unwrap_or_default();
        let Some(&(_, port)) = ports.iter().find(|(n, _)| *n == name) else {
            bail!("{}: unexpected DatabaseServer {name:?}", path.display());
        };
        if server["spec"]["host"] != PG_HOST {
            bail!(
                "{}: DatabaseServer {name} must have host {PG_HOST}, the name in the servers' certificate",
                path.display()
            );
        }
        if server["spec"]["port"].as_u64() != Some(port.into()) {
            warnings.push(format!(
                "DatabaseServer {name} is on port {port}, {SERVERS_EXAMPLE} says {}: \
                 applying that file points it there",
                server["spec"]["port"]
            ));
        }
        server["spec"]["port"] = port.into();
        docs.push(server);
    }
    if docs.len() != ports.len() {
        bail!(
            "{}: expected the DatabaseServers {:?}",
            path.display(),
            ports.iter().map(|(n, _)| n).collect::<Vec<_>>()
        );
    }
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": docs});
    let out = kubectl.run(&["apply", "-f", "-"], Some(&list.to_string()))?;
    if !out.success {
        bail!("kubectl apply of {}: {}", path.display(), out.text());
    }
    Ok(warnings)
}

async fn wait_for_stop_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r?,
    }
    Ok(())
}
