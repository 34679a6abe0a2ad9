//! `dbops-bench backup`: see `backup.rs`; `dbops-bench secrets`: see `secrets.rs`;
//! `dbops-bench outage`: see `outage.rs`.
//!
//! `dbops-bench databases`: N Databases applied at once on one PostgreSQL server, through
//! the database-controller, next to a baseline that issues the same SQL and creates the
//! same Secrets directly from one process, on the same control plane in the same run.
//!
//! Reports: time until all are Ready, API writes per Database (from the apiserver's
//! /metrics), writes and DDL while idle over two resync intervals, and the controller's
//! peak RSS and CPU seconds.
//!
//! Each controller run has its own DatabaseServer (plain TCP, every namespace allowed),
//! labelled `dbops.dev/bench=<tenant namespace>` and served only by that run's controller
//! (`--server-selector`); its admin Secret is in a namespace of its own,
//! `<tenant namespace>-system`, passed as `--controller-namespace` (what `dbops-system` is
//! in a cluster), so the tenant namespace holds no admin credential. Run with `cargo run --release -p dbops-e2e --bin dbops-bench
//! -- databases` after `cargo build --release --workspace --bins` (see README).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use dbops_api::{Database, DatabaseServer};
use dbops_e2e::controlplane::Options;
use dbops_e2e::{ControlPlane, ControllerProcess, PgServer};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Mutex;

mod backup;
mod chaos;
mod outage;
mod secrets;

#[derive(Parser, Debug)]
#[command(name = "dbops-bench", about = "dbops benchmarks (reports, not tests)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Provision N Databases through the controller and by a direct baseline.
    Databases(DatabasesArgs),
    /// Dump and restore a pgbench database through the controllers and by hand.
    Backup(backup::BackupArgs),
    /// The database-controller's RSS with and without many unrelated Secrets.
    Secrets(secrets::SecretsArgs),
    /// What a PostgreSQL outage costs: connection attempts, status writes, recovery.
    Outage(outage::OutageArgs),
    /// Random SIGKILLs of leader-elected replicas and restarts of PostgreSQL and the
    /// apiserver under a random workload, then invariants (non-zero exit on a violation).
    Chaos(chaos::ChaosArgs),
}

#[derive(clap::Args, Debug)]
struct DatabasesArgs {
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// SQL sessions on the server, for the controller and the baseline alike.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// The controller's reconcile concurrency.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// The controller's client-side API rate limit (requests/s).
    #[arg(long, default_value_t = 1000)]
    api_rate_limit: u32,
    /// Run one uncounted baseline first (see the report).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    warmup: bool,
    /// The controller's resync interval; idle is observed over two of them.
    #[arg(long, default_value = "10s")]
    resync: String,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match Cli::parse().command {
        Command::Databases(args) => databases(args).await,
        Command::Backup(args) => backup::run(args).await,
        Command::Secrets(args) => secrets::run(args).await,
        Command::Outage(args) => outage::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
    }
}

async fn databases(args: DatabasesArgs) -> Result<()> {
    let tmp = tempfile::Builder::new().prefix("dbops-bench-").tempdir()?;
    let cp = ControlPlane::start(Options {
        dir: tmp.path().join("cp"),
        apiserver_port: None,
    })
    .await?;
    let client = cp.client().await?;
    println!(
        "# databases benchmark: {} Databases on one server\n",
        args.count
    );

    // Baseline and controller alternate (B C C B) so that drift in the machine's load
    // weighs on both alike; each run has its own PostgreSQL server and namespace.
    // A warm-up baseline first (reported, not counted): on this machine the first run on a
    // fresh control plane is much faster than every later run of either kind (45 s against
    // 63-67 s for the next baselines, or 32 s against 65 s), and B C C B puts that first
    // run on the baseline's side.
    let warmup = if args.warmup {
        Some(run_baseline(&client, &args, 0).await?.secs)
    } else {
        None
    };
    let b1 = run_baseline(&client, &args, 1).await?;
    let c1 = run_controller(&cp, &client, &args, 1, tmp.path(), false).await?;
    let c2 = run_controller(&cp, &client, &args, 2, tmp.path(), true).await?;
    let b2 = run_baseline(&client, &args, 2).await?;

    let n = args.count as f64;
    let base = (b1.secs + b2.secs) / 2.0;
    let ctl = (c1.secs + c2.secs) / 2.0;
    println!("| | baseline (one process, direct) | database-controller | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| time until all {} exist / are Ready (runs B C C B) | {:.1} s, {:.1} s | {:.1} s, {:.1} s | {:.2}x |",
        args.count,
        b1.secs,
        b2.secs,
        c1.secs,
        c2.secs,
        ctl / base
    );
    if let Some(w) = warmup {
        println!("| warm-up baseline run before them (not counted) | {w:.1} s | | |");
    }
    println!(
        "| API writes per Database (apiserver /metrics: databases, databaseservers, secrets, events; the N creates excluded) | {:.2} | {:.2} | |",
        (b1.writes + b2.writes) / (2.0 * n),
        (c1.writes + c2.writes) / (2.0 * n)
    );
    println!(
        "| the controller's writes by kind (audit log, run 2) | | {} | |",
        c2.breakdown
    );
    println!(
        "| API writes while idle over 2 resyncs ({}) | | {:.0} | |",
        args.resync, c2.idle_writes
    );
    println!("| DDL statements while idle | | {} | |", c2.idle_ddl);
    println!(
        "| controller CPU seconds to Ready (run 1, run 2) | | {:.1}, {:.1} | |",
        c1.cpu, c2.cpu
    );
    println!(
        "| controller peak RSS (run 1, run 2) | | {:.1} MiB, {:.1} MiB | |",
        c1.rss_kib as f64 / 1024.0,
        c2.rss_kib as f64 / 1024.0
    );
    println!(
        "\nsettings: {} SQL sessions each, controller --concurrency={} --api-rate-limit={} --resync-interval={}; {} cores",
        args.sessions,
        args.concurrency,
        args.api_rate_limit,
        args.resync,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    Ok(())
}

struct BaselineRun {
    secs: f64,
    writes: f64,
}

async fn run_baseline(
    client: &kube::Client,
    args: &DatabasesArgs,
    round: u32,
) -> Result<BaselineRun> {
    let pg = PgServer::start(&format!("baseline{round}")).await?;
    let ns = namespace(client, &format!("bench-baseline-{round}")).await?;
    let w0 = api_writes(client).await?;
    let t0 = Instant::now();
    baseline(client, &ns, &pg, args).await?;
    Ok(BaselineRun {
        secs: t0.elapsed().as_secs_f64(),
        writes: api_writes(client).await? - w0,
    })
}

struct ControllerRun {
    secs: f64,
    writes: f64,
    cpu: f64,
    rss_kib: u64,
    breakdown: String,
    idle_writes: f64,
    idle_ddl: usize,
}

async fn run_controller(
    cp: &ControlPlane,
    client: &kube::Client,
    args: &DatabasesArgs,
    round: u32,
    dir: &std::path::Path,
    observe_idle: bool,
) -> Result<ControllerRun> {
    let pg = PgServer::start(&format!("controller{round}")).await?;
    let ns = namespace(client, &format!("bench-controller-{round}")).await?;
    let server = BenchServer::create(client, &ns, &pg).await?;
    let kubeconfig = cp.kubeconfig_for("dbops-database-controller", &["system:masters"])?;
    let mut extra = vec![
        format!("--watch-namespace={ns}"),
        format!("--concurrency={}", args.concurrency),
        format!("--max-sessions-per-server={}", args.sessions),
        format!("--api-rate-limit={}", args.api_rate_limit),
        format!("--resync-interval={}", args.resync),
        "--log-filter=warn".to_string(),
    ];
    extra.extend(server.controller_args());
    let log_dir = dir.join(format!("controller-{round}"));
    std::fs::create_dir_all(&log_dir)?;
    let controller =
        ControllerProcess::start("database-controller", &kubeconfig, &log_dir, &extra)?;
    let pid = controller.process.pid();
    let (cpu0, _) = proc_usage(pid)?;

    let dbs: Api<Database> = Api::namespaced(client.clone(), &ns);
    let w0 = api_writes(client).await?;
    let t0 = Instant::now();
    let all_ready = wait_all_ready(dbs.clone(), args.count);
    let create = stream::iter(0..args.count)
        .map(|i| {
            let dbs = dbs.clone();
            let server = server.name.clone();
            async move {
                let db: Database = serde_json::from_value(serde_json::json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
                    "metadata": {"name": format!("db-{i:05}")},
                    "spec": {"serverRef": {"name": server}}
                }))?;
                dbs.create(&PostParams::default(), &db).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>();
    let (created, ready) = tokio::join!(create, all_ready);
    created?;
    ready?;
    let secs = t0.elapsed().as_secs_f64();
    let writes = api_writes(client).await? - w0 - args.count as f64;
    let (cpu1, rss_kib) = proc_usage(pid)?;

    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    // This run's namespace, and its DatabaseServer (cluster-scoped: no namespace).
    for w in cp
        .audit_writes("dbops-database-controller", None)?
        .into_iter()
        .filter(|w| w.namespace == ns || (w.namespace.is_empty() && w.name == server.name))
    {
        let kind = if w.subresource.is_empty() {
            format!("{} {}", w.verb, w.resource)
        } else {
            format!("{} {}/{}", w.verb, w.resource, w.subresource)
        };
        *by_kind.entry(kind).or_default() += 1;
    }
    let breakdown = by_kind
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ");

    let (mut idle_writes, mut idle_ddl) = (0.0, 0);
    if observe_idle {
        let resync = parse_secs(&args.resync)?;
        let ddl0 = pg.ddl_statements()?.len();
        let w_idle0 = api_writes(client).await?;
        tokio::time::sleep(Duration::from_secs_f64(resync * 2.0 + 2.0)).await;
        idle_writes = api_writes(client).await? - w_idle0;
        idle_ddl = pg.ddl_statements()?.len() - ddl0;
    }
    drop(controller);
    Ok(ControllerRun {
        secs,
        writes,
        cpu: cpu1 - cpu0,
        rss_kib,
        breakdown,
        idle_writes,
        idle_ddl,
    })
}

pub(crate) async fn namespace(client: &kube::Client, name: &str) -> Result<String> {
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.to_string());
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(name.to_string())
}

/// A bench's DatabaseServer: named like its tenant namespace, plain TCP, every namespace
/// allowed, labelled `dbops.dev/bench=<tenant namespace>`; its admin Secret `pg-admin` in
/// `<tenant namespace>-system`, the controllers' namespace.
pub(crate) struct BenchServer {
    pub name: String,
    pub controller_namespace: String,
    pub selector: String,
}

impl BenchServer {
    pub async fn create(client: &kube::Client, tenant: &str, pg: &PgServer) -> Result<Self> {
        Self::create_at(client, tenant, pg, pg.host(), pg.port()).await
    }

    /// [`BenchServer::create`] reached at `host:port` (a proxy in front of `pg`).
    pub async fn create_at(
        client: &kube::Client,
        tenant: &str,
        pg: &PgServer,
        host: &str,
        port: u16,
    ) -> Result<Self> {
        let controller_namespace = namespace(client, &format!("{tenant}-system")).await?;
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pg-admin"},
            "stringData": {"username": "postgres", "password": pg.superuser_password()}
        }))?;
        Api::<Secret>::namespaced(client.clone(), &controller_namespace)
            .create(&PostParams::default(), &secret)
            .await
            .context("creating the admin Secret")?;
        let server: DatabaseServer = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": tenant, "labels": {BENCH_LABEL: tenant}},
            "spec": {
                "host": host, "port": port,
                "adminSecretRef": {"name": "pg-admin"},
                "tls": {"mode": "disable"},
                "allowedNamespaces": {},
            }
        }))?;
        Api::<DatabaseServer>::all(client.clone())
            .create(&PostParams::default(), &server)
            .await
            .with_context(|| format!("creating DatabaseServer {tenant}"))?;
        Ok(Self {
            name: tenant.to_string(),
            controller_namespace,
            selector: format!("{BENCH_LABEL}={tenant}"),
        })
    }

    /// `--controller-namespace` and `--server-selector` for the controllers of this run.
    pub fn controller_args(&self) -> [String; 2] {
        [
            format!("--controller-namespace={}", self.controller_namespace),
            format!("--server-selector={}", self.selector),
        ]
    }
}

/// The label on a bench's DatabaseServer: its tenant namespace.
const BENCH_LABEL: &str = "dbops.dev/bench";

/// What the controller does for a new Database, without the controller: the role (and
/// its mark) in one transaction, the database and its mark, then the Secret.
async fn baseline(
    client: &kube::Client,
    ns: &str,
    pg: &PgServer,
    args: &DatabasesArgs,
) -> Result<()> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let queue = Arc::new(Mutex::new(0..args.count));
    let mut workers = Vec::new();
    for _ in 0..args.sessions {
        let (queue, secrets) = (queue.clone(), secrets.clone());
        let conn = pg.connect_as_superuser().await?;
        let port = pg.port();
        workers.push(tokio::spawn(async move {
            loop {
                let Some(i) = queue.lock().await.next() else { break };
                let name = format!("db_{i:05}");
                let password = dbops_shared_password();
                let verifier = postgres_protocol::password::scram_sha_256(password.as_bytes());
                let mark = format!("dbops.dev/uid=baseline-{i}");
                conn.batch_execute(&format!(
                    "BEGIN; CREATE ROLE \"{name}\" LOGIN PASSWORD '{verifier}'; COMMENT ON ROLE \"{name}\" IS '{mark}'; COMMIT"
                ))
                .await?;
                conn.batch_execute(&format!("CREATE DATABASE \"{name}\" OWNER \"{name}\" CONNECTION LIMIT -1"))
                    .await?;
                conn.batch_execute(&format!(
                    "COMMENT ON DATABASE \"{name}\" IS '{mark}'; REVOKE ALL ON DATABASE \"{name}\" FROM PUBLIC"
                ))
                .await?;
                let data: BTreeMap<&str, String> = [
                    ("host", "127.0.0.1".to_string()),
                    ("port", port.to_string()),
                    ("dbname", name.clone()),
                    ("username", name.clone()),
                    ("password", password.clone()),
                    ("uri", format!("postgresql://{name}:{password}@127.0.0.1:{port}/{name}")),
                ]
                .into();
                let secret: Secret = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("db-{i:05}-connection")},
                    "stringData": data,
                }))?;
                secrets.create(&PostParams::default(), &secret).await?;
            }
            anyhow::Ok(())
        }));
    }
    for w in workers {
        w.await??;
    }
    Ok(())
}

fn dbops_shared_password() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    Alphanumeric.sample_string(&mut rand::rng(), 32)
}

/// Waits until `count` Databases in the namespace have Ready=True (a watch, no polling).
pub(crate) async fn wait_all_ready(api: Api<Database>, count: usize) -> Result<()> {
    let mut ready = std::collections::HashSet::new();
    let stream = watcher(api, watcher::Config::default()).applied_objects();
    futures::pin_mut!(stream);
    let deadline = tokio::time::sleep(Duration::from_secs(1800));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => bail!("only {} of {count} Ready after 30 minutes", ready.len()),
            next = stream.try_next() => {
                let Some(db) = next? else { bail!("watch ended") };
                let is_ready = db.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                if is_ready {
                    ready.insert(db.metadata.name.clone().unwrap_or_default());
                    if ready.len() >= count { return Ok(()); }
                }
            }
        }
    }
}

/// Sum of write requests the apiserver served for databases, databaseservers, secrets and
/// events.
async fn api_writes(client: &kube::Client) -> Result<f64> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(req)
        .await
        .context("apiserver /metrics")?;
    let mut sum = 0.0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let write = [
            "verb=\"POST\"",
            "verb=\"PATCH\"",
            "verb=\"PUT\"",
            "verb=\"DELETE\"",
            "verb=\"APPLY\"",
        ]
        .iter()
        .any(|v| line.contains(v));
        let ours = [
            "resource=\"databases\"",
            "resource=\"databaseservers\"",
            "resource=\"secrets\"",
            "resource=\"events\"",
        ]
        .iter()
        .any(|r| line.contains(r));
        if write
            && ours
            && let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())
        {
            sum += v;
        }
    }
    Ok(sum)
}

/// (CPU seconds, peak RSS in KiB) of a process, from /proc.
pub(crate) fn proc_usage(pid: u32) -> Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').map(|(_, a)| a).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok((ticks / 100.0, hwm))
}

fn parse_secs(s: &str) -> Result<f64> {
    s.strip_suffix('s')
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("--resync must be like 10s, not {s}"))
}
