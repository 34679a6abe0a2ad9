//! `dbops-bench clone`: preview branches (`spec.cloneFrom`) against a copy by hand.
//!
//! 1. A pgbench database of about `--scale` × 15 MB copied B C C B per round, on one
//!    PostgreSQL server in one run: by hand `pg_dump -Fc | pg_restore --single-transaction
//!    --no-owner --no-privileges` into a database created just before (as the issue
//!    names it), and through the database-controller (a Database with
//!    `cloneFrom.databaseRef` created → Ready: provisioning, the snapshot, pg_dump → the
//!    mask filter → psql as the owner). Each copy is dropped after it is measured.
//! 2. `--previews` clones of a database of about `--preview-scale` × 15 MB created at
//!    once: the time until all are Ready, the most copies seen loading at once (the
//!    server's `limits.concurrentClones`, 2 unless `--concurrent-clones`), and the same
//!    number of copies by hand, the same number at a time.
//!
//! A warm-up copy of a small database comes first (not counted).

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dbops_api::Database;
use dbops_e2e::{ControllerProcess, PgServer};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

use crate::backup::{LONG, World, controller_args, create_database, database_size, mb, median};
use crate::bed::{BenchServer, namespace};
use crate::measure::proc_usage;

#[derive(clap::Args, Debug)]
pub struct CloneArgs {
    /// pgbench scale of the big database (1 ≈ 15 MB; 70 ≈ 1 GB).
    #[arg(long, default_value_t = 70)]
    scale: u32,
    /// Rounds of B C C B (by hand, controller, controller, by hand).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// How many previews are cloned at once.
    #[arg(long, default_value_t = 20)]
    previews: u32,
    /// pgbench scale of the previews' source (7 ≈ 100 MB).
    #[arg(long, default_value_t = 7)]
    preview_scale: u32,
    /// The server's `limits.concurrentClones` (absent: the default, 2).
    #[arg(long)]
    concurrent_clones: Option<u32>,
    /// Mask pgbench_accounts in the big database's clones: `aid` hashed (the keyed
    /// permutation of integers), `filler` hashed (hex, cut to char(84)), `abalance`
    /// fixed.
    #[arg(long)]
    mask: bool,
}

/// The big clones' `cloneFrom.mask` with `--mask`.
fn mask(on: bool) -> serde_json::Value {
    if !on {
        return serde_json::json!([]);
    }
    serde_json::json!([
        {"table": "public.pgbench_accounts", "column": "aid", "with": "hash"},
        {"table": "public.pgbench_accounts", "column": "filler", "with": "hash"},
        {"table": "public.pgbench_accounts", "column": "abalance", "with": "fixed", "value": "0"},
    ])
}

pub async fn run(args: CloneArgs) -> Result<()> {
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-clone-").await?;
    let pg = PgServer::start("bench-clone").await?;
    let ns = namespace(&client, "bench-clone").await?;
    let server = BenchServer::create(&client, &ns, &pg).await?;
    if let Some(n) = args.concurrent_clones {
        let limits = serde_json::json!({"spec": {"limits": {"concurrentClones": n}}});
        Api::<dbops_api::DatabaseServer>::all(client.clone())
            .patch(
                &server.name,
                &PatchParams::default(),
                &Patch::Merge(&limits),
            )
            .await?;
    }
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store)?;
    let bin = dbops_e2e::paths::postgres_bin_dir()?;
    let logs = tmp.path().join("logs");
    std::fs::create_dir_all(&logs)?;
    let kubeconfig = cp.kubeconfig_for("dbops-bench-controllers", &["system:masters"])?;
    let dbc = ControllerProcess::start(
        "database-controller",
        &kubeconfig,
        &logs,
        &controller_args(
            &ns,
            &store,
            &server,
            &[
                format!("--pg-restore={}", bin.join("pg_restore").display()),
                format!("--pg-dump={}", bin.join("pg_dump").display()),
            ],
        ),
    )?;
    let w = World {
        client,
        ns,
        server: server.name.clone(),
        pg,
        bin,
        dir: tmp.path().to_path_buf(),
    };

    // Warm-up: one small copy each way.
    create_database(&w, "small", None).await?;
    crate::backup::pgbench(&w, "small", 1).await?;
    by_hand(&w, "small", "warm_hand").await?;
    through_controller(&w, "small", "warm-clone", &mask(false)).await?;

    create_database(&w, "big", None).await?;
    crate::backup::pgbench(&w, "big", args.scale).await?;
    let size = database_size(&w, "big").await?;
    println!(
        "# clone benchmark: pgbench scale {} ({:.0} MB), mask {}\n",
        args.scale,
        mb(size),
        mask(args.mask)
    );
    let (mut hand, mut ctl) = (vec![], vec![]);
    let mut n = 0;
    for _ in 0..args.rounds {
        for manual in [true, false, false, true] {
            n += 1;
            if manual {
                hand.push(by_hand(&w, "big", &format!("hand_{n}")).await?);
            } else {
                let copy = format!("copy-{n}");
                ctl.push(through_controller(&w, "big", &copy, &mask(args.mask)).await?);
            }
        }
    }
    let (_, rss) = proc_usage(dbc.process.pid())?;
    let (hm, cm) = (median(&hand), median(&ctl));
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "| {} rounds of B C C B | by hand (pg_dump -Fc \\| pg_restore) | cloneFrom.databaseRef | throughput ratio, medians (target ≥ 0.9) |",
        args.rounds
    );
    println!("|---|---|---|---|");
    println!(
        "| {:.0} MB | {} s ({:.0} MB/s) | {} s ({:.0} MB/s) | {:.2} |",
        mb(size),
        list(&hand),
        mb(size) / hm,
        list(&ctl),
        mb(size) / cm,
        hm / cm
    );
    println!(
        "| database-controller peak RSS | | {:.1} MiB | |",
        rss as f64 / 1024.0
    );

    previews(&w, &args).await?;
    drop(dbc);
    Ok(())
}

/// Part 2: the previews at once, then as many by hand at the same concurrency.
async fn previews(w: &World, args: &CloneArgs) -> Result<()> {
    create_database(w, "mid", None).await?;
    crate::backup::pgbench(w, "mid", args.preview_scale).await?;
    let size = database_size(w, "mid").await?;
    let names: Vec<String> = (1..=args.previews).map(|i| format!("pr-{i}")).collect();
    let (most, sampler) = sample_loading(w).await?;
    let t = Instant::now();
    for name in &names {
        create(w, name, "mid", &mask(false)).await?;
    }
    let api: Api<Database> = Api::namespaced(w.client.clone(), &w.ns);
    for name in &names {
        crate::bed::wait_provisioned(&api, name, LONG).await?;
    }
    let all = t.elapsed().as_secs_f64();
    sampler.store(true, Ordering::Relaxed);
    let most = most.await?;
    let at_once = args.concurrent_clones.unwrap_or(2) as usize;
    let t = Instant::now();
    for chunk in names.chunks(at_once) {
        let hand_names: Vec<String> = chunk
            .iter()
            .map(|n| format!("hand_{}", n.replace('-', "_")))
            .collect();
        let copies = hand_names.iter().map(|n| by_hand(w, "mid", n));
        for r in futures::future::join_all(copies).await {
            r?;
        }
    }
    let hand = t.elapsed().as_secs_f64();
    println!(
        "\n| {} previews of {:.0} MB created at once | all Ready | most loading at once | by hand, {at_once} at a time | ratio |",
        args.previews,
        mb(size)
    );
    println!("|---|---|---|---|---|");
    println!(
        "| | {all:.1} s | {most} | {hand:.1} s | {:.2} |",
        hand / all
    );
    Ok(())
}

/// Samples every 100 ms how many databases psql is loading a clone into, until told.
async fn sample_loading(w: &World) -> Result<(tokio::task::JoinHandle<i64>, Arc<AtomicBool>)> {
    let c = w.pg.connect_as_superuser().await?;
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    let task = tokio::spawn(async move {
        let mut most = 0;
        while !stop.load(Ordering::Relaxed) {
            let n: i64 = c
                .query_one(
                    "SELECT count(DISTINCT datname) FROM pg_stat_activity \
                      WHERE application_name = 'dbops-database-controller-clone' AND datname LIKE 'pr_%'",
                    &[],
                )
                .await
                .map(|r| r.get(0))
                .unwrap_or(0);
            most = most.max(n);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        most
    });
    Ok((task, done))
}

async fn create(w: &World, name: &str, source: &str, mask: &serde_json::Value) -> Result<()> {
    let db: Database = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
        "metadata": {"name": name},
        "spec": {"serverRef": {"name": w.server}, "deletionPolicy": "Delete",
                 "cloneFrom": {"databaseRef": {"name": source}, "mask": mask}},
    }))?;
    Api::<Database>::namespaced(w.client.clone(), &w.ns)
        .create(&PostParams::default(), &db)
        .await?;
    Ok(())
}

/// A clone of `source` created → Ready, then deleted; seconds.
async fn through_controller(
    w: &World,
    source: &str,
    name: &str,
    mask: &serde_json::Value,
) -> Result<f64> {
    let api: Api<Database> = Api::namespaced(w.client.clone(), &w.ns);
    let t = Instant::now();
    create(w, name, source, mask).await?;
    crate::bed::wait_provisioned(&api, name, LONG).await?;
    let secs = t.elapsed().as_secs_f64();
    eprintln!("clone {name}: {secs:.1} s");
    api.delete(name, &DeleteParams::default()).await?;
    Ok(secs)
}

/// CREATE DATABASE, then `pg_dump -Fc source | pg_restore` into it; seconds. Dropped after.
async fn by_hand(w: &World, source: &str, name: &str) -> Result<f64> {
    let c = w.pg.connect_as_superuser().await?;
    let t = Instant::now();
    c.batch_execute(&format!("CREATE DATABASE {name}")).await?;
    let script = format!(
        "set -o pipefail; '{dump}' -Fc --no-password --dbname={source} | '{restore}' --single-transaction --exit-on-error --no-owner --no-privileges --no-password --dbname={name}",
        dump = w.bin.join("pg_dump").display(),
        restore = w.bin.join("pg_restore").display(),
    );
    let mut cmd = Command::new("bash");
    cmd.arg("-c").arg(script);
    cmd.env("PGHOST", w.pg.host())
        .env("PGPORT", w.pg.port().to_string())
        .env("PGUSER", "postgres")
        .env("PGPASSWORD", w.pg.superuser_password());
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!(
            "by hand copy failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("by hand {name}: {secs:.1} s");
    c.batch_execute(&format!("DROP DATABASE {name}")).await?;
    Ok(secs)
}
