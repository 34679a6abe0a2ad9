//! `dbops-bench users`: N Databases with `--users-per-database` DatabaseUsers each
//! (ReadOnly and ReadWrite in turn) on one PostgreSQL server, through the real
//! database-controller, then one password rotation of every one of them (or
//! `--rotations` in a row).
//!
//! Creation: every Database and, right after it, its users are created at once (32
//! requests at a time, as `kubectl apply` of them all would), each with
//! `passwordRotation: {keepPrevious: <--keep-previous>}`; the clock stops when every
//! Database and every user is Ready (watches). Rotation: every Database and every user
//! gets the annotation `dbops.dev/rotate: bench-<round>`; the clocks stop when every
//! connection Secret names a login other than before and every status shows the new
//! `rotateRequest` and that login (watches), then when every status shows no previous
//! login left (it is retired `keepPrevious` after its rotation); the bench then checks in
//! PostgreSQL that every previous login lost LOGIN and that a sample of old and new
//! Secrets is refused and accepted.
//!
//! Reported for each phase: wall time; the controller's API writes by kind (Database
//! status, DatabaseUser status, Secrets, finalizers, Events) from the control plane's
//! audit log, per object; SQL: the statements of the controller's sessions
//! (`application_name` `dbops`) from the server's log (the server runs with
//! `log_statement=all` and `log_connections=on` from its start), by first keyword, DDL
//! among them, and new connections; the controller's own count
//! `dbops_external_requests_total{target="postgres"}` (connections and statements) and
//! `{target="kubernetes"}` (API requests, reads included); reconciles; CPU and peak RSS.
//! Each phase's window ends when the controller has settled (no new audited write and no
//! new reconcile for 3 s), so Events sent off the reconcile's path are counted.
//!
//! The controller runs with a resync interval (`--resync`, default 1h) longer than the
//! run, so no periodic resync falls into a window: what is counted is what the change
//! itself caused. Everything (control plane, server, controller) lives in a temporary
//! directory removed at the end, also on failure.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dbops_api::{Database, DatabaseUser};
use dbops_e2e::{AuditWrite, ControlPlane, ControllerProcess, PgServer};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Event, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::bed::{BenchServer, namespace};
use crate::measure::proc_usage;
use crate::scale;

/// The controller's user in the test control plane (its kubeconfig's certificate).
const USER: &str = "dbops-database-controller";

#[derive(clap::Args, Debug)]
pub struct UsersArgs {
    /// Databases on the server.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    databases: u32,
    /// DatabaseUsers per Database: ReadOnly, ReadWrite, ReadOnly, ... in turn.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=16))]
    users_per_database: u32,
    /// `passwordRotation.keepPrevious` of every Database and user (set at creation): how
    /// long a previous login keeps working after the rotation.
    #[arg(long, default_value = "10s")]
    keep_previous: String,
    /// Rotations of all of them, one after the other (`bench-1`, `bench-2`, ...); the
    /// first one is each credential's first (its second login is created), later ones
    /// alternate between two existing logins.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    rotations: u32,
    /// SQL sessions the controller keeps on the server (`--max-sessions-per-server`).
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// The controller's reconcile concurrency.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// The controller's client-side API rate limit (requests/s).
    #[arg(long, default_value_t = 1000)]
    api_rate_limit: u32,
    /// The controller's resync interval: longer than the run, so that no periodic resync
    /// falls into a measured window.
    #[arg(long, default_value = "3600s")]
    resync: String,
    /// The bound of each wait (all Ready, all rotated, all retired), seconds.
    #[arg(long, default_value_t = 1800)]
    timeout_secs: u64,
    /// A wait fails sooner when no object got done for this long, seconds (naming some
    /// that are not done).
    #[arg(long, default_value_t = 300)]
    stall_secs: u64,
    /// The controller's `--log-filter`.
    #[arg(long, default_value = "warn")]
    controller_log_filter: String,
    /// Copy the PostgreSQL server's log, the apiserver's audit log and the controller's
    /// log into this directory at the end (they are removed with the run's temporary
    /// directory otherwise). The server's log holds SCRAM verifiers, no passwords.
    #[arg(long)]
    keep_logs: Option<std::path::PathBuf>,
}

impl UsersArgs {
    fn users(&self) -> usize {
        (self.databases * self.users_per_database) as usize
    }
    fn objects(&self) -> usize {
        self.databases as usize + self.users()
    }
    fn limit(&self) -> Bound {
        Bound {
            total: Duration::from_secs(self.timeout_secs),
            stall: Duration::from_secs(self.stall_secs),
        }
    }
}

fn db_name(i: u32) -> String {
    format!("db-{i:05}")
}

/// The `j`-th user of Database `i`, and its access.
fn user_of(i: u32, j: u32) -> (String, &'static str) {
    if j.is_multiple_of(2) {
        (format!("{}-ro{}", db_name(i), j / 2), "ReadOnly")
    } else {
        (format!("{}-rw{}", db_name(i), j / 2), "ReadWrite")
    }
}

/// What the controller did in one window.
struct Window {
    writes: Vec<AuditWrite>,
    /// Statements of the controller's sessions, as logged.
    statements: Vec<String>,
    /// The `ALTER ROLE` statements among them that change a login, with their time.
    logins: Vec<LoginChange>,
    /// New connections of the controller's sessions, as logged.
    connections: usize,
    pg_requests: f64,
    kube_requests: f64,
    /// New Event objects in the namespace, by "<involved kind> <reason>".
    events: BTreeMap<String, usize>,
    /// (database-controller, user-controller) reconciles, failed ones included, and
    /// failed ones alone.
    reconciles: (f64, f64),
    failed: (f64, f64),
    cpu: f64,
    /// From the start of the window until the controller settled.
    secs: f64,
}

/// Counters at the start of a window.
struct Mark {
    audit: usize,
    events: HashSet<String>,
    log_offset: u64,
    metrics: Metrics,
    cpu: f64,
    t0: Instant,
}

#[derive(Clone, Copy, Default)]
struct Metrics {
    pg: f64,
    kube: f64,
    reconciles: (f64, f64),
    failed: (f64, f64),
}

struct Bed<'a> {
    cp: &'a ControlPlane,
    pg: &'a PgServer,
    controller: &'a ControllerProcess,
    ns: &'a str,
    ours: HashSet<String>,
    events: Api<Event>,
}

impl Bed<'_> {
    /// The controller's audited writes so far, in this run's namespaces and to its
    /// DatabaseServer.
    fn writes(&self) -> Result<Vec<AuditWrite>> {
        Ok(self
            .cp
            .audit_writes(USER, None)?
            .into_iter()
            .filter(|w| {
                self.ours.contains(&w.namespace) || (w.namespace.is_empty() && w.name == self.ns)
            })
            .collect())
    }

    async fn metrics(&self) -> Result<Metrics> {
        let port = self.controller.metrics_port;
        let (code, body) =
            tokio::task::spawn_blocking(move || dbops_e2e::controllers::http_get(port, "/metrics"))
                .await
                .context("the /metrics GET task failed")??;
        ensure!(code == 200, "/metrics answered {code}");
        let sum = |name: &str, labels: &[&str]| scale::metric_sum(&body, name, labels);
        let rec = |who: &str, outcome: Option<&str>| {
            let who = format!("controller=\"{who}\"");
            match outcome {
                Some(o) => sum(
                    "dbops_reconciles_total",
                    &[&who, &format!("outcome=\"{o}\"")],
                ),
                None => sum("dbops_reconciles_total", &[&who]),
            }
        };
        Ok(Metrics {
            pg: sum("dbops_external_requests_total", &["target=\"postgres\""]),
            kube: sum("dbops_external_requests_total", &["target=\"kubernetes\""]),
            reconciles: (
                rec("database-controller", None),
                rec("user-controller", None),
            ),
            failed: (
                rec("database-controller", Some("error")),
                rec("user-controller", Some("error")),
            ),
        })
    }

    async fn mark(&self) -> Result<Mark> {
        let log = self.pg.log_path();
        Ok(Mark {
            audit: self.writes()?.len(),
            events: self
                .events
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .map(|e| e.name_any())
                .collect(),
            log_offset: std::fs::metadata(&log)
                .with_context(|| format!("reading the size of {}", log.display()))?
                .len(),
            metrics: self.metrics().await?,
            cpu: proc_usage(self.controller.process.pid())?.0,
            t0: Instant::now(),
        })
    }

    /// Waits until the controller has settled (no new audited write, no new reconcile
    /// for 3 s, polled every 500 ms; at most 120 s), then what it did since `mark`.
    async fn window(&self, mark: &Mark) -> Result<Window> {
        let limit = Duration::from_secs(120);
        let deadline = Instant::now() + limit;
        let mut audit = AuditTail::new(self.cp.audit_log_path());
        let mut last = (usize::MAX, f64::NAN);
        let mut since = Instant::now();
        loop {
            let m = self.metrics().await?;
            let now = (audit.count()?, m.reconciles.0 + m.reconciles.1);
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() >= Duration::from_secs(3) {
                break;
            }
            if Instant::now() > deadline {
                bail!("the controller did not settle within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let writes = self.writes()?;
        let metrics = self.metrics().await?;
        // The settling itself (3 s of nothing) is not the work's.
        let secs = (mark.t0.elapsed() - since.elapsed()).as_secs_f64();
        let (statements, logins, connections) =
            controller_sql(&self.pg.log_path(), mark.log_offset)?;
        let mut events = BTreeMap::new();
        for e in self.events.list(&ListParams::default()).await?.items {
            if !mark.events.contains(&e.name_any()) {
                let kind = e.involved_object.kind.clone().unwrap_or_default();
                let reason = e.reason.clone().unwrap_or_default();
                *events.entry(format!("{kind} {reason}")).or_default() += 1;
            }
        }
        Ok(Window {
            writes: writes.into_iter().skip(mark.audit).collect(),
            statements,
            logins,
            connections,
            pg_requests: metrics.pg - mark.metrics.pg,
            kube_requests: metrics.kube - mark.metrics.kube,
            events,
            reconciles: (
                metrics.reconciles.0 - mark.metrics.reconciles.0,
                metrics.reconciles.1 - mark.metrics.reconciles.1,
            ),
            failed: (
                metrics.failed.0 - mark.metrics.failed.0,
                metrics.failed.1 - mark.metrics.failed.1,
            ),
            cpu: proc_usage(self.controller.process.pid())?.0 - mark.cpu,
            secs,
        })
    }
}

/// The number of audit log lines of the controller's writes, read on from where the last
/// call stopped (the whole log is parsed only once per window, by `Bed::writes`).
struct AuditTail {
    path: std::path::PathBuf,
    offset: u64,
    count: usize,
}

impl AuditTail {
    fn new(path: std::path::PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            count: 0,
        }
    }

    fn count(&mut self) -> Result<usize> {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = std::fs::File::open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        // Whole lines only: the apiserver may be writing the last one.
        let end = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let user = format!("\"username\":\"{USER}\"");
        self.count += String::from_utf8_lossy(&bytes[..end])
            .lines()
            .filter(|l| l.contains(&user))
            .count();
        self.offset += end as u64;
        Ok(self.count)
    }
}

/// What an `ALTER ROLE` of the controller did to a login, and when (the server's log
/// line time).
#[derive(Debug, Clone, PartialEq)]
struct LoginChange {
    at: Timestamp,
    role: String,
    change: Change,
}

#[derive(Debug, Clone, PartialEq)]
enum Change {
    /// `LOGIN VALID UNTIL 'infinity'`: the login is given out (a new password with it).
    Activated,
    /// `VALID UNTIL '<time>'`: the previous login's expiry, set at a rotation.
    Expires(Timestamp),
    /// `NOLOGIN`: retired.
    Retired,
}

/// The login changes in one logged statement (a simple query may hold several).
fn login_changes(at: Timestamp, sql: &str) -> Vec<LoginChange> {
    sql.split(';')
        .filter_map(|part| {
            let rest = part.trim().strip_prefix("ALTER ROLE \"")?;
            let (role, rest) = rest.split_once('"')?;
            let change = match rest.trim() {
                "NOLOGIN" => Change::Retired,
                "LOGIN VALID UNTIL 'infinity'" => Change::Activated,
                other => {
                    let until = other.strip_prefix("VALID UNTIL '")?.strip_suffix('\'')?;
                    Change::Expires(until.parse().ok()?)
                }
            };
            Some(LoginChange {
                at,
                role: role.to_string(),
                change,
            })
        })
        .collect()
}

/// The time of a server log line (`%m`: `2026-11-25 02:04:51.164 UTC ...`).
fn log_time(line: &str) -> Option<Timestamp> {
    let mut words = line.split_whitespace();
    let (date, time, zone) = (words.next()?, words.next()?, words.next()?);
    if zone != "UTC" {
        return None;
    }
    format!("{date}T{time}Z").parse().ok()
}

/// The controller's statements (each `statement:`/`execute` line of a session whose
/// `application_name` is `dbops`), the login changes among them, and new connections
/// (`connection authorized` lines naming that application) in the server's log after
/// byte `offset`.
fn controller_sql(log_path: &Path, offset: u64) -> Result<(Vec<String>, Vec<LoginChange>, usize)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file =
        std::fs::File::open(log_path).with_context(|| format!("opening {}", log_path.display()))?;
    file.seek(SeekFrom::Start(offset))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", log_path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let mut statements = Vec::new();
    let mut logins = Vec::new();
    let mut connections = 0;
    for line in text.lines() {
        if line.contains("connection authorized:") && line.contains("application_name=dbops") {
            connections += 1;
        } else if line.contains(scale::CONTROLLER_APP)
            && let Some(sql) = scale::statement_of(line)
        {
            if let Some(at) = log_time(line) {
                logins.extend(login_changes(at, sql));
            }
            statements.push(sql.to_string());
        }
    }
    Ok((statements, logins, connections))
}

/// The first keyword of each `;`-separated statement of a logged one (`ALTER ROLE`,
/// `GRANT`, `SELECT`, ...): two words for CREATE/ALTER/DROP/COMMENT ON, else one.
fn keywords(sql: &str) -> Vec<String> {
    sql.split(';')
        .filter_map(|part| {
            let mut words = part
                .split_whitespace()
                .map(|w| w.trim_matches(|c: char| !c.is_ascii_alphabetic()))
                .filter(|w| !w.is_empty());
            let first = words.next()?.to_ascii_uppercase();
            Some(match first.as_str() {
                "CREATE" | "ALTER" | "DROP" | "COMMENT" => {
                    let mut second = words.next().unwrap_or_default().to_ascii_uppercase();
                    if second == "ON" {
                        second = words.next().unwrap_or_default().to_ascii_uppercase();
                    }
                    format!("{first} {second}")
                }
                _ => first,
            })
        })
        .collect()
}

/// The kind of an audited write, for the report.
fn kind_of(w: &AuditWrite) -> String {
    match (w.resource.as_str(), w.subresource.as_str()) {
        ("databases", "status") => "Database status".into(),
        ("databaseusers", "status") => "DatabaseUser status".into(),
        ("secrets", _) => "Secret".into(),
        // The controllers write only `metadata.finalizers` on the objects themselves.
        ("databases", "") => "Database finalizer".into(),
        ("databaseusers", "") => "DatabaseUser finalizer".into(),
        ("events", _) => "Event".into(),
        ("databaseservers", "status") => "DatabaseServer status".into(),
        ("databaseservers", "") => "DatabaseServer finalizer".into(),
        (r, "") => format!("{} {r}", w.verb),
        (r, s) => format!("{} {r}/{s}", w.verb),
    }
}

pub async fn run(args: UsersArgs) -> Result<()> {
    ensure!(
        dbops_api::access::parse_duration(&args.keep_previous).is_some(),
        "--keep-previous must be a duration such as 10s or 1m, not {:?}",
        args.keep_previous
    );
    // Control plane, server, controller: each stopped (and its directory removed) when
    // dropped, in reverse order, whatever happens below.
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-users-").await?;
    let pg = PgServer::start_with_settings(
        "users",
        &[("log_statement", "all"), ("log_connections", "on")],
    )
    .await?;
    let ns = namespace(&client, "bench-users").await?;
    let server = BenchServer::create(&client, &ns, &pg).await?;
    let kubeconfig = cp.kubeconfig_for(USER, &["system:masters"])?;
    let mut extra = vec![
        format!("--watch-namespace={ns}"),
        format!("--concurrency={}", args.concurrency),
        format!("--max-sessions-per-server={}", args.sessions),
        format!("--api-rate-limit={}", args.api_rate_limit),
        format!("--resync-interval={}", args.resync),
        format!("--log-filter={}", args.controller_log_filter),
    ];
    extra.extend(server.controller_args());
    let log_dir = tmp.path().join("controller");
    std::fs::create_dir_all(&log_dir)?;
    let controller =
        ControllerProcess::start("database-controller", &kubeconfig, &log_dir, &extra)?;
    scale::wait_readyz(&controller, Duration::from_secs(120)).await?;
    let bed = Bed {
        cp: &cp,
        pg: &pg,
        controller: &controller,
        ns: &ns,
        ours: [ns.clone(), server.controller_namespace.clone()].into(),
        events: Api::namespaced(client.clone(), &ns),
    };
    let outcome = measure(&client, &bed, &args).await;
    if let Err(e) = &outcome {
        eprintln!(
            "{e:#}\n---- controller log tail ----\n{}",
            controller.process.log_tail(4000)
        );
    }
    if let Some(dir) = &args.keep_logs {
        let logs = [
            pg.log_path(),
            cp.audit_log_path(),
            controller.process.log_path().to_path_buf(),
        ];
        keep_logs(dir, &logs)?;
    }
    let (creation, rounds) = outcome?;
    let (_, peak) = proc_usage(controller.process.pid())?;
    drop(controller);
    report(&args, &creation, &rounds, peak, &pg).await;
    let anomalies: usize = rounds.iter().map(|r| r.anomalies.len()).sum();
    if anomalies > 0 {
        bail!("{anomalies} anomalies after the rotations (see the report)");
    }
    drop(pg);
    drop(cp);
    drop(tmp);
    Ok(())
}

/// Copies each file into `dir` (created if need be).
fn keep_logs(dir: &Path, files: &[std::path::PathBuf]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for file in files {
        let name = file.file_name().context("a log without a file name")?;
        std::fs::copy(file, dir.join(name))
            .with_context(|| format!("copying {} into {}", file.display(), dir.display()))?;
    }
    eprintln!("logs kept in {}", dir.display());
    Ok(())
}

struct Creation {
    dbs_ready: f64,
    all_ready: f64,
    window: Window,
}

struct Rotation {
    round: u32,
    annotated: f64,
    /// (every Secret, every Database status, every DatabaseUser status) shows the new
    /// login; the last of the three.
    secrets: f64,
    db_status: f64,
    user_status: f64,
    rotated: f64,
    retired: f64,
    previous_checked: usize,
    /// `ALTER ROLE ... VALID UNTIL <time>` statements in the window: one per rotation.
    expiries: usize,
    /// What the checks after the rotation found wrong: more or fewer rotations than
    /// credentials, a status and its Secret on different logins, a previous login that
    /// still logs in. The run fails when there is any, after the report.
    anomalies: Vec<String>,
    window: Window,
}

async fn measure(
    client: &kube::Client,
    bed: &Bed<'_>,
    args: &UsersArgs,
) -> Result<(Creation, Vec<Rotation>)> {
    let dbs: Api<Database> = Api::namespaced(client.clone(), bed.ns);
    let users: Api<DatabaseUser> = Api::namespaced(client.clone(), bed.ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), bed.ns);
    let n = args.databases;
    let keep = json!({"keepPrevious": args.keep_previous});

    // Creation.
    println!(
        "# users benchmark: {n} Databases with {} DatabaseUsers each ({} objects), keepPrevious {}\n",
        args.users_per_database,
        args.objects(),
        args.keep_previous
    );
    let mark = bed.mark().await?;
    let t0 = mark.t0;
    let db_ready = wait_all(dbs.clone(), n as usize, t0, args.limit(), |d: &Database| {
        d.status
            .as_ref()
            .is_some_and(|s| s.observed_generation == d.metadata.generation && ready(&s.conditions))
    });
    let user_ready = wait_all(users.clone(), args.users(), t0, args.limit(), user_ready);
    let keep = &keep;
    let create = stream::iter(0..n)
        .flat_map(|i| {
            let db = json!({
                "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
                "metadata": {"name": db_name(i)},
                "spec": {"serverRef": {"name": bed.ns}, "passwordRotation": keep},
            });
            let users = (0..args.users_per_database).map(move |j| {
                let (name, access) = user_of(i, j);
                json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseUser",
                    "metadata": {"name": name},
                    "spec": {"databaseRef": {"name": db_name(i)}, "access": access,
                             "passwordRotation": keep},
                })
            });
            stream::iter(std::iter::once(db).chain(users))
        })
        .map(|object| {
            let (dbs, users) = (dbs.clone(), users.clone());
            async move {
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let pp = PostParams::default();
                if object["kind"] == "Database" {
                    let db: Database = serde_json::from_value(object)?;
                    dbs.create(&pp, &db).await.map(drop)
                } else {
                    let user: DatabaseUser = serde_json::from_value(object)?;
                    users.create(&pp, &user).await.map(drop)
                }
                .with_context(|| format!("creating {name}"))
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>();
    let (created, dbs_ready, users_ready) = tokio::join!(create, db_ready, user_ready);
    created?;
    let dbs_ready = dbs_ready?;
    let all_ready = dbs_ready.max(users_ready?);
    let window = bed.window(&mark).await?;
    let creation = Creation {
        dbs_ready,
        all_ready,
        window,
    };
    print_window(
        &format!(
            "creation: {n} Databases and {} users to Ready",
            args.users()
        ),
        args,
        &creation.window,
    );
    println!(
        "time: all Databases Ready {:.1} s, all Databases and users Ready {:.1} s\n",
        creation.dbs_ready, creation.all_ready
    );

    let mut rounds = Vec::new();
    for round in 1..=args.rotations {
        let r = rotate(bed, args, round, &dbs, &users, &secrets).await?;
        print_window(
            &format!(
                "rotation {round}: every Database and user annotated dbops.dev/rotate=bench-{round}"
            ),
            args,
            &r.window,
        );
        println!(
            "time: annotated {:.1} s; every Secret names the new login {:.1} s, every Database status {:.1} s, every DatabaseUser status {:.1} s; every previous login retired {:.1} s ({} checked in pg_roles); rotations on the server (VALID UNTIL <time>): {}\n",
            r.annotated,
            r.secrets,
            r.db_status,
            r.user_status,
            r.retired,
            r.previous_checked,
            r.expiries
        );
        for a in &r.anomalies {
            println!("**ANOMALY** (rotation {round}): {a}\n");
        }
        rounds.push(r);
    }
    Ok((creation, rounds))
}

fn ready(conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition]) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

fn user_ready(u: &DatabaseUser) -> bool {
    u.status.as_ref().is_some_and(|s| {
        s.observed_generation == u.metadata.generation && ready(&s.conditions) && s.role.is_some()
    })
}

fn username(s: &Secret) -> Option<String> {
    s.data
        .as_ref()?
        .get("username")
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
}

fn password(s: &Secret) -> Option<String> {
    s.data
        .as_ref()?
        .get("password")
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
}

/// The bound of a wait: in all, and without progress (no object newly done).
#[derive(Clone, Copy, Debug)]
struct Bound {
    total: Duration,
    stall: Duration,
}

/// Waits (one watch, no polling) until `want` objects of `api` satisfy `done` in their
/// latest version; the seconds since `t0` then. At most `bound.total`, and fails sooner
/// when no object became done for `bound.stall`, naming some that are not.
async fn wait_all<K>(
    api: Api<K>,
    want: usize,
    t0: Instant,
    bound: Bound,
    done: impl Fn(&K) -> bool,
) -> Result<f64>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let mut seen: BTreeMap<String, bool> = BTreeMap::new();
    let stream = watcher(api, watcher::Config::default()).applied_objects();
    futures::pin_mut!(stream);
    let deadline = tokio::time::Instant::now() + bound.total;
    let mut progress = tokio::time::Instant::now();
    let not_done = |seen: &BTreeMap<String, bool>| {
        let names: Vec<&str> = seen
            .iter()
            .filter(|(_, d)| !**d)
            .map(|(n, _)| n.as_str())
            .take(5)
            .collect();
        let done = seen.values().filter(|d| **d).count();
        format!(
            "{done} of {want} {kind}s done, {} seen; not done: {}",
            seen.len(),
            names.join(", ")
        )
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {
                bail!("{} after {:?}", not_done(&seen), bound.total)
            }
            _ = tokio::time::sleep_until(progress + bound.stall) => {
                bail!("{}; none newly done for {:?}", not_done(&seen), bound.stall)
            }
            next = stream.try_next() => {
                let Some(obj) = next? else { bail!("the {kind} watch ended") };
                let is_done = done(&obj);
                if seen.insert(obj.name_any(), is_done) != Some(true) && is_done {
                    progress = tokio::time::Instant::now();
                }
                if seen.values().filter(|d| **d).count() >= want {
                    return Ok(t0.elapsed().as_secs_f64());
                }
            }
        }
    }
}

/// One rotation of every Database and user: the annotation, then the watches, then the
/// checks (see [`Rotation::anomalies`]).
async fn rotate(
    bed: &Bed<'_>,
    args: &UsersArgs,
    round: u32,
    dbs: &Api<Database>,
    users: &Api<DatabaseUser>,
    secrets: &Api<Secret>,
) -> Result<Rotation> {
    let request = format!("bench-{round}");
    // The credentials before: each Secret's (login and password), each status's login.
    let by_secret: HashMap<String, (String, String)> = secrets
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|s| Some((s.name_any(), (username(s)?, password(s)?))))
        .collect();
    ensure!(
        by_secret.len() == args.objects(),
        "{} connection Secrets, not {}",
        by_secret.len(),
        args.objects()
    );
    let db_login: HashMap<String, String> = dbs
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|d| Some((d.name_any(), d.status.as_ref()?.login.clone()?)))
        .collect();
    let user_login: HashMap<String, String> = users
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|u| Some((u.name_any(), u.status.as_ref()?.role.clone()?)))
        .collect();
    ensure!(
        db_login.len() == args.databases as usize && user_login.len() == args.users(),
        "not every status names its login ({} Databases, {} users)",
        db_login.len(),
        user_login.len()
    );
    // A sample to log in with: the first Database's Secret and its users', before.
    let sample: Vec<String> = std::iter::once(db_name(0))
        .chain((0..args.users_per_database).map(|j| user_of(0, j).0))
        .map(|o| format!("{o}-connection"))
        .collect();
    let mut old_sample = Vec::new();
    for name in &sample {
        old_sample.push(secrets.get(name).await?);
    }

    let by_secret = Arc::new(by_secret);
    let mark = bed.mark().await?;
    let t0 = mark.t0;
    let limit = args.limit();
    // Nothing is retired before keepPrevious is up: that is no stall.
    let keep = dbops_api::access::parse_duration(&args.keep_previous).unwrap_or_default();
    let retire_limit = Bound {
        total: limit.total + keep,
        stall: limit.stall + keep,
    };
    // Rotated: the Secret holds another credential; the status shows the request.
    let secrets_flipped = {
        let before = by_secret.clone();
        wait_all(
            secrets.clone(),
            args.objects(),
            t0,
            limit,
            move |s: &Secret| {
                let now = username(s).zip(password(s));
                before
                    .get(&s.name_any())
                    .is_some_and(|old| now.is_some_and(|now| &now != old))
            },
        )
    };
    let db_rotated = {
        let request = request.clone();
        wait_all(
            dbs.clone(),
            args.databases as usize,
            t0,
            limit,
            move |d: &Database| {
                d.status.as_ref().is_some_and(|s| {
                    s.rotate_request.as_deref() == Some(request.as_str()) && s.login.is_some()
                })
            },
        )
    };
    let user_rotated = {
        let request = request.clone();
        wait_all(
            users.clone(),
            args.users(),
            t0,
            limit,
            move |u: &DatabaseUser| {
                u.status.as_ref().is_some_and(|s| {
                    s.rotate_request.as_deref() == Some(request.as_str()) && s.role.is_some()
                })
            },
        )
    };
    // Retired: the status names no previous login any more (the controller took its
    // LOGIN away, and ended its sessions, first); checked in pg_roles below.
    let db_retired = {
        let request = request.clone();
        wait_all(
            dbs.clone(),
            args.databases as usize,
            t0,
            retire_limit,
            move |d: &Database| {
                d.status.as_ref().is_some_and(|s| {
                    s.rotate_request.as_deref() == Some(request.as_str())
                        && s.login.is_some()
                        && s.previous_login.is_none()
                })
            },
        )
    };
    let user_retired = {
        let request = request.clone();
        wait_all(
            users.clone(),
            args.users(),
            t0,
            retire_limit,
            move |u: &DatabaseUser| {
                u.status.as_ref().is_some_and(|s| {
                    s.rotate_request.as_deref() == Some(request.as_str())
                        && s.role.is_some()
                        && s.previous_role.is_none()
                })
            },
        )
    };
    let annotate = async {
        let patch = json!({"metadata": {"annotations": {"dbops.dev/rotate": request}}});
        let names = (0..args.databases).flat_map(|i| {
            std::iter::once((true, db_name(i)))
                .chain((0..args.users_per_database).map(move |j| (false, user_of(i, j).0)))
        });
        stream::iter(names)
            .map(|(is_db, name)| {
                let (dbs, users, patch) = (dbs.clone(), users.clone(), patch.clone());
                async move {
                    let params = PatchParams::default();
                    if is_db {
                        dbs.patch(&name, &params, &Patch::Merge(&patch))
                            .await
                            .map(drop)
                    } else {
                        users
                            .patch(&name, &params, &Patch::Merge(&patch))
                            .await
                            .map(drop)
                    }
                    .with_context(|| format!("annotating {name}"))
                }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await?;
        anyhow::Ok(t0.elapsed().as_secs_f64())
    };
    let (annotated, secrets_at, db_at, user_at, db_ret, user_ret) = tokio::join!(
        annotate,
        secrets_flipped,
        db_rotated,
        user_rotated,
        db_retired,
        user_retired
    );
    let (annotated, secrets_at, db_at, user_at) = (annotated?, secrets_at?, db_at?, user_at?);
    let retired = db_ret?.max(user_ret?);
    let window = bed.window(&mark).await?;

    let mut anomalies = Vec::new();
    // One rotation per credential: a login other than before, named by both the status
    // and the Secret (an even number of rotations would end on the same login), and one
    // `VALID UNTIL <time>` (the previous login's expiry) per credential on the server.
    let now_secrets: HashMap<String, String> = secrets
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|s| Some((s.name_any(), username(s)?)))
        .collect();
    let mut same = Vec::new();
    let mut differ = Vec::new();
    let db_now = dbs.list(&ListParams::default()).await?.items;
    let user_now = users.list(&ListParams::default()).await?.items;
    let now_logins = db_now
        .iter()
        .map(|d| {
            (
                d.name_any(),
                d.status.as_ref().and_then(|s| s.login.clone()),
            )
        })
        .chain(
            user_now
                .iter()
                .map(|u| (u.name_any(), u.status.as_ref().and_then(|s| s.role.clone()))),
        );
    for (name, login) in now_logins {
        let old = db_login.get(&name).or_else(|| user_login.get(&name));
        if login.as_ref() == old {
            same.push(name.clone());
        }
        if login.as_ref() != now_secrets.get(&format!("{name}-connection")) {
            differ.push(name);
        }
    }
    if !same.is_empty() {
        anomalies.push(format!(
            "{} credentials are on the same login as before the rotation (rotated an even number of times), e.g. {}",
            same.len(),
            same.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    if !differ.is_empty() {
        anomalies.push(format!(
            "{} statuses name another login than their Secret, e.g. {}",
            differ.len(),
            differ
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let logins = check_logins(&window.logins, args.objects());
    let expiries = logins.expiries;
    anomalies.extend(logins.anomalies);

    // In PostgreSQL: every previous login has lost LOGIN.
    let admin = bed.pg.connect_as_superuser().await?;
    // (Those on the same login as before are reported above.)
    let previous: Vec<String> = db_login
        .iter()
        .chain(user_login.iter())
        .filter(|(name, _)| !same.contains(name))
        .map(|(_, login)| login.clone())
        .collect();
    let row = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE rolcanlogin), count(*) FROM pg_roles WHERE rolname = ANY($1)",
            &[&previous],
        )
        .await?;
    let (can, found): (i64, i64) = (row.get(0), row.get(1));
    if found as usize != previous.len() || can != 0 {
        anomalies.push(format!(
            "{can} of the {} previous logins can still log in ({found} found)",
            previous.len()
        ));
    }
    // The sample: the old Secrets are refused, the new ones let in.
    for (name, old) in sample.iter().zip(&old_sample) {
        let new = secrets.get(name).await?;
        if try_login(bed.pg, old).await {
            anomalies.push(format!("{name}: the previous credential still logs in"));
        }
        if !try_login(bed.pg, &new).await {
            anomalies.push(format!("{name}: the new credential does not log in"));
        }
    }
    Ok(Rotation {
        round,
        annotated,
        secrets: secrets_at,
        db_status: db_at,
        user_status: user_at,
        rotated: secrets_at.max(db_at).max(user_at),
        retired,
        previous_checked: previous.len(),
        expiries,
        anomalies,
        window,
    })
}

/// What the login changes of a rotation window say.
struct LoginCheck {
    expiries: usize,
    anomalies: Vec<String>,
}

/// One rotation of `credentials` credentials on the server is, for each: one expiry
/// (`VALID UNTIL <time>`) of the login given up, one activation of the login given out,
/// and one retirement (`NOLOGIN`) of the login given up, not before its expiry.
fn check_logins(changes: &[LoginChange], credentials: usize) -> LoginCheck {
    let mut expiry: HashMap<&str, Timestamp> = HashMap::new();
    let (mut expiries, mut activations, mut retirements) = (0, 0, 0);
    let mut early = Vec::new();
    let mut unannounced = Vec::new();
    for c in changes {
        match &c.change {
            Change::Expires(until) => {
                expiries += 1;
                expiry.insert(&c.role, *until);
            }
            Change::Activated => activations += 1,
            Change::Retired => {
                retirements += 1;
                match expiry.get(c.role.as_str()) {
                    // The server's clock and the controller's are the same machine's;
                    // the log's time has millisecond precision.
                    Some(until) if c.at.as_millisecond() + 1 < until.as_millisecond() => early
                        .push(format!(
                            "{} at {} ({:.1} s before its expiry {until})",
                            c.role,
                            c.at,
                            (until.as_millisecond() - c.at.as_millisecond()) as f64 / 1000.0
                        )),
                    Some(_) => {}
                    None => unannounced.push(format!("{} at {}", c.role, c.at)),
                }
            }
        }
    }
    let mut anomalies = Vec::new();
    for (what, count) in [
        ("expiries (VALID UNTIL <time>)", expiries),
        ("activations (LOGIN VALID UNTIL 'infinity')", activations),
        ("retirements (NOLOGIN)", retirements),
    ] {
        if count != credentials {
            anomalies.push(format!(
                "{count} {what} on the server for {credentials} credentials"
            ));
        }
    }
    if !early.is_empty() {
        anomalies.push(format!(
            "{} logins retired before their keepPrevious was up, e.g. {}",
            early.len(),
            early.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
        ));
    }
    if !unannounced.is_empty() {
        anomalies.push(format!(
            "{} logins retired without an expiry set in the rotation, e.g. {}",
            unannounced.len(),
            unannounced
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    LoginCheck {
        expiries,
        anomalies,
    }
}

/// Whether the credential of a connection Secret logs in.
async fn try_login(pg: &PgServer, s: &Secret) -> bool {
    let key = |k: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .unwrap_or_default()
    };
    pg.connect(&key("username"), &key("password"), &key("dbname"))
        .await
        .is_ok()
}

/// The controller's writes in a window, counted by kind.
fn write_rows(w: &Window) -> Vec<(String, usize)> {
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for write in &w.writes {
        *by_kind.entry(kind_of(write)).or_default() += 1;
    }
    by_kind.into_iter().collect()
}

fn print_window(title: &str, args: &UsersArgs, w: &Window) {
    let (n, u) = (args.databases as f64, args.users() as f64);
    println!("## {title}\n");
    println!(
        "| the controller's API writes (audit log) | count | per Database | per DatabaseUser | per object |"
    );
    println!("|---|---|---|---|---|");
    for (kind, count) in write_rows(w) {
        let c = count as f64;
        let (per_db, per_user) = if kind.starts_with("Database ") {
            (format!("{:.2}", c / n), String::new())
        } else if kind.starts_with("DatabaseUser ") && u > 0.0 {
            (String::new(), format!("{:.2}", c / u))
        } else {
            (String::new(), String::new())
        };
        println!(
            "| {kind} | {count} | {per_db} | {per_user} | {:.2} |",
            c / (n + u)
        );
    }
    println!(
        "| **all** | {} | | | **{:.2}** |",
        w.writes.len(),
        w.writes.len() as f64 / (n + u)
    );
    let refused = w.writes.iter().filter(|x| x.code >= 400).count();
    println!(
        "\nnew Events by kind and reason: {}",
        w.events
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "\nrefused writes (HTTP status ≥ 400) among them: {refused}; raw: {}\n",
        crate::measure::writes_by_kind(w.writes.iter().cloned())
    );
    let mut by_word: BTreeMap<String, usize> = BTreeMap::new();
    for s in &w.statements {
        for k in keywords(s) {
            *by_word.entry(k).or_default() += 1;
        }
    }
    let ddl = w.statements.iter().filter(|s| scale::is_ddl(s)).count();
    println!(
        "SQL (server log, the controller's sessions): {} statements ({:.2} per object), {ddl} with DDL, {} new connections; by keyword: {}",
        w.statements.len(),
        w.statements.len() as f64 / (n + u),
        w.connections,
        by_word
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "controller: dbops_external_requests_total postgres +{:.0}, kubernetes +{:.0}; reconciles: database-controller {:.0} ({:.0} failed), user-controller {:.0} ({:.0} failed); CPU {:.1} s; settled after {:.1} s\n",
        w.pg_requests,
        w.kube_requests,
        w.reconciles.0,
        w.failed.0,
        w.reconciles.1,
        w.failed.1,
        w.cpu,
        w.secs
    );
}

async fn report(
    args: &UsersArgs,
    creation: &Creation,
    rounds: &[Rotation],
    peak_kib: u64,
    pg: &PgServer,
) {
    let objects = args.objects() as f64;
    let version = match pg.connect_as_superuser().await {
        Ok(c) => c
            .query_one("SHOW server_version", &[])
            .await
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    println!("## summary\n");
    println!(
        "| | {} Databases + {} DatabaseUsers |",
        args.databases,
        args.users()
    );
    println!("|---|---|");
    println!(
        "| creation → all Databases Ready / all Databases and users Ready | {:.1} s / **{:.1} s** |",
        creation.dbs_ready, creation.all_ready
    );
    println!(
        "| creation: API writes per object (all kinds) | **{:.2}** ({} writes) |",
        creation.window.writes.len() as f64 / objects,
        creation.window.writes.len()
    );
    println!(
        "| creation: SQL statements per object / DDL / connections | {:.1} / {} / {} |",
        creation.window.statements.len() as f64 / objects,
        creation
            .window
            .statements
            .iter()
            .filter(|s| scale::is_ddl(s))
            .count(),
        creation.window.connections
    );
    for r in rounds {
        println!(
            "| rotation {}: annotations sent / every Secret and status on the new login / every previous login retired | {:.1} s / **{:.1} s** / **{:.1} s** |",
            r.round, r.annotated, r.rotated, r.retired
        );
        println!(
            "| rotation {}: API writes per object (all kinds) | **{:.2}** ({} writes) |",
            r.round,
            r.window.writes.len() as f64 / objects,
            r.window.writes.len()
        );
        println!(
            "| rotation {}: SQL statements per object / DDL / connections; controller's postgres requests | {:.1} / {} / {}; {:.0} |",
            r.round,
            r.window.statements.len() as f64 / objects,
            r.window
                .statements
                .iter()
                .filter(|s| scale::is_ddl(s))
                .count(),
            r.window.connections,
            r.window.pg_requests
        );
    }
    println!(
        "| controller peak RSS (VmHWM) | {:.1} MiB |",
        peak_kib as f64 / 1024.0
    );
    println!(
        "\nsettings: controller --concurrency={} --max-sessions-per-server={} --api-rate-limit={} --resync-interval={}; keepPrevious {}; binary target/{}; PostgreSQL {version}; {} cores",
        args.concurrency,
        args.sessions,
        args.api_rate_limit,
        args.resync,
        args.keep_previous,
        std::env::var("DBOPS_PROFILE").unwrap_or_else(|_| "debug".into()),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_counted_by_keyword() {
        assert_eq!(
            keywords("BEGIN; CREATE ROLE \"a\" NOLOGIN; COMMENT ON ROLE \"a\" IS 'm'; COMMIT"),
            ["BEGIN", "CREATE ROLE", "COMMENT ROLE", "COMMIT"]
        );
        assert_eq!(keywords("select 1"), ["SELECT"]);
        assert_eq!(keywords("ALTER ROLE x VALID UNTIL 'y'"), ["ALTER ROLE"]);
        assert!(keywords("  ").is_empty());
    }

    #[test]
    fn login_changes_are_read_from_the_log() {
        let line =
            "2026-11-25 02:04:51.164 UTC [17828] postgres@postgres app=dbops LOG:  statement: x";
        let at = log_time(line).unwrap();
        assert_eq!(at.to_string(), "2026-11-25T02:04:51.164Z");
        let sql = "CREATE ROLE \"a_2\" LOGIN INHERIT; ALTER ROLE \"a_2\" LOGIN VALID UNTIL 'infinity'; ALTER ROLE \"a_2\" CONNECTION LIMIT -1";
        let changes = login_changes(at, sql);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].change, Change::Activated);
        let expiry = login_changes(
            at,
            "ALTER ROLE \"a_1\" VALID UNTIL '2026-11-25T02:04:59.875Z'",
        );
        let until: Timestamp = "2026-11-25T02:04:59.875Z".parse().unwrap();
        assert_eq!(expiry[0].change, Change::Expires(until));
        assert_eq!(
            login_changes(at, "ALTER ROLE \"a_1\" NOLOGIN")[0].change,
            Change::Retired
        );

        // One rotation: expiry, activation, retirement after the expiry.
        let later: Timestamp = "2026-11-25T02:05:00.100Z".parse().unwrap();
        let change = |at, role: &str, change| LoginChange {
            at,
            role: role.into(),
            change,
        };
        let good = [
            change(at, "a_1", Change::Expires(until)),
            change(at, "a_2", Change::Activated),
            change(later, "a_1", Change::Retired),
        ];
        assert!(check_logins(&good, 1).anomalies.is_empty());
        // The flip seen under load: the old login given out again, the new one retired
        // at once.
        let flipped = [
            change(at, "a_1", Change::Expires(until)),
            change(at, "a_2", Change::Activated),
            change(at, "a_1", Change::Activated),
            change(at, "a_2", Change::Retired),
            change(at, "a_2", Change::Activated),
            change(at, "a_1", Change::Retired),
        ];
        let found = check_logins(&flipped, 1).anomalies;
        assert_eq!(found.len(), 4, "{found:?}");
    }

    #[test]
    fn users_alternate_access() {
        assert_eq!(user_of(3, 0), ("db-00003-ro0".to_string(), "ReadOnly"));
        assert_eq!(user_of(3, 1), ("db-00003-rw0".to_string(), "ReadWrite"));
        assert_eq!(user_of(3, 2), ("db-00003-ro1".to_string(), "ReadOnly"));
    }
}
