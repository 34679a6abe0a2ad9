//! `dbops-bench outage`: what an outage of a PostgreSQL server costs. N Databases are
//! made Ready on one server reached through a counting TCP proxy on loopback; the server
//! is stopped for `--outage`, then started again.
//!
//! Reported: connection attempts that reached the proxy during the outage (target:
//! bounded by the breaker's and the probe's schedule, not by the number of Databases),
//! status writes per Database during the outage after its first (target: 0: written once
//! per Database per outage), the DatabaseServer's status writes, and the time from the
//! server's return until every Database is Ready again (target: 30 s).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::Database;
use dbops_e2e::PgServer;
use kube::api::Api;
use tokio::net::{TcpListener, TcpStream};

use crate::bed::{BenchServer, DatabaseWatch, is_ready, namespace};

#[derive(clap::Args, Debug)]
pub struct OutageArgs {
    /// Databases on the server.
    #[arg(long, default_value_t = 200)]
    databases: usize,
    /// How long the server is down, seconds.
    #[arg(long, default_value_t = 600)]
    outage_secs: u64,
}

/// Accepts on 127.0.0.1 and forwards to `upstream`, counting every accepted connection.
async fn counting_proxy(upstream: u16) -> Result<(u16, Arc<AtomicU64>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let count = Arc::new(AtomicU64::new(0));
    let counted = count.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                // The server down: the client sees its connection closed at once.
                if let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok((port, count))
}

/// Waits (a watch, bounded) until all `count` Databases are Ready at once.
async fn wait_all_ready_again(api: Api<Database>, count: usize, limit: Duration) -> Result<()> {
    let mut ready: BTreeMap<String, bool> = BTreeMap::new();
    let mut watch = DatabaseWatch::new(api, limit);
    while let Some(db) = watch.next().await? {
        ready.insert(db.metadata.name.clone().unwrap_or_default(), is_ready(&db));
        if ready.len() == count && ready.values().all(|r| *r) {
            return Ok(());
        }
    }
    bail!(
        "only {} of {count} Ready after {limit:?}",
        ready.values().filter(|r| **r).count()
    )
}

pub async fn run(args: OutageArgs) -> Result<()> {
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-outage-").await?;
    let mut pg = PgServer::start("bench-outage").await?;
    let (proxy_port, attempts) = counting_proxy(pg.port()).await?;
    let ns = namespace(&client, "bench-outage").await?;
    let server = BenchServer::create_at(&client, &ns, &pg, "127.0.0.1", proxy_port).await?;
    let kubeconfig = cp.kubeconfig_for("dbops-database-controller", &["system:masters"])?;
    // The shipped defaults (resync 300 s, backoff 5 s..300 s, breaker 5 failures / 30 s).
    let mut extra = vec![
        format!("--watch-namespace={ns}"),
        "--log-filter=warn".to_string(),
    ];
    extra.extend(server.controller_args());
    let log_dir = tmp.path().join("controller");
    let controller = crate::bed::start_database_controller(&kubeconfig, &log_dir, &extra)?;
    println!(
        "# outage benchmark: {} Databases, PostgreSQL stopped for {} s\n",
        args.databases, args.outage_secs
    );

    crate::bed::create_all_ready(&client, &ns, &server.name, args.databases, |i| {
        format!("db-{i:04}")
    })
    .await?;

    // The outage.
    let user = "dbops-database-controller";
    let writes_before = cp.audit_writes(user, None)?.len();
    let attempts_before = attempts.load(Ordering::Relaxed);
    pg.stop()?;
    let down_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.outage_secs)).await;
    let during = attempts.load(Ordering::Relaxed) - attempts_before;
    let writes: Vec<_> = cp.audit_writes(user, None)?.split_off(writes_before);
    pg.start_again().await?;
    let back_at = Instant::now();
    let dbs: Api<Database> = Api::namespaced(client.clone(), &ns);
    wait_all_ready_again(dbs, args.databases, Duration::from_secs(600))
        .await
        .context("all Ready again after the outage")?;
    let recovery = back_at.elapsed();
    let outage = back_at - down_at;

    let mut per_db: BTreeMap<&str, usize> = BTreeMap::new();
    let mut server_status = 0;
    let mut other: BTreeMap<String, usize> = BTreeMap::new();
    for w in &writes {
        match (w.resource.as_str(), w.subresource.as_str()) {
            ("databases", "status") => *per_db.entry(w.name.as_str()).or_default() += 1,
            ("databaseservers", "status") => server_status += 1,
            _ => {
                *other
                    .entry(format!("{} {}", w.verb, w.resource))
                    .or_default() += 1
            }
        }
    }
    let written = per_db.len();
    let beyond_first: usize = per_db.values().map(|n| n.saturating_sub(1)).sum();
    let most = per_db.values().copied().max().unwrap_or(0);
    println!("| during the outage ({:.0} s) | |", outage.as_secs_f64());
    println!("|---|---|");
    println!("| connection attempts that reached the server's address | {during} |");
    println!(
        "| Databases whose status was written | {written} of {} |",
        args.databases
    );
    println!(
        "| status writes per Database after its first (sum over all; most for one) | {beyond_first}; {most} |"
    );
    println!("| DatabaseServer status writes | {server_status} |");
    println!("| other writes | {other:?} |");
    println!(
        "| time from the server's return to all {} Ready | {:.1} s |",
        args.databases,
        recovery.as_secs_f64()
    );
    drop(controller);
    Ok(())
}
