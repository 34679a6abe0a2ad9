//! `dbops-bench pooler-auth`: what it costs to authenticate a client through the pooler,
//! with dbops's design (PgBouncer reads a userlist of SCRAM verifiers and passes the
//! client's proof through: nothing runs on the server per client connection) against
//! PgBouncer's `auth_query` (it asks the server for the login's verifier on each new
//! client connection, as a role that reads `pg_shadow`, which no managed service grants).
//!
//! One PostgreSQL server, one tenant database and login, two PgBouncers (Debian's) on the
//! same routes and settings but for authentication, in transaction mode. Each round opens
//! `--connections` client connections, `--concurrency` at a time; each connects, runs
//! `SELECT 1` and disconnects. The rounds alternate (a warm-up of each, then A B B A ...),
//! and report connections per second, the connect latency (TCP, SCRAM, startup) and what
//! ran on the server for them (`pg_stat_statements`: the auth queries, and server logins
//! from `pg_stat_database.sessions`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_e2e::PgServer;
use dbops_e2e::pgbouncer::PgBouncer;
use dbops_shared::pooler::{Route, Userlist};
use dbops_shared::postgres::{generate_password, password_verifier};
use futures::{StreamExt, stream};

#[derive(clap::Args, Debug)]
pub struct PoolerAuthArgs {
    /// Client connections per round.
    #[arg(long, default_value_t = 2000)]
    connections: usize,
    /// Clients connecting at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Measured rounds of each side (after one warm-up round of each).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
}

const LOGIN: &str = "app_owner";
const DB: &str = "app";
const ADMIN: &str = "dbops_pooler_admin";
const AUTH_QUERY: &str = "SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename=$1";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Userlist,
    AuthQuery,
}

struct Round {
    side: Side,
    secs: f64,
    p50: Duration,
    p99: Duration,
    auth_queries: i64,
    server_logins: i64,
}

pub async fn run(args: PoolerAuthArgs) -> Result<()> {
    let mut settings: Vec<(&str, &str)> = dbops_e2e::postgres::PG_STAT_STATEMENTS.to_vec();
    settings.push(("max_connections", "300"));
    let pg = PgServer::start_with_settings("bench-pooler", &settings).await?;
    let password = dbops_e2e::pgbouncer::tenant(&pg, LOGIN, DB).await?;
    let su = pg.connect_as_superuser().await?;
    su.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await?;

    let tmp = tempfile::Builder::new()
        .prefix("dbops-bench-pooler-")
        .tempdir()?;
    let route = Route {
        name: DB.into(),
        host: pg.host().into(),
        port: pg.port(),
        dbname: DB.into(),
    };
    let admin = generate_password();
    let mut users = Userlist::default();
    users.insert(LOGIN, &password_verifier(LOGIN, &password))?;
    users.insert(ADMIN, &password_verifier(ADMIN, &admin))?;
    let settings_of = |dir: &std::path::Path| -> Result<_> {
        let mut s = PgBouncer::settings_in(dir, ADMIN)?;
        s.max_client_conn = 1000;
        s.default_pool_size = 8;
        Ok(s)
    };
    let userlist_dir = tmp.path().join("userlist");
    let userlist_side = PgBouncer::start(
        &userlist_dir,
        settings_of(&userlist_dir)?,
        std::slice::from_ref(&route),
        &users,
    )
    .await?;
    // auth_query: PgBouncer logs in as auth_user with a plain password from its own
    // auth_file (a verifier cannot log in), and asks for each client's verifier.
    let query_dir = tmp.path().join("auth-query");
    std::fs::create_dir_all(&query_dir)?;
    let auth_user_file = query_dir.join("auth_user.txt");
    std::fs::write(
        &auth_user_file,
        format!("\"postgres\" \"{}\"\n", pg.superuser_password()),
    )?;
    let extra = format!(
        "auth_user = postgres\nauth_query = {AUTH_QUERY}\nauth_file = {}\n",
        auth_user_file.display()
    );
    let query_side = PgBouncer::start_with(
        &query_dir,
        settings_of(&query_dir)?,
        std::slice::from_ref(&route),
        &Userlist::default(),
        &extra,
    )
    .await?;

    println!(
        "# pooler authentication: userlist of SCRAM verifiers (dbops) against auth_query\n\n\
         {} client connections per round, {} at a time, each connect + SELECT 1 + disconnect; \
         {} in transaction mode, default_pool_size 8, one server\n",
        args.connections,
        args.concurrency,
        pgbouncer_version()
    );
    let order: Vec<Side> = [Side::Userlist, Side::AuthQuery]
        .into_iter()
        .chain((0..args.rounds).flat_map(|i| {
            if i % 2 == 0 {
                [Side::Userlist, Side::AuthQuery]
            } else {
                [Side::AuthQuery, Side::Userlist]
            }
        }))
        .collect();
    let mut measured = Vec::new();
    for (i, side) in order.into_iter().enumerate() {
        let bouncer = match side {
            Side::Userlist => &userlist_side,
            Side::AuthQuery => &query_side,
        };
        let round = one_round(&pg, bouncer, side, &password, &args).await?;
        println!(
            "- round {i} {:?}{}: {:.0} connections/s, connect p50 {:.1} ms p99 {:.1} ms, \
             auth queries on the server {}, new server sessions {}",
            side,
            if i < 2 { " (warm-up)" } else { "" },
            args.connections as f64 / round.secs,
            ms(round.p50),
            ms(round.p99),
            round.auth_queries,
            round.server_logins
        );
        if i >= 2 {
            measured.push(round);
        }
    }
    report(&measured, args.connections);
    drop((userlist_side, query_side, tmp));
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(crate) fn pgbouncer_version() -> String {
    dbops_e2e::pgbouncer::binary()
        .ok()
        .and_then(|b| std::process::Command::new(b).arg("--version").output().ok())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_else(|| "(version unknown)".into())
}

/// The server's count of auth queries and of sessions of `LOGIN` in `DB` so far.
async fn server_counts(pg: &PgServer) -> Result<(i64, i64)> {
    let su = pg.connect_as_superuser().await?;
    let auth: i64 = su
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
              WHERE query LIKE '%pg_shadow%'",
            &[],
        )
        .await?
        .get(0);
    let sessions: i64 = su
        .query_one(
            "SELECT coalesce(sessions, 0)::bigint FROM pg_stat_database WHERE datname = $1",
            &[&DB],
        )
        .await?
        .get(0);
    Ok((auth, sessions))
}

async fn one_round(
    pg: &PgServer,
    bouncer: &PgBouncer,
    side: Side,
    password: &str,
    args: &PoolerAuthArgs,
) -> Result<Round> {
    let (auth0, sessions0) = server_counts(pg).await?;
    let t0 = Instant::now();
    let results: Vec<Result<Duration>> = stream::iter(0..args.connections)
        .map(|_| async move {
            let t = Instant::now();
            let client = bouncer.connect(LOGIN, password, DB).await?;
            let connected = t.elapsed();
            client.simple_query("SELECT 1").await?;
            Ok(connected)
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let secs = t0.elapsed().as_secs_f64();
    let mut latencies = Vec::with_capacity(results.len());
    for r in results {
        latencies.push(r.with_context(|| format!("a client of the {side:?} side"))?);
    }
    latencies.sort();
    if latencies.is_empty() {
        bail!("no connection made");
    }
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    // pg_stat_database counts a session when it ends and is flushed when its backend
    // goes idle; pooled server connections stay open, so `sessions` counts the ones the
    // pooler opened and closed (auth_query's own connection among them) over the round.
    let (auth1, sessions1) = server_counts(pg).await?;
    Ok(Round {
        side,
        secs,
        p50: at(0.5),
        p99: at(0.99),
        auth_queries: auth1 - auth0,
        server_logins: sessions1 - sessions0,
    })
}

fn report(rounds: &[Round], connections: usize) {
    let of = |side: Side| -> Vec<&Round> { rounds.iter().filter(|r| r.side == side).collect() };
    let (a, b) = (of(Side::Userlist), of(Side::AuthQuery));
    let rate = |rs: &[&Round]| {
        rs.iter().map(|r| connections as f64 / r.secs).sum::<f64>() / rs.len().max(1) as f64
    };
    let p50 = |rs: &[&Round]| rs.iter().map(|r| ms(r.p50)).sum::<f64>() / rs.len().max(1) as f64;
    let per = |rs: &[&Round]| {
        rs.iter().map(|r| r.auth_queries).sum::<i64>() as f64
            / (connections * rs.len().max(1)) as f64
    };
    println!(
        "\n| per client connection | userlist (dbops) | auth_query | ratio |\n|---|---|---|---|"
    );
    println!(
        "| connections per second (mean of rounds) | {:.0} | {:.0} | {:.2}x |",
        rate(&a),
        rate(&b),
        rate(&a) / rate(&b).max(f64::MIN_POSITIVE)
    );
    println!(
        "| connect latency p50 (mean of rounds) | {:.2} ms | {:.2} ms | |",
        p50(&a),
        p50(&b)
    );
    println!(
        "| queries on the server to authenticate | {:.2} | {:.2} | |",
        per(&a),
        per(&b)
    );
}
