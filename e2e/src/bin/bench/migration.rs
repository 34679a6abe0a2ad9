//! `dbops-bench migration`: what a Migration costs the application, in each mode. For
//! each `--sizes` entry and each `--modes` entry, a fresh Database on the source server
//! gets `pgbench -i -s <scale>` (about 14.7 MB per scale: 7 ≈ 100 MB, 68 ≈ 1 GB), then a
//! writer commits one small transaction at a time (an autocommit INSERT of 1, 2, 3, ...)
//! through the Database's connection Secret, reading the Secret again after every
//! failure, so it follows the switch to the target as an application would; meanwhile a
//! Migration (`spec.mode` Dump or Logical, Automatic cutover, sourceRetention Keep)
//! moves the Database to the target server.
//!
//! Reported, one markdown row per run: the database's size (pg_database_size), the
//! write unavailability (the longest gap between two successful commits, over the
//! whole run), the Migration's duration (created → Succeeded, seen by a watch), the
//! commits, and the writes lost (committed, yet missing on the target after the
//! cutover: must be 0; the command fails otherwise).
//!
//! The bed: its own control plane, two PostgreSQL servers of the machine's major with
//! `wal_level=logical`, each a DatabaseServer (plain TCP) whose admin Secret is in
//! `bench-migration-system`, and the three controllers (debug or release as
//! `DBOPS_PROFILE` says, shipped defaults otherwise). pgbench_history has no primary
//! key: it gets `REPLICA IDENTITY FULL` (both modes alike) so the Logical mode's
//! Preflight accepts it. After each run the Database is deleted (deletionPolicy Delete:
//! dropped on the target) and the frozen source copy dropped, to keep the disk small.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::{Database, Migration, MigrationPhase, MigrationStep};
use dbops_e2e::fixtures::Connection;
use dbops_e2e::live_writer::{LiveWriter, Options};
use dbops_e2e::{ControllerProcess, PgServer};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};

use crate::bed::{BENCH_LABEL, namespace};

#[derive(clap::Args, Debug)]
pub struct MigrationArgs {
    /// Database sizes, comma-separated, in MB or GB (`15MB` is pgbench scale 1; `100MB`
    /// scale 7; `1GB` scale 68).
    #[arg(long, default_value = "100MB,1GB", value_parser = parse_sizes)]
    sizes: Sizes,
    /// Migration modes, comma-separated, in this order at each size: Dump, Logical.
    #[arg(long, default_value = "Dump,Logical", value_parser = parse_modes)]
    modes: Modes,
    /// The writer's pause after each commit, in milliseconds (0: none).
    #[arg(long, default_value_t = 1)]
    writer_pause_ms: u64,
}

/// About this much of pg_database_size per pgbench scale (with its indexes).
const BYTES_PER_SCALE: f64 = 14.7e6;
/// The bench's name: its namespace, its servers' label value.
const BENCH: &str = "bench-migration";
/// The source's and target's settings: logical replication possible.
const LOGICAL: &[(&str, &str)] = &[
    ("wal_level", "logical"),
    ("max_replication_slots", "10"),
    ("max_wal_senders", "10"),
];
/// How long one pgbench load, one Migration, or one wait for the writer may take.
const LONG: Duration = Duration::from_secs(3 * 3600);
/// The writer's wait before it tries again after a failure (a refused login during the
/// freeze): the resolution of the unavailability measured.
const RETRY: Duration = Duration::from_millis(20);

/// A size asked for: its label and pgbench scale.
#[derive(Clone, Debug)]
struct Size {
    label: String,
    scale: u32,
}

#[derive(Clone, Debug)]
struct Sizes(Vec<Size>);

fn parse_sizes(s: &str) -> Result<Sizes, String> {
    comma_list(
        s,
        parse_size,
        "--sizes needs at least one size (for example 100MB)",
    )
    .map(Sizes)
}

/// The items of a comma-separated list (blanks skipped), at least one; `none` says so
/// when there is none.
fn comma_list<T>(
    s: &str,
    item: impl Fn(&str) -> Result<T, String>,
    none: &str,
) -> Result<Vec<T>, String> {
    let items = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(item)
        .collect::<Result<Vec<_>, _>>()?;
    if items.is_empty() {
        return Err(none.into());
    }
    Ok(items)
}

fn parse_size(s: &str) -> Result<Size, String> {
    let upper = s.to_ascii_uppercase();
    let (number, unit) = if let Some(n) = upper.strip_suffix("GB") {
        (n, 1e9)
    } else if let Some(n) = upper.strip_suffix("MB") {
        (n, 1e6)
    } else {
        return Err(format!("a size is <n>MB or <n>GB, not {s:?}"));
    };
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("a size is <n>MB or <n>GB, not {s:?}"))?;
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("a size must be positive, not {s:?}"));
    }
    let scale = (n * unit / BYTES_PER_SCALE).round().max(1.0);
    if scale > 10_000.0 {
        return Err(format!("{s} is too large for this bench"));
    }
    Ok(Size {
        label: upper.trim().to_string(),
        scale: scale as u32,
    })
}

/// A mode asked for, as `spec.mode` spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Dump,
    Logical,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Dump => "Dump",
            Mode::Logical => "Logical",
        }
    }
}

#[derive(Clone, Debug)]
struct Modes(Vec<Mode>);

fn parse_modes(s: &str) -> Result<Modes, String> {
    comma_list(
        s,
        |m| match m.to_ascii_lowercase().as_str() {
            "dump" => Ok(Mode::Dump),
            "logical" => Ok(Mode::Logical),
            other => Err(format!("--modes takes Dump and Logical, not {other:?}")),
        },
        "--modes needs at least one mode",
    )
    .map(Modes)
}

/// The bed every run uses.
struct World {
    client: kube::Client,
    ns: String,
    source_server: String,
    target_server: String,
    source: PgServer,
    target: PgServer,
    bin: std::path::PathBuf,
    pause: Duration,
}

/// One run's result.
struct Row {
    size: Size,
    mode: Mode,
    bytes: i64,
    gap: Duration,
    duration: Duration,
    commits: usize,
    lost: usize,
    /// Where Verify counted: before the freeze (the Logical mode's baseline) or in it.
    verify: &'static str,
}

pub async fn run(args: MigrationArgs) -> Result<()> {
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-migration-").await?;
    let (source, target) = tokio::join!(
        PgServer::start_with_settings("bench-migration-src", LOGICAL),
        // 17: the Logical mode subscribes only on 16 and newer (LogicalUnsafeBefore16).
        PgServer::start_major_with_settings("bench-migration-dst", 17, LOGICAL),
    );
    let (source, target) = (source?, target?);
    let ns = namespace(&client, BENCH).await?;
    let system = namespace(&client, &format!("{BENCH}-system")).await?;
    let source_server = format!("{BENCH}-source");
    let target_server = format!("{BENCH}-target");
    for (name, pg) in [(&source_server, &source), (&target_server, &target)] {
        crate::bed::create_plain_server(&client, &system, name, pg, (BENCH_LABEL, BENCH)).await?;
    }

    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store)?;
    let logs = tmp.path().join("logs");
    std::fs::create_dir_all(&logs)?;
    let bin = dbops_e2e::paths::postgres_bin_dir()?;
    let common = |extra: &[String]| {
        let mut v = vec![
            format!("--watch-namespace={ns}"),
            format!("--controller-namespace={system}"),
            format!("--server-selector={BENCH_LABEL}={BENCH}"),
            "--log-filter=warn".to_string(),
        ];
        v.extend_from_slice(extra);
        v
    };
    let store_arg = format!("--backup-store=file://{}", store.display());
    let pg_dump = format!("--pg-dump={}", bin.join("pg_dump").display());
    let pg_restore = format!("--pg-restore={}", bin.join("pg_restore").display());
    let kubeconfig = cp.kubeconfig_for("dbops-bench-controllers", &["system:masters"])?;
    let controllers = [
        ControllerProcess::start(
            "database-controller",
            &kubeconfig,
            &logs,
            &common(&[store_arg.clone(), pg_restore.clone()]),
        )?,
        ControllerProcess::start(
            "backup-controller",
            &kubeconfig,
            &logs,
            &common(&[store_arg, pg_dump.clone()]),
        )?,
        ControllerProcess::start(
            "migration-controller",
            &kubeconfig,
            &logs,
            &common(&[pg_dump, pg_restore]),
        )?,
    ];
    let w = World {
        client,
        ns,
        source_server,
        target_server,
        source,
        target,
        bin,
        pause: Duration::from_millis(args.writer_pause_ms),
    };

    let started = k8s_openapi::jiff::Timestamp::now();
    let mut rows = Vec::new();
    for size in &args.sizes.0 {
        for &mode in &args.modes.0 {
            let row = run_one(&w, size, mode)
                .await
                .with_context(|| format!("{} in mode {}", size.label, mode.as_str()))?;
            eprintln!(
                "{} {}: unavailability {:.2} s, Migration {:.1} s, {} commits, {} lost",
                size.label,
                mode.as_str(),
                row.gap.as_secs_f64(),
                row.duration.as_secs_f64(),
                row.commits,
                row.lost
            );
            rows.push(row);
        }
    }

    println!(
        "# migration benchmark ({}, {} cores, started {})\n",
        std::env::var("DBOPS_PROFILE").unwrap_or_else(|_| "debug".into()),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        started.strftime("%Y-%m-%d %H:%M UTC")
    );
    println!(
        "| size (pgbench scale, pg_database_size) | mode | write unavailability (longest gap between two commits) | Migration duration | commits | writes lost | Verify counted |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} (scale {}, {:.0} MB) | {} | {:.2} s | {:.1} s | {} | {} | {} |",
            r.size.label,
            r.size.scale,
            r.bytes as f64 / 1e6,
            r.mode.as_str(),
            r.gap.as_secs_f64(),
            r.duration.as_secs_f64(),
            r.commits,
            r.lost,
            r.verify
        );
    }
    println!(
        "\nwriter: one autocommit INSERT at a time through the connection Secret (re-read after every failure, {} ms apart), {} ms pause after each commit; Migration: Automatic cutover, sourceRetention Keep; both servers PostgreSQL {} with wal_level=logical",
        RETRY.as_millis(),
        args.writer_pause_ms,
        server_version(&w.source).await?
    );
    drop(controllers);
    let lost: usize = rows.iter().map(|r| r.lost).sum();
    if lost > 0 {
        bail!("{lost} committed writes are missing on the target");
    }
    Ok(())
}

async fn run_one(w: &World, size: &Size, mode: Mode) -> Result<Row> {
    let name = format!(
        "db-{}-{}",
        size.label.to_ascii_lowercase().replace('.', "-"),
        mode.as_str().to_ascii_lowercase()
    );
    let databases: Api<Database> = Api::namespaced(w.client.clone(), &w.ns);
    let secrets: Api<Secret> = Api::namespaced(w.client.clone(), &w.ns);
    create_database(w, &databases, &name).await?;
    let secret = format!("{name}-connection");
    let conn = Connection::read(&secrets, &secret).await?;
    let t = Instant::now();
    pgbench(w, &conn, size.scale)?;
    let owner = connect(&conn).await?;
    owner
        .batch_execute(
            "CREATE TABLE bench_writes (n bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now()); \
             ALTER TABLE pgbench_history REPLICA IDENTITY FULL",
        )
        .await
        .context("preparing the writer's table")?;
    drop(owner);
    let bytes: i64 = w
        .source
        .connect_as_superuser()
        .await?
        .query_one("SELECT pg_database_size($1)", &[&conn.dbname])
        .await?
        .get(0);
    eprintln!(
        "{name}: pgbench -i -s {} ({:.0} MB) in {:.0} s",
        size.scale,
        bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );

    let writer = start_writer(&secrets, &secret, w.pause);
    writer
        .wait_commits(200, Duration::from_secs(60))
        .await
        .context("the writer's first commits on the source")?;
    let migration = format!("{name}-move");
    let migrations: Api<Migration> = Api::namespaced(w.client.clone(), &w.ns);
    let m: Migration = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Migration",
        "metadata": {"name": migration},
        "spec": {
            "databaseRef": {"name": name},
            "target": {"serverRef": {"name": w.target_server}},
            "mode": mode.as_str(),
        },
    }))?;
    let t = Instant::now();
    migrations.create(&PostParams::default(), &m).await?;
    let ended = tokio::time::timeout(
        LONG,
        kube::runtime::wait::await_condition(
            migrations.clone(),
            &migration,
            |m: Option<&Migration>| {
                m.and_then(|m| m.status.as_ref())
                    .and_then(|s| s.phase)
                    .is_some_and(|p| {
                        matches!(
                            p,
                            MigrationPhase::Succeeded
                                | MigrationPhase::Failed
                                | MigrationPhase::RolledBack
                        )
                    })
            },
        ),
    )
    .await
    .with_context(|| format!("Migration {migration} did not end within {LONG:?}"))??;
    let duration = t.elapsed();
    let status = ended.and_then(|m| m.status).unwrap_or_default();
    if status.phase != Some(MigrationPhase::Succeeded) {
        bail!(
            "Migration {migration} ended {:?}: {:?}",
            status.phase,
            status
                .conditions
                .iter()
                .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                .collect::<Vec<_>>()
        );
    }
    let verify_said = status
        .steps
        .iter()
        .find(|s| s.name == MigrationStep::Verify)
        .and_then(|s| s.message.clone())
        .unwrap_or_default();
    eprintln!("{} {}: Verify: {verify_said}", size.label, mode.as_str());
    let verify = if verify_said.contains("counted before the freeze") {
        "before the freeze"
    } else {
        "in the freeze"
    };
    // The writer commits on the target now (the Secret was rewritten before the switch
    // was complete); 100 more commits there close the last gap.
    let after = writer.commits();
    writer
        .wait_commits(after + 100, Duration::from_secs(300))
        .await
        .context("the writer's commits on the target")?;
    let log = writer.finish().await;
    let (committed, (gap, _)) = (log.numbers(), log.longest_gap());

    let on_target: HashSet<i64> = w
        .target
        .connect_as_superuser_to(&conn.dbname)
        .await?
        .query("SELECT n FROM bench_writes", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let lost = committed.iter().filter(|n| !on_target.contains(n)).count();

    // Room for the next run: the Database (deletionPolicy Delete) goes from the target,
    // the frozen copy from the source.
    let db = databases.get(&name).await?;
    databases.delete(&name, &DeleteParams::default()).await?;
    if let Some(uid) = db.metadata.uid.as_deref() {
        dbops_e2e::wait::deleted(databases.clone(), &name, uid, Duration::from_secs(600))
            .await
            .with_context(|| format!("deleting Database {name}"))?;
    }
    w.source
        .drop_database_force(&conn.dbname)
        .await
        .context("dropping the source's frozen copy")?;
    Ok(Row {
        size: size.clone(),
        mode,
        bytes,
        gap,
        duration,
        commits: committed.len(),
        lost,
        verify,
    })
}

/// A Database on the source (deletionPolicy Delete), waited for until Ready.
async fn create_database(w: &World, api: &Api<Database>, name: &str) -> Result<()> {
    let db: Database = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
        "metadata": {"name": name},
        "spec": {"serverRef": {"name": w.source_server}, "deletionPolicy": "Delete"},
    }))?;
    api.create(&PostParams::default(), &db).await?;
    crate::bed::wait_provisioned(api, name, Duration::from_secs(300)).await
}

/// A session as the connection Secret says, each statement bounded.
async fn connect(c: &Connection) -> Result<tokio_postgres::Client> {
    let mut config = c.config();
    config
        .options("-c statement_timeout=10000")
        .connect_timeout(Duration::from_secs(5));
    dbops_e2e::postgres::connect_config(&config).await
}

/// The application: inserts 1, 2, 3, ... into `bench_writes`, one autocommit statement at
/// a time, through connection Secret `secret`, reading it again after every failure (so
/// it follows the switch), `RETRY` after a failure and `pause` after each commit.
fn start_writer(secrets: &Api<Secret>, secret: &str, pause: Duration) -> LiveWriter {
    let (secrets, secret) = (secrets.clone(), secret.to_string());
    let connect = move || {
        let (secrets, secret) = (secrets.clone(), secret.clone());
        async move { connect(&Connection::read(&secrets, &secret).await?).await }
    };
    let options = Options::new("bench_writes")
        .pause(pause)
        .after_failed_insert(RETRY)
        .retry(RETRY);
    LiveWriter::start(connect, options)
}

/// `pgbench -i -s scale` as the Database's own role.
fn pgbench(w: &World, c: &Connection, scale: u32) -> Result<()> {
    c.pgbench_init(&w.bin, scale, Some("disable"))
}

async fn server_version(pg: &PgServer) -> Result<String> {
    Ok(pg
        .connect_as_superuser()
        .await?
        .query_one("SHOW server_version", &[])
        .await?
        .get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_become_pgbench_scales() {
        let scales = |s: &str| {
            parse_sizes(s)
                .unwrap()
                .0
                .iter()
                .map(|x| x.scale)
                .collect::<Vec<_>>()
        };
        assert_eq!(scales("100MB,1GB"), [7, 68]);
        assert_eq!(scales("15MB"), [1]);
        assert_eq!(scales("1mb"), [1], "at least scale 1");
        assert!(parse_sizes("100").is_err());
        assert!(parse_sizes("-1GB").is_err());
        assert!(parse_sizes("").is_err());
    }

    #[test]
    fn modes_are_dump_and_logical() {
        assert_eq!(
            parse_modes("Dump,logical").unwrap().0,
            [Mode::Dump, Mode::Logical]
        );
        assert!(parse_modes("Auto").is_err());
    }
}
