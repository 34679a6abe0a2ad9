//! `dbops-bench pooler-load`: what the pooler does for a shared server (issue 36).
//!
//! 1. **Many tenants, few server connections.** One PostgreSQL server with
//!    `max_connections=100`, `--databases` tenant databases (each its own login, password
//!    set by dbops's statement), and PgBouncer (Debian's) on the routes and userlist dbops
//!    renders, in transaction mode with one server connection per database pool. First
//!    `--clients` connections straight to the server (how many it takes), then the same
//!    number through the pooler, `--clients / --databases` per database, all held open;
//!    then for `--seconds` every client runs `SELECT 1` after a random pause (mean
//!    `--think-ms`). Reported: clients admitted, queries served and failed, throughput,
//!    the latency of a query (its wait for a server connection included) and the most
//!    server sessions seen at once.
//! 2. **pgbench through the pooler against direct**, side by side in alternating rounds
//!    after a warm-up of each: select-only transactions on one tenant database, once on
//!    held sessions and once with a new connection per transaction (`-C`), with pgbench's
//!    own connection time.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_e2e::PgServer;
use dbops_e2e::pgbouncer::PgBouncer;
use dbops_shared::pooler::{Route, Userlist};
use dbops_shared::postgres::{generate_password, password_verifier};
use futures::{StreamExt, stream};
use tokio::sync::Mutex;

#[derive(clap::Args, Debug)]
pub struct PoolerLoadArgs {
    /// Tenant databases on the server, each with its own login.
    #[arg(long, default_value_t = 200)]
    databases: usize,
    /// Client connections in all, spread evenly over the databases.
    #[arg(long, default_value_t = 2000)]
    clients: usize,
    /// How long every client runs queries.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// The mean pause of a client between two queries (uniform in 0..2×mean).
    #[arg(long, default_value_t = 1000)]
    think_ms: u64,
    /// PgBouncer's `server_idle_timeout` in seconds: how soon an idle server connection
    /// of one database's pool is closed, so that another database may have it.
    #[arg(long, default_value_t = 600)]
    server_idle_timeout: u32,
    /// pgbench: seconds per round (0: no pgbench).
    #[arg(long, default_value_t = 10)]
    pgbench_seconds: u64,
    /// pgbench: clients.
    #[arg(long, default_value_t = 16)]
    pgbench_clients: u32,
}

const ADMIN: &str = "dbops_pooler_admin";

struct Tenant {
    login: String,
    db: String,
    password: String,
}

pub async fn run(args: PoolerLoadArgs) -> Result<()> {
    if args.databases == 0 || args.clients < args.databases {
        bail!("--clients must be at least --databases, and both above 0");
    }
    let mut settings: Vec<(&str, &str)> = vec![("max_connections", "100")];
    settings.push(("shared_buffers", "128MB"));
    let pg = PgServer::start_with_settings("bench-pooler-load", &settings).await?;
    let started = Instant::now();
    let tenants = make_tenants(&pg, args.databases).await?;
    println!(
        "# pooler load: {} databases, {} clients, one server with max_connections=100\n\n\
         {} tenant databases and logins made in {:.1}s; {}",
        args.databases,
        args.clients,
        tenants.len(),
        started.elapsed().as_secs_f64(),
        crate::pooler::pgbouncer_version()
    );
    let tmp = tempfile::Builder::new()
        .prefix("dbops-bench-pooler-load-")
        .tempdir()?;
    let bouncer = start_pooler(&pg, &tenants, tmp.path(), &args).await?;

    let direct = direct_admitted(&pg, &tenants, args.clients).await;
    println!(
        "\n## {} clients straight to the server\n\n{direct} admitted, {} refused (max_connections=100, 3 reserved for superusers)",
        args.clients,
        args.clients - direct
    );
    let load = pooled_load(&pg, &bouncer, &tenants, &args).await?;
    load.report(&args);

    drop(bouncer);
    if args.pgbench_seconds == 0 {
        return Ok(());
    }
    println!("\n## pgbench: through the pooler against direct\n");
    let dir = tmp.path().join("pgbench");
    let one = &tenants[0];
    let mut users = Userlist::default();
    users.insert(&one.login, &password_verifier(&one.login, &one.password))?;
    users.insert(ADMIN, &password_verifier(ADMIN, &generate_password()))?;
    let mut settings = PgBouncer::settings_in(&dir, ADMIN)?;
    settings.default_pool_size = args.pgbench_clients;
    let route = Route {
        name: one.db.clone(),
        host: pg.host().into(),
        port: pg.port(),
        dbname: one.db.clone(),
    };
    std::fs::create_dir_all(&dir)?;
    let bouncer = PgBouncer::start(&dir, settings, &[route], &users).await?;
    pgbench_rounds(&pg, &bouncer, one, &args).await?;
    drop((bouncer, tmp));
    Ok(())
}

/// `n` tenant logins and databases, four made at a time.
async fn make_tenants(pg: &PgServer, n: usize) -> Result<Vec<Tenant>> {
    let made: Vec<Result<Tenant>> = stream::iter(0..n)
        .map(|i| async move {
            let (login, db) = (format!("t{i:03}_owner"), format!("t{i:03}"));
            let password = dbops_e2e::pgbouncer::tenant(pg, &login, &db).await?;
            Ok(Tenant {
                login,
                db,
                password,
            })
        })
        .buffer_unordered(4)
        .collect()
        .await;
    made.into_iter().collect()
}

/// PgBouncer on dbops's rendering of the tenants' routes and logins.
async fn start_pooler(
    pg: &PgServer,
    tenants: &[Tenant],
    dir: &Path,
    args: &PoolerLoadArgs,
) -> Result<PgBouncer> {
    let routes: Vec<Route> = tenants
        .iter()
        .map(|t| Route {
            name: t.db.clone(),
            host: pg.host().into(),
            port: pg.port(),
            dbname: t.db.clone(),
        })
        .collect();
    let mut users = Userlist::default();
    for t in tenants {
        users.insert(&t.login, &password_verifier(&t.login, &t.password))?;
    }
    users.insert(ADMIN, &password_verifier(ADMIN, &generate_password()))?;
    let mut settings = PgBouncer::settings_in(dir, ADMIN)?;
    settings.max_client_conn = u32::try_from(args.clients + 100)?;
    settings.default_pool_size = 1;
    let extra = format!(
        "server_idle_timeout = {}\nserver_login_retry = 1\n",
        args.server_idle_timeout
    );
    PgBouncer::start_with(dir, settings, &routes, &users, &extra).await
}

/// How many of `clients` sessions straight to the server it admits (then all closed).
async fn direct_admitted(pg: &PgServer, tenants: &[Tenant], clients: usize) -> usize {
    let per = clients / tenants.len();
    let opened: Vec<Option<tokio_postgres::Client>> = stream::iter(0..clients)
        .map(|i| {
            let t = &tenants[(i / per).min(tenants.len() - 1)];
            async move { pg.connect(&t.login, &t.password, &t.db).await.ok() }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    opened.iter().flatten().count()
}

/// What the clients through the pooler saw.
struct Load {
    admitted: usize,
    connect_secs: f64,
    served: usize,
    failed: usize,
    first_error: Option<String>,
    latencies: Vec<Duration>,
    secs: f64,
    max_server_sessions: i64,
}

impl Load {
    fn report(&self, args: &PoolerLoadArgs) {
        let mut l = self.latencies.clone();
        l.sort();
        let at = |q: f64| {
            l.get(((l.len().max(1) - 1) as f64 * q) as usize)
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
        };
        println!(
            "\n## {} clients through the pooler ({} per database, transaction mode, one server connection per database pool, server_idle_timeout {} s)\n",
            args.clients,
            args.clients / args.databases,
            args.server_idle_timeout
        );
        println!("| | through the pooler |\n|---|---|");
        println!(
            "| clients admitted | {} of {} (in {:.1} s) |",
            self.admitted, args.clients, self.connect_secs
        );
        println!(
            "| queries served / failed in {:.0} s | {} / {} |",
            self.secs, self.served, self.failed
        );
        println!(
            "| throughput | {:.0} queries/s |",
            self.served as f64 / self.secs.max(f64::MIN_POSITIVE)
        );
        println!(
            "| query latency p50 / p99 / max (the wait for a server connection included) | {:.1} / {:.1} / {:.1} ms |",
            at(0.5),
            at(0.99),
            at(1.0)
        );
        println!(
            "| most server sessions at once (of 100) | {} |",
            self.max_server_sessions
        );
        if let Some(e) = &self.first_error {
            println!("\nfirst failure: {e}");
        }
    }
}

/// The clients through the pooler: all connected, then queries for `--seconds`.
async fn pooled_load(
    pg: &PgServer,
    bouncer: &PgBouncer,
    tenants: &[Tenant],
    args: &PoolerLoadArgs,
) -> Result<Load> {
    let per = args.clients / tenants.len();
    let t0 = Instant::now();
    let clients: Vec<Result<(usize, tokio_postgres::Client)>> = stream::iter(0..args.clients)
        .map(|i| {
            let k = (i / per).min(tenants.len() - 1);
            let t = &tenants[k];
            async move { Ok((k, bouncer.connect(&t.login, &t.password, &t.db).await?)) }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let connect_secs = t0.elapsed().as_secs_f64();
    let clients: Vec<(usize, tokio_postgres::Client)> = clients.into_iter().flatten().collect();
    let admitted = clients.len();

    let served = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let first_error = Arc::new(Mutex::new(None::<String>));
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let sampler = {
        let su = pg.connect_as_superuser().await?;
        tokio::spawn(async move {
            let mut most = 0i64;
            while Instant::now() < until {
                if let Ok(row) = su
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                        &[],
                    )
                    .await
                {
                    most = most.max(row.get::<_, i64>(0));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            most
        })
    };
    let t1 = Instant::now();
    let think = args.think_ms;
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, (_, client))| {
            let (served, failed) = (served.clone(), failed.clone());
            let (first_error, latencies) = (first_error.clone(), latencies.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                let mut seed = (i as u64).wrapping_mul(6364136223846793005).wrapping_add(1);
                while Instant::now() < until {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let pause = (seed >> 33) % (2 * think + 1);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    let t = Instant::now();
                    match client.simple_query("SELECT 1").await {
                        Ok(_) => {
                            served.fetch_add(1, Ordering::Relaxed);
                            mine.push(t.elapsed());
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            let text = e
                                .as_db_error()
                                .map_or_else(|| e.to_string(), |d| d.message().to_string());
                            first_error.lock().await.get_or_insert(text);
                            break;
                        }
                    }
                }
                latencies.lock().await.extend(mine);
            })
        })
        .collect();
    for t in tasks {
        t.await.context("a client task")?;
    }
    let secs = t1.elapsed().as_secs_f64();
    let max_server_sessions = sampler.await.unwrap_or_default();
    let latencies = std::mem::take(&mut *latencies.lock().await);
    let first_error = first_error.lock().await.clone();
    Ok(Load {
        admitted,
        connect_secs,
        served: served.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        first_error,
        latencies,
        secs,
        max_server_sessions,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path2 {
    Direct,
    Pooled,
}

/// What one pgbench round printed.
#[derive(Debug, Default, Clone, Copy)]
struct Bench {
    tps: f64,
    connection_ms: f64,
}

/// pgbench -S against the server and through the pooler, alternating, after a warm-up.
async fn pgbench_rounds(
    pg: &PgServer,
    bouncer: &PgBouncer,
    t: &Tenant,
    args: &PoolerLoadArgs,
) -> Result<()> {
    let bin = dbops_e2e::paths::postgres_bin_dir()?.join("pgbench");
    let env = |port: u16| -> BTreeMap<&str, String> {
        [
            ("PGHOST", pg.host().to_string()),
            ("PGPORT", port.to_string()),
            ("PGUSER", t.login.clone()),
            ("PGPASSWORD", t.password.clone()),
            ("PGDATABASE", t.db.clone()),
            ("PGSSLMODE", "disable".to_string()),
        ]
        .into()
    };
    let init = std::process::Command::new(&bin)
        .args(["-i", "-q", "-s", "10"])
        .envs(env(pg.port()))
        .output()?;
    if !init.status.success() {
        bail!("pgbench -i: {}", String::from_utf8_lossy(&init.stderr));
    }
    println!(
        "pgbench -S (select only), {} clients, 2 threads, {} s a round, scale 10, one tenant's login; \
         the pooler in transaction mode with a pool of as many server connections as clients\n",
        args.pgbench_clients, args.pgbench_seconds
    );
    let mut results: BTreeMap<(bool, &str), Vec<Bench>> = BTreeMap::new();
    for new_connections in [false, true] {
        let order = [
            Path2::Direct,
            Path2::Pooled,
            Path2::Pooled,
            Path2::Direct,
            Path2::Direct,
            Path2::Pooled,
        ];
        for (i, path) in order.into_iter().enumerate() {
            let port = match path {
                Path2::Direct => pg.port(),
                Path2::Pooled => bouncer.port(),
            };
            let mut cmd = std::process::Command::new(&bin);
            cmd.args([
                "-S",
                "-n",
                "-j",
                "2",
                "-c",
                &args.pgbench_clients.to_string(),
                "-T",
                &args.pgbench_seconds.to_string(),
            ])
            .envs(env(port));
            if new_connections {
                cmd.arg("-C");
            }
            let out = cmd.output()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if !out.status.success() {
                bail!(
                    "pgbench {path:?}: {}{text}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let b = parse_pgbench(&text);
            let warm = i < 2;
            println!(
                "- {} {:?}{}: {:.0} tps, connection time {:.2} ms",
                if new_connections { "-C" } else { "held" },
                path,
                if warm { " (warm-up)" } else { "" },
                b.tps,
                b.connection_ms
            );
            if !warm {
                let key = (
                    new_connections,
                    if path == Path2::Direct {
                        "direct"
                    } else {
                        "pooled"
                    },
                );
                results.entry(key).or_default().push(b);
            }
        }
    }
    let mean =
        |v: &[Bench], f: fn(&Bench) -> f64| v.iter().map(f).sum::<f64>() / v.len().max(1) as f64;
    println!("\n| pgbench -S | direct | through the pooler | pooled / direct |\n|---|---|---|---|");
    for new_connections in [false, true] {
        let d = results
            .get(&(new_connections, "direct"))
            .cloned()
            .unwrap_or_default();
        let p = results
            .get(&(new_connections, "pooled"))
            .cloned()
            .unwrap_or_default();
        let label = if new_connections {
            "a new connection per transaction (-C)"
        } else {
            "held sessions"
        };
        let (dt, pt) = (mean(&d, |b| b.tps), mean(&p, |b| b.tps));
        println!(
            "| tps, {label} | {dt:.0} | {pt:.0} | {:.2}x |",
            pt / dt.max(f64::MIN_POSITIVE)
        );
        let (dc, pc) = (mean(&d, |b| b.connection_ms), mean(&p, |b| b.connection_ms));
        println!(
            "| connection time, {label} | {dc:.2} ms | {pc:.2} ms | {:.2}x |",
            pc / dc.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}

/// tps (without the initial connection time) and the connection time pgbench printed.
fn parse_pgbench(text: &str) -> Bench {
    let number_after = |line: &str, key: &str| -> Option<f64> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.split_whitespace().next()?.parse().ok()
    };
    let mut b = Bench::default();
    for line in text.lines() {
        if line.starts_with("tps = ") {
            b.tps = number_after(line, "tps = ").unwrap_or_default();
        } else if line.contains("connection time = ") {
            b.connection_ms = number_after(line, "connection time = ").unwrap_or_default();
        }
    }
    b
}
