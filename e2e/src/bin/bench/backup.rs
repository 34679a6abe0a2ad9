//! `dbops-bench backup`: a pgbench database of about `--scale` × 15 MB dumped and
//! restored through the controllers (a Backup, then a Database with `spec.restoreFrom`)
//! and by hand (`pg_dump -Fc -f file`, then `pg_restore` with the flags the controller
//! uses), alternating B C C B on one PostgreSQL server in one run.
//!
//! Reports: seconds and throughput (database size / time) of each run, the ratio
//! controller : by hand, and the controllers' peak RSS after a small warm-up (scale 1)
//! and after the big runs, to show whether memory grows with the dump's size.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::{Backup, BackupPhase, Database};
use dbops_e2e::fixtures::Connection;
use dbops_e2e::{ControllerProcess, PgServer};
use kube::api::{Api, PostParams};

use crate::bed::{BenchServer, namespace};
use crate::measure::proc_usage;

#[derive(clap::Args, Debug)]
pub struct BackupArgs {
    /// pgbench scale of the big database (1 ≈ 15 MB; 70 ≈ 1 GB).
    #[arg(long, default_value_t = 70)]
    scale: u32,
    /// Rounds of B C C B (by hand, controllers, controllers, by hand) per operation.
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// pg_restore's jobs, by hand (`-j`, from the file) and through the
    /// database-controller (`--restore-jobs`, from a scratch copy); 1: one transaction.
    #[arg(long, default_value_t = 1)]
    restore_jobs: u16,
    /// Also verify the controllers' Backups (`spec.verify`, on a second DatabaseServer of
    /// the same PostgreSQL), one per round after the restores, against the by-hand restore.
    #[arg(long)]
    verify: bool,
    /// The backup-controller's `--dump-inventory`: every dump counts its rows, objects and
    /// extensions (implied by `--verify`, which verifies Backups made without `verify`).
    #[arg(long)]
    inventory: bool,
}

/// How long one dump or restore may take on a busy 2-core machine.
pub(crate) const LONG: Duration = Duration::from_secs(1800);

pub(crate) struct World {
    pub(crate) client: kube::Client,
    pub(crate) ns: String,
    pub(crate) server: String,
    pub(crate) pg: PgServer,
    pub(crate) bin: std::path::PathBuf,
    pub(crate) dir: std::path::PathBuf,
}

pub async fn run(args: BackupArgs) -> Result<()> {
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-backup-").await?;
    let pg = PgServer::start("bench-backup").await?;
    let ns = namespace(&client, "bench-backup").await?;
    let server = BenchServer::create(&client, &ns, &pg).await?;
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store)?;
    let bin = dbops_e2e::paths::postgres_bin_dir()?;
    let common = |extra: &[String]| controller_args(&ns, &store, &server, extra);
    let logs = tmp.path().join("logs");
    std::fs::create_dir_all(&logs)?;
    let kubeconfig = cp.kubeconfig_for("dbops-bench-controllers", &["system:masters"])?;
    let scratch = tmp.path().join("scratch");
    std::fs::create_dir_all(&scratch)?;
    let dbc = ControllerProcess::start(
        "database-controller",
        &kubeconfig,
        &logs,
        &common(&[
            format!("--pg-restore={}", bin.join("pg_restore").display()),
            format!("--restore-jobs={}", args.restore_jobs),
            format!("--restore-scratch-dir={}", scratch.display()),
        ]),
    )?;
    let verify_server = server.create_verify_server(&client, &pg).await?;
    let bkc = ControllerProcess::start(
        "backup-controller",
        &kubeconfig,
        &logs,
        &common(&[
            format!("--pg-dump={}", bin.join("pg_dump").display()),
            format!("--pg-restore={}", bin.join("pg_restore").display()),
            format!("--verify-server={verify_server}"),
            format!("--dump-inventory={}", args.inventory || args.verify),
        ]),
    )?;
    let w = World {
        client,
        ns,
        server: server.name.clone(),
        pg,
        bin,
        dir: tmp.path().to_path_buf(),
    };

    // Warm-up at scale 1: the controllers' memory after a small dump and restore.
    create_database(&w, "small", None).await?;
    pgbench(&w, "small", 1).await?;
    controller_dump(&w, "small", "small-1").await?;
    controller_restore(&w, "small-copy", "small-1").await?;
    let (_, dump_rss_small) = proc_usage(bkc.process.pid())?;
    let (_, restore_rss_small) = proc_usage(dbc.process.pid())?;
    let small_size = database_size(&w, "small").await?;

    println!(
        "# backup benchmark: pgbench scale {}, restore jobs {}, dump inventory {}\n",
        args.scale,
        args.restore_jobs,
        args.inventory || args.verify
    );
    create_database(&w, "big", None).await?;
    let t = Instant::now();
    pgbench(&w, "big", args.scale).await?;
    let size = database_size(&w, "big").await?;
    eprintln!(
        "pgbench -i -s {}: {:.0} MB in {:.0} s",
        args.scale,
        mb(size),
        t.elapsed().as_secs_f64()
    );

    // Dumps, then restores (each from the first dump), B C C B per round.
    let (mut bd, mut cd, mut br, mut cr) = (vec![], vec![], vec![], vec![]);
    let mut first: Option<std::path::PathBuf> = None;
    let mut first_backup: Option<String> = None;
    let mut n = 0;
    for _ in 0..args.rounds {
        for by_hand in [true, false, false, true] {
            n += 1;
            if by_hand {
                let (secs, file) = manual_dump(&w, "big", n).await?;
                bd.push(secs);
                first.get_or_insert(file);
            } else {
                let name = format!("big-{n}");
                cd.push(controller_dump(&w, "big", &name).await?);
                first_backup.get_or_insert(name);
            }
        }
    }
    let (Some(f1), Some(first_backup)) = (first, first_backup) else {
        bail!("no dump was made");
    };
    let artifact = std::fs::metadata(&f1)?.len();
    let mut m = 0;
    for _ in 0..args.rounds {
        for by_hand in [true, false, false, true] {
            m += 1;
            if by_hand {
                br.push(manual_restore(&w, &f1, m, args.restore_jobs).await?);
            } else {
                cr.push(controller_restore(&w, &format!("big-copy-{m}"), &first_backup).await?);
            }
        }
    }
    // Verifications: one controller Backup per round (restore on the verify server and
    // the inventory compared), against the by-hand restores measured above.
    let mut cv = vec![];
    if args.verify {
        for round in 0..args.rounds {
            let name = format!("big-{}", 2 + 4 * round);
            cv.push(controller_verify(&w, &name).await?);
        }
    }
    let (_, dump_rss) = proc_usage(bkc.process.pid())?;
    let (_, restore_rss) = proc_usage(dbc.process.pid())?;

    let tp = |secs: f64| mb(size) / secs;
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (bdm, cdm, brm, crm) = (median(&bd), median(&cd), median(&br), median(&cr));
    println!(
        "database: {:.0} MB (pg_database_size), artifact {:.0} MB\n",
        mb(size),
        mb(artifact)
    );
    println!(
        "| {} rounds of B C C B; seconds, median throughput | by hand | through the controllers | throughput ratio, medians (target ≥ 0.9) |",
        args.rounds
    );
    println!("|---|---|---|---|");
    println!(
        "| dump | {} s ({:.0} MB/s) | {} s ({:.0} MB/s) | {:.2} |",
        list(&bd),
        tp(bdm),
        list(&cd),
        tp(cdm),
        bdm / cdm
    );
    println!(
        "| restore | {} s ({:.0} MB/s) | {} s ({:.0} MB/s) | {:.2} |",
        list(&br),
        tp(brm),
        list(&cr),
        tp(crm),
        brm / crm
    );
    if !cv.is_empty() {
        let cvm = median(&cv);
        println!(
            "| verify (restore on the verification server, counts compared) | {} s ({:.0} MB/s) | {} s ({:.0} MB/s) | {:.2} |",
            list(&br),
            tp(brm),
            list(&cv),
            tp(cvm),
            brm / cvm
        );
    }
    println!(
        "| backup-controller peak RSS: after a {:.0} MB dump, after the {:.0} MB dumps | | {:.1} MiB, {:.1} MiB | |",
        mb(small_size),
        mb(size),
        dump_rss_small as f64 / 1024.0,
        dump_rss as f64 / 1024.0
    );
    println!(
        "| database-controller peak RSS: after a {:.0} MB restore, after the {:.0} MB restores | | {:.1} MiB, {:.1} MiB | |",
        mb(small_size),
        mb(size),
        restore_rss_small as f64 / 1024.0,
        restore_rss as f64 / 1024.0
    );
    println!(
        "\nby hand: `pg_dump -Fc -f file` and `pg_restore --single-transaction --exit-on-error --no-owner --no-privileges -d new` into a database created just before; \
         controllers: Backup created → Completed (file:// store, SHA-256, manifest), Database with restoreFrom created → Ready (provisioning, checksum pass, pg_restore); {} cores",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    drop((dbc, bkc));
    Ok(())
}

/// The flags of a bench's database- and backup-controller: the tenant namespace, the
/// `file://` store, warnings only, the run's server, then `extra`.
pub(crate) fn controller_args(
    ns: &str,
    store: &Path,
    server: &BenchServer,
    extra: &[String],
) -> Vec<String> {
    let mut v = vec![
        format!("--watch-namespace={ns}"),
        format!("--backup-store=file://{}", store.display()),
        "--log-filter=warn".to_string(),
    ];
    v.extend(server.controller_args());
    v.extend_from_slice(extra);
    v
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

pub(crate) async fn create_database(
    w: &World,
    name: &str,
    restore_from: Option<&str>,
) -> Result<()> {
    let mut spec = serde_json::json!({
        "serverRef": {"name": w.server},
        "deletionPolicy": "Delete",
    });
    if let Some(backup) = restore_from {
        spec["restoreFrom"] = serde_json::json!({"backupRef": {"name": backup}});
    }
    let db: Database = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
        "metadata": {"name": name}, "spec": spec,
    }))?;
    let api: Api<Database> = Api::namespaced(w.client.clone(), &w.ns);
    api.create(&PostParams::default(), &db).await?;
    crate::bed::wait_provisioned(&api, name, LONG).await
}

/// `pgbench -i -s scale` as the Database's own role.
pub(crate) async fn pgbench(w: &World, db: &str, scale: u32) -> Result<()> {
    let c = Connection::of_database(&w.client, &w.ns, db).await?;
    let sslmode = c.sslmode.clone().context("connection Secret key")?;
    c.pgbench_init(&w.bin, scale, Some(&sslmode))
}

pub(crate) async fn database_size(w: &World, db: &str) -> Result<u64> {
    let c = w.pg.connect_as_superuser().await?;
    let n: i64 = c
        .query_one("SELECT pg_database_size($1)", &[&db])
        .await?
        .get(0);
    Ok(u64::try_from(n)?)
}

fn superuser_env(w: &World, cmd: &mut Command) {
    cmd.env("PGHOST", w.pg.host())
        .env("PGPORT", w.pg.port().to_string())
        .env("PGUSER", "postgres")
        .env("PGPASSWORD", w.pg.superuser_password());
}

/// `pg_dump -Fc -f file` by hand; returns seconds and the file.
async fn manual_dump(w: &World, db: &str, round: u32) -> Result<(f64, std::path::PathBuf)> {
    let file = w.dir.join(format!("by-hand-{round}.dump"));
    let mut cmd = Command::new(w.bin.join("pg_dump"));
    cmd.args(["-Fc", "--no-password", "-f"])
        .arg(&file)
        .arg(format!("--dbname={db}"));
    superuser_env(w, &mut cmd);
    let t = Instant::now();
    let out = cmd.output()?;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("pg_dump failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    eprintln!("by hand dump {round}: {secs:.1} s");
    Ok((secs, file))
}

/// CREATE DATABASE, then `pg_restore` with the controller's flags; returns seconds.
async fn manual_restore(w: &World, file: &Path, round: u32, jobs: u16) -> Result<f64> {
    let name = format!("by_hand_{round}");
    let c = w.pg.connect_as_superuser().await?;
    let t = Instant::now();
    c.batch_execute(&format!("CREATE DATABASE {name}")).await?;
    let mut cmd = Command::new(w.bin.join("pg_restore"));
    cmd.args([
        "--exit-on-error",
        "--no-owner",
        "--no-privileges",
        "--no-password",
    ])
    .arg(match jobs {
        0 | 1 => "--single-transaction".to_string(),
        n => format!("--jobs={n}"),
    })
    .arg(format!("--dbname={name}"))
    .arg(file);
    superuser_env(w, &mut cmd);
    let out = cmd.output()?;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!(
            "pg_restore failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("by hand restore {round}: {secs:.1} s");
    Ok(secs)
}

/// A Backup created and waited for until Completed; returns seconds.
pub(crate) async fn controller_dump(w: &World, db: &str, name: &str) -> Result<f64> {
    let api: Api<Backup> = Api::namespaced(w.client.clone(), &w.ns);
    let backup: Backup = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
        "metadata": {"name": name}, "spec": {"databaseRef": {"name": db}},
    }))?;
    let t = Instant::now();
    api.create(&PostParams::default(), &backup).await?;
    let done = dbops_e2e::wait::wait_for(
        &format!("Backup {name} Completed"),
        LONG,
        || async { Ok(api.get_opt(name).await?) },
        |b| {
            b.as_ref()
                .and_then(|b| b.status.as_ref())
                .and_then(|s| s.phase)
                .is_some_and(|p| matches!(p, BackupPhase::Completed | BackupPhase::Failed))
        },
    )
    .await?;
    let secs = t.elapsed().as_secs_f64();
    if done.and_then(|b| b.status).and_then(|s| s.phase) != Some(BackupPhase::Completed) {
        bail!("Backup {name} failed");
    }
    eprintln!("controller dump {name}: {secs:.1} s");
    Ok(secs)
}

/// Backup `name` (Completed) given `verify: true` and waited for until its verification
/// ended, Passed; returns seconds.
async fn controller_verify(w: &World, name: &str) -> Result<f64> {
    let api: Api<Backup> = Api::namespaced(w.client.clone(), &w.ns);
    let t = Instant::now();
    let verify = serde_json::json!({"spec": {"verify": true}});
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&verify),
    )
    .await?;
    let done = dbops_e2e::wait::wait_for(
        &format!("Backup {name} verified"),
        LONG,
        || async { Ok(api.get_opt(name).await?) },
        |b| {
            b.as_ref()
                .and_then(|b| b.status.as_ref())
                .and_then(|s| s.verification.as_ref())
                .is_some_and(|v| v.result.as_str() != "Running")
        },
    )
    .await?;
    let secs = t.elapsed().as_secs_f64();
    let v = done.and_then(|b| b.status).and_then(|s| s.verification);
    if v.as_ref().map(|v| v.result.as_str()) != Some("Passed") {
        bail!("Backup {name}: verification {v:?}");
    }
    eprintln!("controller verify {name}: {secs:.1} s");
    Ok(secs)
}

/// A Database restored from `backup`, created and waited for until Ready; returns seconds.
pub(crate) async fn controller_restore(w: &World, name: &str, backup: &str) -> Result<f64> {
    let t = Instant::now();
    create_database(w, name, Some(backup)).await?;
    let secs = t.elapsed().as_secs_f64();
    eprintln!("controller restore {name}: {secs:.1} s");
    Ok(secs)
}
