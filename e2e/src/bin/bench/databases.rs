//! `dbops-bench databases`: N Databases applied at once on one PostgreSQL server, spread
//! round-robin over `--namespaces` tenant namespaces, through the database-controller,
//! next to a baseline that issues the same SQL and creates the same Secrets (in the same
//! namespaces) directly from one process, on the same control plane in the same run;
//! baseline (B) and controller runs in the order `--order` says: with the bench's flags
//! (C: `--concurrency`, `--sessions`, `--api-rate-limit`, `--resync`) or with the shipped defaults
//! (D: none of them given).
//!
//! Reports: time until all are Ready, API writes per Database (from the apiserver's
//! /metrics), writes and DDL while idle over two resync intervals, the controller's CPU
//! seconds and its RSS idle (ready, before any Database), at its peak and settled (all
//! Ready, two resyncs later), per Database above idle; and, after the last controller run,
//! a restart over the N converged Databases (see `scale.rs`): time to ready and to every
//! Database reconciled, API writes, DDL and SQL round trips until two resyncs later.
//!
//! Each controller run has its own DatabaseServer (plain TCP, every namespace allowed),
//! labelled `dbops.dev/bench=<run>` and served only by that run's controller
//! (`--server-selector`); its admin Secret is in a namespace of its own, `<run>-system`,
//! passed as `--controller-namespace` (what `dbops-system` is in a cluster), so no tenant
//! namespace holds an admin credential. With one tenant namespace (`<run>`) the controller
//! watches only it (`--watch-namespace`); with more (`<run>-000`, `<run>-001`, ...) it
//! watches all namespaces. Each run's tenant namespaces are deleted (and gone) before the
//! next run starts, so every run starts from the same state: without that, each controller
//! run was slower than the one before (the 1,000 Databases left by each), and a
//! controller watching all namespaces would find (and serve) the runs' before it. Run
//! with `cargo run --release -p dbops-e2e --bin dbops-bench -- databases` after
//! `cargo build --release --workspace --bins` (see README).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dbops_api::Database;
use dbops_e2e::{ControlPlane, PgServer};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use tokio::sync::Mutex;

use crate::bed::{BenchServer, create_databases, random_password, start_control_plane, wait_ready};
use crate::measure::{api_writes, cpu_by_program, cpu_spent, proc_usage, writes_by_kind};
use crate::scale::{self, phases, requests_per_database};

#[derive(clap::Args, Debug)]
pub struct DatabasesArgs {
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// Load pg_stat_statements into each run's server and report the statements that took
    /// the server the most time (planning and execution), for both kinds of run.
    #[arg(long)]
    statements: bool,
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
    /// The resync interval of the tuned runs (C); idle is observed over two of them, in
    /// every run. A D run resyncs as shipped (every 300 s): at 10,000 Databases a 10 s
    /// resync asks for 1,000 routine checks a second, which is not what a user runs.
    #[arg(long, default_value = "10s")]
    resync: String,
    /// Tenant namespaces the Databases (and the baseline's Secrets) are spread over,
    /// round-robin. With more than one, the controller watches all namespaces.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    namespaces: u32,
    /// Where the control plane's and the servers' data go: a tmpfs (default `/dev/shm`,
    /// when it is there), or `disk` for the temporary directory. On this machine's disk
    /// (ext4 with `discard`) the kernel's work for the files of 1,000 CREATE DATABASE, and
    /// for those the run before deleted, took most of the servers' CPU and varied 2.4x
    /// between identical baseline runs (46-113 s); on tmpfs 13.5-15.7 s.
    #[arg(long, default_value = "/dev/shm")]
    data: String,
    /// The baseline (B) and controller runs after the warm-up, in this order: C with the
    /// bench's flags, D with the shipped defaults; ratios are of the means of each kind.
    /// The restart is measured after the last C or D.
    #[arg(long, default_value = "BCCB", value_parser = parse_order)]
    order: Order,
}

/// About this much of a server's data directory per database (its catalogs, ~7.5 MB),
/// with room for WAL.
const BYTES_PER_DATABASE: u64 = 8 << 20;

impl DatabasesArgs {
    /// The directory for `TMPDIR`, unless `--data disk` or the tmpfs is not there.
    pub fn data_dir(&self) -> Option<&str> {
        (self.data != "disk" && std::path::Path::new(&self.data).is_dir()).then_some(&self.data)
    }

    /// Refuses a `--data` directory without room for one run's databases: a full tmpfs
    /// is memory, and the kernel's OOM killer then ends the kube-apiserver mid-run (a
    /// 10,000-Database run on `/dev/shm` did, at 2,925).
    pub fn check_room(&self) -> Result<()> {
        let Some(dir) = self.data_dir() else {
            return Ok(());
        };
        let out = std::process::Command::new("df")
            .args(["--output=avail", "-B1", dir])
            .output()
            .with_context(|| format!("df {dir}"))?;
        let avail: u64 = String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .with_context(|| format!("the space left on {dir}, from df"))?;
        let need = BYTES_PER_DATABASE * self.count as u64 + (1 << 30);
        anyhow::ensure!(
            avail >= need,
            "--data {dir} has {:.1} GiB free; {} databases need about {:.1} GiB: use --data disk (for 10,000, with TMPDIR=$(e2e/bench-disk up))",
            avail as f64 / f64::from(1 << 30),
            self.count,
            need as f64 / f64::from(1 << 30)
        );
        Ok(())
    }
}

/// A baseline or a controller run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Baseline,
    /// With the bench's flags (`--concurrency`, `--sessions`, `--api-rate-limit`).
    Controller,
    /// With the flags a user gets: none of those three given.
    Defaults,
}

/// `--order`: the runs, in order.
#[derive(Clone, Debug)]
struct Order(Vec<Kind>);

fn parse_order(s: &str) -> Result<Order, String> {
    let runs = s
        .chars()
        .map(|c| match c.to_ascii_uppercase() {
            'B' => Ok(Kind::Baseline),
            'C' => Ok(Kind::Controller),
            'D' => Ok(Kind::Defaults),
            other => Err(format!("--order takes B, C and D only, not {other:?}")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if runs.is_empty() {
        return Err("--order needs at least one run (B, C or D)".into());
    }
    Ok(Order(runs))
}

impl DatabasesArgs {
    fn namespace_count(&self) -> usize {
        self.namespaces as usize
    }
}

pub async fn run(args: DatabasesArgs) -> Result<()> {
    let (tmp, cp, client) = start_control_plane("dbops-bench-").await?;
    let order: String = args
        .order
        .0
        .iter()
        .map(|k| match k {
            Kind::Baseline => 'B',
            Kind::Controller => 'C',
            Kind::Defaults => 'D',
        })
        .collect();
    println!(
        "# databases benchmark: {} Databases on one server, in {} namespace{}\n",
        args.count,
        args.namespaces,
        if args.namespaces == 1 { "" } else { "s" }
    );

    // Baseline and controller alternate (B C C B by default) so that drift in the
    // machine's load weighs on both alike; each run has its own PostgreSQL server and
    // namespaces.
    // A warm-up baseline first (reported, not counted): on this machine the first run on a
    // fresh control plane is much faster than every later run of either kind (45 s against
    // 63-67 s for the next baselines, or 32 s against 65 s), and B C C B puts that first
    // run on the baseline's side.
    let warmup = if args.warmup {
        Some(run_baseline(&client, &args, 0).await?.secs)
    } else {
        None
    };
    let last_controller = args.order.0.iter().rposition(|k| *k != Kind::Baseline);
    let (mut bs, mut cs, mut ds) = (Vec::new(), Vec::new(), Vec::new());
    for (i, kind) in args.order.0.iter().enumerate() {
        match kind {
            Kind::Baseline => {
                let round = bs.len() as u32 + 1;
                bs.push(run_baseline(&client, &args, round).await?);
            }
            Kind::Controller | Kind::Defaults => {
                let round = (cs.len() + ds.len()) as u32 + 1;
                let last = Some(i) == last_controller;
                let tuned = *kind == Kind::Controller;
                let run = run_controller(&cp, &client, &args, round, tmp.path(), last, tuned);
                let run = run.await?;
                if tuned {
                    cs.push(run);
                } else {
                    ds.push(run);
                }
            }
        }
    }
    let defaults_secs: Vec<f64> = ds.iter().map(|d| d.secs).collect();
    // The defaults' runs are reported beside the tuned ones; the rows below the first
    // table are of the tuned runs, or of the defaults' when there was no tuned run.
    let only_defaults = cs.is_empty();
    let (cs, ds) = if only_defaults {
        (ds, Vec::new())
    } else {
        (cs, ds)
    };

    let n = args.count as f64;
    let mean = |v: &[f64]| {
        if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    // "1.0 s, 2.0 s" for a list of per-run figures.
    let list = |v: Vec<String>| v.join(", ");
    let base_secs: Vec<f64> = bs.iter().map(|b| b.secs).collect();
    let ctl_secs: Vec<f64> = cs.iter().map(|c| c.secs).collect();
    let ratio = mean(&ctl_secs) / mean(&base_secs);
    let ratio = if ratio.is_finite() {
        format!("{ratio:.2}x")
    } else {
        "n/a".to_string()
    };
    let writes_per_db = |w: Vec<f64>| {
        let m = mean(&w) / n;
        if m.is_finite() {
            format!("{m:.2}")
        } else {
            String::new()
        }
    };
    let mib = |kib: u64| format!("{:.1} MiB", kib as f64 / 1024.0);
    let per_db = |above: u64, idle: u64| above.saturating_sub(idle) as f64 / n;
    println!("| | baseline (one process, direct) | database-controller | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| namespaces the {} Databases (and the baseline's Secrets) are spread over, round-robin | {} | {} ({}) | |",
        args.count,
        args.namespaces,
        args.namespaces,
        if args.namespaces == 1 {
            "--watch-namespace"
        } else {
            "all namespaces watched"
        }
    );
    println!(
        "| time until all {} exist / are Ready (runs {order}) | {} | {} | {ratio} |",
        args.count,
        list(base_secs.iter().map(|s| format!("{s:.1} s")).collect()),
        list(ctl_secs.iter().map(|s| format!("{s:.1} s")).collect()),
    );
    if !defaults_secs.is_empty() && !ds.is_empty() {
        let d = mean(&defaults_secs);
        println!(
            "| time until all {} are Ready with the shipped defaults (runs D: no --concurrency, --max-sessions-per-server, --api-rate-limit) | | {} | {:.2}x the baseline, {:.2}x the tuned runs |",
            args.count,
            list(defaults_secs.iter().map(|s| format!("{s:.1} s")).collect()),
            d / mean(&base_secs),
            d / mean(&ctl_secs),
        );
        println!(
            "| API requests per Database, by verb and resource (runs D) | | {} | |",
            list(ds.iter().map(|r| r.requests.clone()).collect())
        );
    }
    println!(
        "| API requests per Database, by verb and resource (each controller run above) | | {} | |",
        list(cs.iter().map(|r| r.requests.clone()).collect())
    );
    if let Some(w) = warmup {
        println!("| warm-up baseline run before them (not counted) | {w:.1} s | | |");
    }
    println!(
        "| API writes per Database (apiserver /metrics: databases, databaseservers, secrets, events; the N creates excluded) | {} | {} | |",
        writes_per_db(bs.iter().map(|b| b.writes).collect()),
        writes_per_db(cs.iter().map(|c| c.writes).collect()),
    );
    if let Some(last) = cs.last() {
        println!(
            "| the controller's writes by kind (audit log, run {}) | | {} | |",
            cs.len(),
            last.breakdown
        );
    }
    println!(
        "| API writes while idle over 2 of the bench's resyncs ({}; each controller run; a D run resyncs every 300 s) | | {} | |",
        args.resync,
        list(cs.iter().map(|c| format!("{:.0}", c.idle_writes)).collect())
    );
    println!(
        "| DDL statements while idle (each controller run) | | {} | |",
        list(cs.iter().map(|c| c.idle_ddl.to_string()).collect())
    );
    println!(
        "| controller CPU seconds to Ready (each run) | | {} | |",
        list(cs.iter().map(|c| format!("{:.1}", c.cpu)).collect())
    );
    println!(
        "| controller RSS idle: ready, before any Database (each run) | | {} | |",
        list(cs.iter().map(|c| mib(c.rss_idle)).collect())
    );
    println!(
        "| controller peak RSS (VmHWM; each run) | | {} | |",
        list(cs.iter().map(|c| mib(c.rss_peak)).collect())
    );
    println!(
        "| controller RSS settled: all Ready, 2 resyncs later (each run) | | {} | |",
        list(cs.iter().map(|c| mib(c.rss_settled)).collect())
    );
    println!(
        "| RSS per Database above idle, peak / settled (target ≤ 4 KiB at 10,000) | | {} | |",
        list(
            cs.iter()
                .map(|c| format!(
                    "{:.2} / {:.2} KiB",
                    per_db(c.rss_peak, c.rss_idle),
                    per_db(c.rss_settled, c.rss_idle)
                ))
                .collect()
        )
    );
    if let Some(r) = cs.last().and_then(|c| c.restart.as_ref()) {
        println!(
            "| restart over the {} converged Databases (run {}): time from start to /readyz 200 | | {:.1} s | |",
            args.count,
            cs.len(),
            r.ready_secs
        );
        println!(
            "| restart: time from start until {} reconciles counted (dbops_reconciles_total, success; {:.0} failed) | | {:.1} s | |",
            args.count, r.errors, r.reconciled_secs
        );
        println!(
            "| restart: API writes from start to 2 resyncs after all reconciled ({:.0} s; target 0) | | {:.0}{} | |",
            r.window_secs,
            r.writes,
            if r.breakdown.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.breakdown)
            }
        );
        println!(
            "| restart: DDL statements on the server in that window (target 0) | | {} | |",
            r.ddl
        );
        println!(
            "| restart: SQL round trips (statements logged for the controller's sessions) in that window | | {} ({:.2} per Database, over {:.0} reconciles; the controller's own count of PostgreSQL requests, connections included: {:.0}) | |",
            r.statements,
            r.statements as f64 / n,
            r.reconciles,
            r.pg_requests
        );
        println!(
            "| restart: RSS of the fresh controller at the end of the window | | {} ({:.2} KiB per Database above run {}'s idle) | |",
            mib(r.rss_settled),
            cs.last().map_or(0.0, |c| per_db(r.rss_settled, c.rss_idle)),
            cs.len()
        );
    }
    println!(
        "\nEach run in order: seconds until the first, 10 %, 50 %, 90 % and all were done (Secret created / Ready); where the machine's CPU went (seconds, from the first create to the last Ready); for the controller, where its reconciles' time went.\n"
    );
    let (mut b, mut c, mut d) = (bs.iter(), cs.iter(), ds.iter());
    for kind in &args.order.0 {
        match kind {
            Kind::Baseline => {
                if let Some(r) = b.next() {
                    println!("- B {}; CPU: {}{}", r.progress, r.cpu_spent, r.statements);
                }
            }
            Kind::Controller | Kind::Defaults => {
                let next = if *kind == Kind::Defaults && !only_defaults {
                    d.next()
                } else {
                    c.next()
                };
                if let Some(r) = next {
                    let what = if *kind == Kind::Defaults { 'D' } else { 'C' };
                    println!(
                        "- {what} {}; CPU: {}; {}{}",
                        r.progress, r.cpu_spent, r.phases, r.statements
                    );
                }
            }
        }
    }
    println!(
        "\nsettings: {} SQL sessions each, controller (C) --concurrency={} --api-rate-limit={} --resync-interval={}, (D) none of them; data on {}; {} cores",
        args.sessions,
        args.concurrency,
        args.api_rate_limit,
        args.resync,
        args.data_dir()
            .map_or_else(|| "disk (TMPDIR)".to_string(), |d| format!("tmpfs ({d})")),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    Ok(())
}

struct BaselineRun {
    secs: f64,
    /// With `--statements`, what the server spent its time on ([`top_statements`]).
    statements: String,
    progress: Progress,
    writes: f64,
    /// Where the machine's CPU went during the run ([`cpu_spent`]).
    cpu_spent: String,
}

async fn run_baseline(
    client: &kube::Client,
    args: &DatabasesArgs,
    round: u32,
) -> Result<BaselineRun> {
    let pg = start_server(&format!("baseline{round}"), args).await?;
    let namespaces =
        scale::tenant_namespaces(&format!("bench-baseline-{round}"), args.namespace_count());
    scale::create_namespaces(client, &namespaces).await?;
    let w0 = api_writes(client).await?;
    let cpu0 = cpu_by_program();
    let t0 = Instant::now();
    let done_at = baseline(client, &namespaces, &pg, args).await?;
    let secs = t0.elapsed().as_secs_f64();
    let run = BaselineRun {
        secs,
        statements: top_statements(&pg, args).await?,
        progress: Progress::of(t0, &done_at),
        writes: api_writes(client).await? - w0,
        cpu_spent: cpu_spent(&cpu0, &cpu_by_program(), secs),
    };
    // The next run starts from the same state: this one's Secrets gone.
    scale::delete_namespaces(client, &namespaces, ready_limit(args.count)).await?;
    Ok(run)
}

struct ControllerRun {
    secs: f64,
    /// With `--statements`, what the server spent its time on ([`top_statements`]).
    statements: String,
    progress: Progress,
    /// Where the controller's time went ([`phases`]).
    phases: String,
    /// Where the machine's CPU went until all were Ready ([`cpu_spent`]).
    cpu_spent: String,
    writes: f64,
    cpu: f64,
    /// RSS (KiB) once ready, before any Database; peak (VmHWM) over the run; and once all
    /// were Ready and two resyncs had passed.
    rss_idle: u64,
    rss_peak: u64,
    rss_settled: u64,
    breakdown: String,
    /// API requests per Database by verb and resource ([`requests_per_database`]).
    requests: String,
    idle_writes: f64,
    idle_ddl: usize,
    /// The restart measurement, after the last controller run only.
    restart: Option<scale::Restart>,
}

/// One controller run; the last one (`last`) ends with the restart measurement, any
/// other one, when it watched all namespaces, by deleting its tenant namespaces so that
/// the next run's controller does not find its Databases.
async fn run_controller(
    cp: &ControlPlane,
    client: &kube::Client,
    args: &DatabasesArgs,
    round: u32,
    dir: &std::path::Path,
    last: bool,
    tuned: bool,
) -> Result<ControllerRun> {
    let pg = start_server(&format!("controller{round}"), args).await?;
    let run = format!("bench-controller-{round}");
    let namespaces = scale::tenant_namespaces(&run, args.namespace_count());
    scale::create_namespaces(client, &namespaces).await?;
    let server = BenchServer::create(client, &run, &pg).await?;
    let kubeconfig = cp.kubeconfig_for("dbops-database-controller", &["system:masters"])?;
    let watch_all = namespaces.len() > 1;
    let mut extra = Vec::new();
    if !watch_all {
        extra.push(format!("--watch-namespace={run}"));
    }
    if tuned {
        extra.extend([
            format!("--concurrency={}", args.concurrency),
            format!("--max-sessions-per-server={}", args.sessions),
            format!("--api-rate-limit={}", args.api_rate_limit),
            format!("--resync-interval={}", args.resync),
        ]);
    }
    extra.push("--log-filter=warn".to_string());
    extra.extend(server.controller_args());
    let log_dir = dir.join(format!("controller-{round}"));
    let controller = crate::bed::start_database_controller(&kubeconfig, &log_dir, &extra)?;
    let pid = controller.process.pid();
    let (cpu0, _) = proc_usage(pid)?;
    // Idle: the watch stores synced, no Database yet.
    scale::wait_readyz(&controller, Duration::from_secs(120)).await?;
    let rss_idle = scale::status_kib(pid, "VmRSS:")?;

    let ours: HashSet<String> = namespaces.iter().cloned().collect();
    let apis: Vec<Api<Database>> = namespaces
        .iter()
        .map(|ns| Api::namespaced(client.clone(), ns))
        .collect();
    let w0 = api_writes(client).await?;
    let machine0 = cpu_by_program();
    let t0 = Instant::now();
    let all_ready = wait_ready(
        if watch_all {
            Api::all(client.clone())
        } else {
            Api::namespaced(client.clone(), &run)
        },
        Some(&ours),
        args.count,
        ready_limit(args.count),
    );
    let ready_at = create_databases(
        args.count,
        32,
        &server.name,
        |i| apis[i % apis.len()].clone(),
        |i| format!("db-{i:05}"),
        all_ready,
    )
    .await?;
    let secs = t0.elapsed().as_secs_f64();
    let progress = Progress::of(t0, &ready_at);
    let phases = phases(&controller).await?;
    let requests = requests_per_database(&controller, args.count).await?;
    let statements = top_statements(&pg, args).await?;
    let cpu_spent = cpu_spent(&machine0, &cpu_by_program(), secs);
    let writes = api_writes(client).await? - w0 - args.count as f64;
    let (cpu1, _) = proc_usage(pid)?;

    // This run's namespaces, and its DatabaseServer (cluster-scoped: no namespace).
    let breakdown = writes_by_kind(
        cp.audit_writes("dbops-database-controller", None)?
            .into_iter()
            .filter(|w| {
                ours.contains(&w.namespace) || (w.namespace.is_empty() && w.name == server.name)
            }),
    );

    // Idle over two resyncs (a span of time, not a state to wait for): every Database
    // reconciled again, the caches settled.
    let resync = parse_secs(&args.resync)?;
    let ddl0 = pg.ddl_statements()?.len();
    let w_idle0 = api_writes(client).await?;
    tokio::time::sleep(Duration::from_secs_f64(resync * 2.0 + 2.0)).await;
    let idle_writes = api_writes(client).await? - w_idle0;
    let idle_ddl = pg.ddl_statements()?.len() - ddl0;
    let rss_settled = scale::status_kib(pid, "VmRSS:")?;
    // The high-water mark of the whole run, idle included.
    let (_, rss_peak) = proc_usage(pid)?;

    let restart = if last {
        let launch = scale::Launch {
            cp,
            client,
            pg: &pg,
            kubeconfig: &kubeconfig,
            log_dir: &log_dir,
            args: &extra,
            count: args.count,
            resync_secs: resync,
        };
        Some(scale::restart(launch, controller).await?)
    } else {
        drop(controller);
        // Every run starts from the same state: this one's objects gone (with more than
        // one namespace the next controller, which watches all, would also serve them).
        scale::delete_namespaces(client, &namespaces, ready_limit(args.count)).await?;
        None
    };
    Ok(ControllerRun {
        secs,
        statements,
        progress,
        phases,
        cpu_spent,
        writes,
        cpu: cpu1 - cpu0,
        rss_idle,
        rss_peak,
        rss_settled,
        breakdown,
        requests,
        idle_writes,
        idle_ddl,
        restart,
    })
}

/// How long N Databases may take to become Ready (or their namespaces to go).
fn ready_limit(count: usize) -> Duration {
    Duration::from_secs(1800.max(count as u64 / 4))
}

/// What the controller does for a new Database, without the controller: the role (and
/// its mark) in one transaction, the database and its mark, then the Secret.
/// Secret `i` goes to namespace `i % namespaces.len()`, as Database `i` does in a
/// controller run.
async fn baseline(
    client: &kube::Client,
    namespaces: &[String],
    pg: &PgServer,
    args: &DatabasesArgs,
) -> Result<Vec<Instant>> {
    let secrets: Arc<Vec<Api<Secret>>> = Arc::new(
        namespaces
            .iter()
            .map(|ns| Api::namespaced(client.clone(), ns))
            .collect(),
    );
    let queue = Arc::new(Mutex::new(0..args.count));
    let mut workers = Vec::new();
    for _ in 0..args.sessions {
        let (queue, secrets) = (queue.clone(), secrets.clone());
        let conn = pg.connect_as_superuser().await?;
        let port = pg.port();
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let Some(i) = queue.lock().await.next() else { break };
                let name = format!("db_{i:05}");
                let password = random_password();
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
                secrets[i % secrets.len()]
                    .create(&PostParams::default(), &secret)
                    .await
                    .with_context(|| format!("creating Secret db-{i:05}-connection"))?;
                done.push(Instant::now());
            }
            anyhow::Ok(done)
        }));
    }
    let mut done_at = Vec::with_capacity(args.count);
    for w in workers {
        done_at.extend(w.await??);
    }
    done_at.sort();
    Ok(done_at)
}

fn parse_secs(s: &str) -> Result<f64> {
    s.strip_suffix('s')
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("--resync must be like 10s, not {s}"))
}

/// When the first, 10 %, 50 %, 90 % and last of a run's Databases were done, in seconds
/// from its start.
struct Progress(Vec<f64>);

impl Progress {
    fn of(start: Instant, done: &[Instant]) -> Self {
        let mut secs: Vec<f64> = done
            .iter()
            .map(|t| t.duration_since(start).as_secs_f64())
            .collect();
        secs.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((secs.len() as f64 * q).ceil() as usize).clamp(1, secs.len().max(1)) - 1;
            secs.get(i).copied().unwrap_or(f64::NAN)
        };
        Self(vec![at(0.0), at(0.1), at(0.5), at(0.9), at(1.0)])
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|s| format!("{s:.1}")).collect();
        write!(f, "done at {} s", parts.join(" / "))
    }
}

/// A run's PostgreSQL server; with `--statements`, with pg_stat_statements loaded (every
/// statement, utility ones included) and its view created.
async fn start_server(name: &str, args: &DatabasesArgs) -> Result<PgServer> {
    if !args.statements {
        return PgServer::start(name).await;
    }
    let pg = PgServer::start_with_settings(
        name,
        &[
            ("shared_preload_libraries", "pg_stat_statements"),
            ("pg_stat_statements.track", "all"),
            ("pg_stat_statements.track_utility", "on"),
            ("pg_stat_statements.max", "20000"),
        ],
    )
    .await?;
    pg.connect_as_superuser()
        .await?
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await?;
    Ok(pg)
}

/// With `--statements`: the eight statement kinds the server spent the most time on
/// (planning and execution, summed over every database), each with its calls; else "".
async fn top_statements(pg: &PgServer, args: &DatabasesArgs) -> Result<String> {
    if !args.statements {
        return Ok(String::new());
    }
    let rows = pg
        .connect_as_superuser()
        .await?
        .query(
            // Names and literals blanked: each CREATE DATABASE is a statement of its own in
            // PostgreSQL 15's view, one kind here.
            r#"SELECT left(regexp_replace(regexp_replace(regexp_replace(query, '\s+', ' ', 'g'),
                      '"[^"]*"', 'X', 'g'), '''[^'']*''', '?', 'g'), 60),
                    sum(calls)::bigint,
                    (sum(total_exec_time + total_plan_time) / 1000)::float8
               FROM pg_stat_statements GROUP BY 1 ORDER BY 3 DESC LIMIT 8"#,
            &[],
        )
        .await?;
    let total: f64 = rows.iter().map(|r| r.get::<_, f64>(2)).sum();
    let parts: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "`{}` {} calls {:.1} s",
                r.get::<_, String>(0),
                r.get::<_, i64>(1),
                r.get::<_, f64>(2)
            )
        })
        .collect();
    Ok(format!(
        "; server time by statement (top 8, {total:.1} s): {}",
        parts.join(", ")
    ))
}
