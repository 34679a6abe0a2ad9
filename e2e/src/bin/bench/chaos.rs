//! `dbops-bench chaos`: faults nobody scripted, against the real test bed, then
//! invariants (issue 12, part 3).
//!
//! One control plane, two PostgreSQL servers (two DatabaseServers, `chaos-a` and
//! `chaos-b`, served by every controller through `--server-selector`), a `file://`
//! backup store shared by the database- and backup-controller, and `--replicas` (2)
//! leader-elected replicas of each of the three controllers, each with its own client
//! certificate (the audit log tells them apart), `POD_NAME` and log directory, run from
//! copies of the binaries taken at the start (a rebuild during the run changes nothing).
//! Then, until `--kills` SIGKILLs or `--duration` seconds:
//!
//! - a killer ([`faults`]) SIGKILLs a random running replica (never both of one
//!   controller at once) every `--min-gap`..`--max-gap` seconds and starts it again after
//!   0.2-5 s, half the time under its old name (a container restart: it takes its Lease
//!   back at once), half under a new one (a new pod: the Lease must expire first); less
//!   often it restarts a PostgreSQL server (fast shutdown, 1-8 s down) or kube-apiserver
//!   (SIGTERM or SIGKILL, same port and etcd), at least once each per run. A replica that
//!   exits by itself (a deposed leader does) is started again, as a kubelet would;
//! - a driver ([`driver`]) creates, edits (connection limit, deletion policy, schedule, a
//!   connection Secret's password) and deletes Databases (all three deletion policies,
//!   some restored from a Backup), Backups, scheduled Backups (every minute, `keepLast`)
//!   and Migrations (both directions, Automatic and Manual cutover, now and then deleted
//!   in flight), at most `--max-databases` Databases at once; like a user it deletes a
//!   failed final snapshot when a `Snapshot` deletion's condition asks for it;
//! - a writer ([`writer`]) per migrated Database inserts numbered rows through its
//!   connection Secret (whatever it says at the moment, reconnecting on failure) and
//!   records which inserts committed.
//!
//! Then the faults stop and the driver goes on for `--calm` seconds (a deletion seconds
//! after the last restart must be done by processes that are not restarted again);
//! schedules are removed and Manual Migrations approved; every object must settle
//! within `--settle-timeout` ([`check`]): no deletionTimestamp left, Backups Completed or
//! Failed, Migrations ended, Databases Ready at their generation (with their edited
//! password rotated) or in a permanent reported state. Then the invariants:
//!
//! 1. every marked PostgreSQL database and role belongs to a Database on that very
//!    server (or to a deleted one with policy `Retain`), none twice, nothing unmarked,
//!    and every Ready Database has its database and role;
//! 2. every Ready Database's connection Secret (`PG*` keys) logs in, to its server;
//! 3. every Completed Backup has exactly one artifact whose SHA-256 matches its status
//!    and its manifest; no partial or temporary file is left; no artifact of a deleted
//!    Backup with `deletionPolicy: Delete`;
//! 4. no finalizer stuck (nothing still deleting after the settle timeout);
//! 5. no committed write lost: every row a writer saw committed is on the server its
//!    Database ends on (or, deleted with `Retain`, was last on);
//! 6. no Database ends in a state nothing in the run should cause (`DatabaseMissing`,
//!    `NameConflict`, `SecretConflict`, `ChecksumMismatch`, `ArtifactNotFound`);
//! 7. liveness: no deletion and no Database spec change waited more than
//!    `--max-latency` seconds (measured from lists, not from a watch, which may lag).
//!
//! Every fault, action, observation and violation is printed as it happens (and to
//! `journal.log` in the run directory); a violation comes with the controllers' log
//! lines about the object and the faults around it (`evidence/` in the run directory,
//! which is kept when anything was found, with `--keep` or `--self-test`). An object
//! that did not settle is also given a diagnosis: its controller's leader is restarted
//! and the run says whether a fresh process settles it. The exit status is non-zero on
//! any violation. `--self-test` breaks one thing per invariant after settling and passes
//! only when each is caught. The harness's own client logging is off unless `RUST_LOG`
//! is set. `dbops-bench chaos --duration 60` is the short run (about two and a half
//! minutes in all); `dbops-bench chaos --kills 1000` is the long run.

mod check;
mod driver;
mod faults;
mod history;
mod inject;
mod writer;

use std::fmt::Display;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::DatabaseServer;
use dbops_e2e::controlplane::Options;
use dbops_e2e::{ControlPlane, PgServer};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;

use crate::bed::namespace;

#[derive(clap::Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Stop after this many SIGKILLs of controller replicas.
    #[arg(long)]
    pub kills: Option<u64>,
    /// Stop after this many seconds of chaos (120 when neither this nor --kills is given).
    #[arg(long)]
    pub duration: Option<u64>,
    /// Seed of every random choice (a random one, printed, when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most Databases alive at once.
    #[arg(long, default_value_t = 20)]
    pub max_databases: usize,
    /// Shortest pause between two faults, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub min_gap: f64,
    /// Longest pause between two faults, seconds.
    #[arg(long, default_value_t = 8.0)]
    pub max_gap: f64,
    /// Chance that a fault restarts a PostgreSQL server instead of killing a replica.
    #[arg(long, default_value_t = 0.06)]
    pub pg_restart_chance: f64,
    /// Chance that a fault restarts kube-apiserver instead of killing a replica.
    #[arg(long, default_value_t = 0.03)]
    pub apiserver_restart_chance: f64,
    /// How long every object may take to settle once the faults stop, seconds.
    #[arg(long, default_value_t = 600)]
    pub settle_timeout: u64,
    /// Seconds the driver goes on after the last fault, with every process left alone.
    #[arg(long, default_value_t = 30)]
    pub calm: u64,
    /// Replicas of each controller (2: leader election under fire; 1: every kill stops
    /// the controller until it is back).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub replicas: u8,
    /// Leader election (off only with one replica: each controller process then works
    /// from its first moment, as a plain Deployment of one pod without a Lease would).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// A deletion or a Database spec change that waits longer than this (seconds) for the
    /// controllers is a violation (0: only reported); a deletion that waited for a person
    /// (a failed final snapshot, by design) does not count.
    #[arg(long, default_value_t = 120)]
    pub max_latency: u64,
    /// Keep the run directory (logs, store, journal) even without violations.
    #[arg(long)]
    pub keep: bool,
    /// After settling, break one thing per invariant behind dbops' back and check that
    /// each is caught (the run then passes when exactly those are found).
    #[arg(long)]
    pub self_test: bool,
}

/// The tenant namespace and the controllers' own (admin Secrets, Leases, store
/// registration).
pub(crate) const NS: &str = "chaos";
pub(crate) const SYSTEM_NS: &str = "chaos-system";
/// The label selecting this run's DatabaseServers (`--server-selector`).
const SERVER_LABEL: &str = "dbops.dev/bench";

/// A PostgreSQL server of the run: its DatabaseServer name and how the harness reaches
/// it as the superuser (the process itself is the killer's, behind a lock).
#[derive(Clone, Debug)]
pub(crate) struct ServerInfo {
    pub name: String,
    pub port: u16,
    pub password: String,
}

impl ServerInfo {
    /// A superuser session to `dbname`, bounded.
    pub async fn connect(&self, dbname: &str) -> Result<tokio_postgres::Client> {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(dbops_e2e::postgres::SUPERUSER)
            .password(&self.password)
            .dbname(dbname)
            .connect_timeout(Duration::from_secs(5));
        let (client, connection) = tokio::time::timeout(
            Duration::from_secs(10),
            config.connect(tokio_postgres::NoTls),
        )
        .await
        .context("connecting timed out")??;
        spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }
}

/// Everything the tasks share.
pub(crate) struct World {
    pub client: kube::Client,
    pub servers: Vec<ServerInfo>,
    pub store: PathBuf,
    pub dir: PathBuf,
    pub journal: Journal,
    pub history: history::History,
    /// Databases whose deletion waited for a person (a failed final snapshot retried).
    pub waited_for_person: Mutex<std::collections::BTreeSet<String>>,
    /// Set when the faults must stop.
    pub stop_faults: AtomicBool,
    /// Set when the driver must stop (after the calm phase).
    pub stop: AtomicBool,
}

impl World {
    pub fn server(&self, name: &str) -> Option<&ServerInfo> {
        self.servers.iter().find(|s| s.name == name)
    }

    pub fn faults_stopping(&self) -> bool {
        self.stop_faults.load(Ordering::SeqCst)
    }

    /// Sleeps `d`, waking early when the driver must stop; whether it must.
    pub async fn nap(&self, d: Duration) -> bool {
        nap_on(&self.stop, d).await
    }

    /// Sleeps `d`, waking early when the faults must stop; whether they must.
    pub async fn nap_faults(&self, d: Duration) -> bool {
        nap_on(&self.stop_faults, d).await
    }
}

async fn nap_on(flag: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if flag.load(Ordering::SeqCst) {
            return true;
        }
        tokio::time::sleep((end - Instant::now()).min(Duration::from_millis(200))).await;
    }
    flag.load(Ordering::SeqCst)
}

impl World {}

/// Every fault, action and violation, printed as it happens, with the run's elapsed
/// seconds and the UTC time (to match the controllers' logs).
pub(crate) struct Journal {
    t0: Instant,
    file: Mutex<Option<std::fs::File>>,
    pub kills: AtomicU64,
    pub leader_kills: AtomicU64,
    pub pg_restarts: AtomicU64,
    pub apiserver_restarts: AtomicU64,
    pub self_exits: AtomicU64,
    pub actions: AtomicU64,
    pub action_errors: AtomicU64,
    /// Failed final snapshots deleted by the harness so that a deletion can go on.
    pub final_retries: AtomicU64,
    violations: Mutex<Vec<String>>,
    /// (when, what) of every fault, for the evidence around a violation.
    faults: Mutex<Vec<(Timestamp, String)>>,
}

impl Journal {
    fn new(path: &Path) -> Self {
        Self {
            t0: Instant::now(),
            file: Mutex::new(std::fs::File::create(path).ok()),
            kills: AtomicU64::new(0),
            leader_kills: AtomicU64::new(0),
            pg_restarts: AtomicU64::new(0),
            apiserver_restarts: AtomicU64::new(0),
            self_exits: AtomicU64::new(0),
            actions: AtomicU64::new(0),
            action_errors: AtomicU64::new(0),
            final_retries: AtomicU64::new(0),
            violations: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
        }
    }

    pub fn line(&self, tag: &str, msg: impl Display) {
        let now = Timestamp::now();
        let text = format!(
            "[{:>8.1}s {now:.3}] {tag:<10} {msg}",
            self.t0.elapsed().as_secs_f64()
        );
        println!("{text}");
        if let Ok(mut file) = self.file.lock()
            && let Some(file) = file.as_mut()
        {
            let _ = writeln!(file, "{text}");
        }
    }

    /// A fault: printed and remembered with its time.
    pub fn fault(&self, tag: &str, msg: impl Display) {
        let msg = msg.to_string();
        if let Ok(mut faults) = self.faults.lock() {
            faults.push((Timestamp::now(), format!("{tag} {msg}")));
        }
        self.line(tag, msg);
    }

    pub fn violation(&self, msg: impl Display) {
        let msg = msg.to_string();
        self.line("VIOLATION", &msg);
        if let Ok(mut v) = self.violations.lock() {
            v.push(msg);
        }
    }

    pub fn violations(&self) -> Vec<String> {
        self.violations
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    /// The faults between `from` and `to`.
    pub fn faults_between(&self, from: Timestamp, to: Timestamp) -> Vec<(Timestamp, String)> {
        self.faults
            .lock()
            .map(|f| {
                f.iter()
                    .filter(|(t, _)| *t >= from && *t <= to)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }
}

/// `tokio::spawn` in the caller's tracing dispatcher (see [`run`]).
pub(crate) fn spawn<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    use tracing::instrument::WithSubscriber;
    tokio::spawn(f.with_current_subscriber())
}

/// The CLI entry: [`run_chaos`], non-zero exit on any violation. Unless `RUST_LOG` is
/// set, the harness's own tracing is off: its clients' errors while the apiserver is
/// down would bury the journal (the controllers' logs are in the run directory).
pub async fn run(args: ChaosArgs) -> Result<()> {
    use tracing::instrument::WithSubscriber;
    let outcome = if std::env::var_os("RUST_LOG").is_some() {
        run_chaos(args).await?
    } else {
        run_chaos(args)
            .with_subscriber(tracing::Dispatch::none())
            .await?
    };
    if outcome.violations.is_empty() {
        Ok(())
    } else {
        bail!(
            "{} invariant violation(s); the run directory is {}",
            outcome.violations.len(),
            outcome.dir.display()
        )
    }
}

/// What a run found.
pub struct Outcome {
    pub violations: Vec<String>,
    /// The run directory (deleted unless violations were found or `--keep`).
    pub dir: PathBuf,
}

/// One chaos run: set up, faults and driver until the limit, settle, check.
pub async fn run_chaos(mut args: ChaosArgs) -> Result<Outcome> {
    if args.kills.is_none() && args.duration.is_none() {
        args.duration = Some(120);
    }
    if !(args.min_gap >= 0.0 && args.max_gap >= args.min_gap) {
        bail!("--min-gap must be >= 0 and <= --max-gap");
    }
    if !args.leader_elect && args.replicas > 1 {
        bail!("--leader-elect false needs --replicas 1");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let wall = Instant::now();
    let tmp = tempfile::Builder::new().prefix("dbops-chaos-").tempdir()?;
    let dir = tmp.path().to_path_buf();
    let journal = Journal::new(&dir.join("journal.log"));
    journal.line(
        "START",
        format!(
            "seed {seed}, kills {:?}, duration {:?} s, max {} Databases, run directory {}",
            args.kills,
            args.duration,
            args.max_databases,
            dir.display()
        ),
    );

    let cp = ControlPlane::start(Options {
        dir: dir.join("cp"),
        apiserver_port: None,
    })
    .await?;
    let client = cp.client().await?;
    namespace(&client, NS).await?;
    namespace(&client, SYSTEM_NS).await?;

    let mut pgs = Vec::new();
    let mut servers = Vec::new();
    for name in ["chaos-a", "chaos-b"] {
        let pg = PgServer::start(name).await?;
        crate::bed::create_plain_server(&client, SYSTEM_NS, name, &pg, (SERVER_LABEL, NS)).await?;
        servers.push(ServerInfo {
            name: name.to_string(),
            port: pg.port(),
            password: pg.superuser_password().to_string(),
        });
        pgs.push(Arc::new(tokio::sync::Mutex::new(pg)));
    }
    let store = dir.join("store");
    std::fs::create_dir_all(&store)?;

    let world = Arc::new(World {
        client: client.clone(),
        servers,
        store: store.clone(),
        dir: dir.clone(),
        journal,
        history: history::History::default(),
        waited_for_person: Mutex::new(std::collections::BTreeSet::new()),
        stop_faults: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    let cp = Arc::new(tokio::sync::Mutex::new(cp));
    let fleet = Arc::new(faults::Fleet::new(
        &*cp.lock().await,
        &dir,
        &store,
        usize::from(args.replicas),
        args.leader_elect,
    )?);
    fleet.start_all(&world).await?;
    wait_servers_ready(&client).await?;
    world.journal.line(
        "READY",
        format!(
            "{} controller replicas, 2 DatabaseServers Ready after {:.0} s",
            fleet.replicas.len(),
            world.journal.elapsed().as_secs_f64()
        ),
    );

    let watchers = history::spawn(world.clone());
    let writers = Arc::new(writer::Writers::default());
    let supervisor = spawn(faults::supervise(world.clone(), fleet.clone()));
    let killer = spawn(faults::kill_loop(
        world.clone(),
        fleet.clone(),
        cp.clone(),
        pgs.clone(),
        args.clone(),
        seed,
    ));
    let driver = spawn(driver::run(
        world.clone(),
        writers.clone(),
        args.max_databases,
        seed ^ 0x9e37_79b9_7f4a_7c15,
    ));

    // Until the duration passes or the killer has done its kills (it sets `stop_faults`).
    let chaos_started = Instant::now();
    let limit = args.duration.map(Duration::from_secs);
    while !world.faults_stopping() {
        if limit.is_some_and(|l| chaos_started.elapsed() >= l) {
            world.stop_faults.store(true, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let chaos_secs = chaos_started.elapsed().as_secs_f64();
    world.journal.line(
        "STOP",
        format!(
            "faults stop after {chaos_secs:.0} s; the driver goes on for {} s (calm)",
            args.calm
        ),
    );
    killer.await.context("the killer panicked")??;
    fleet
        .wait_all_running(&world, Duration::from_secs(180))
        .await?;
    for pg in &pgs {
        pg.lock().await.start_again().await?;
    }
    // Calm: what is asked now (a deletion seconds after the last restart) must be done
    // by processes that are not restarted any more.
    tokio::time::sleep(Duration::from_secs(args.calm)).await;
    world.stop.store(true, Ordering::SeqCst);
    driver.await.context("the driver panicked")?;
    world.journal.line("STOP", "the driver stops");

    // Settle: what a user would do to let things end, then wait.
    driver::quiesce(&world).await;
    let settle_started = Instant::now();
    let unsettled = check::settle(&world, Duration::from_secs(args.settle_timeout)).await;
    let settle_secs = settle_started.elapsed().as_secs_f64();
    world.journal.line(
        "SETTLED",
        if unsettled.is_empty() {
            format!("everything settled in {settle_secs:.0} s")
        } else {
            format!(
                "{} object(s) still unsettled after {settle_secs:.0} s",
                unsettled.len()
            )
        },
    );
    writers.stop_all().await;
    let (expected, unsettled) = if args.self_test {
        let expected = inject::inject(&world, &writers).await?;
        (
            expected,
            check::settle(&world, Duration::from_secs(15)).await,
        )
    } else {
        (Vec::new(), unsettled)
    };
    let stats = check::check_all(&world, &unsettled, &writers, &fleet).await;
    // (7) Liveness: what the user asked is acted on in bounded time.
    if args.max_latency > 0 {
        let person = world
            .waited_for_person
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default();
        for l in world.history.waits() {
            if l.secs <= args.max_latency as f64 {
                break;
            }
            if l.pending || (l.kind == "Database" && person.contains(&l.name)) {
                continue;
            }
            world.journal.violation(format!(
                "(7) {} took {:.0} s (from {:.3}; bound {} s)",
                l.what, l.secs, l.since, args.max_latency
            ));
            let to = l.since + k8s_openapi::jiff::SignedDuration::from_secs_f64(l.secs);
            let text = check::evidence(&world, &fleet, l.kind, &l.name, Some((l.since, to)));
            check::keep_evidence(&world, &format!("slow-{}-{}.txt", l.kind, l.name), &text);
        }
    }
    supervisor.abort();
    for w in watchers {
        w.abort();
    }

    let mut violations = world.journal.violations();
    if args.self_test {
        // Each injected fault must be among the violations; only those may be.
        let mut missed = Vec::new();
        for e in &expected {
            let before = violations.len();
            violations.retain(|v| !v.contains(e.as_str()));
            let caught = before - violations.len();
            world.journal.line(
                "SELF-TEST",
                format!("{}: {e}", if caught > 0 { "caught" } else { "NOT CAUGHT" }),
            );
            if caught == 0 {
                missed.push(format!("self-test: not caught: {e}"));
            }
        }
        violations.extend(missed);
    }
    for l in world.history.slowest(5) {
        world.journal.line(
            "SLOWEST",
            format!("{:.1} s: {} (from {:.3})", l.secs, l.what, l.since),
        );
    }
    let j = &world.journal;
    let summary = format!(
        "seed {seed}; chaos {chaos_secs:.0} s: {} kills ({} of a leader), {} PostgreSQL restarts, {} kube-apiserver restarts, {} replica self-exits; {} actions ({} refused or failed), {} failed final snapshots retried by hand; {}; settle {settle_secs:.0} s; {} violation(s); wall {:.0} s",
        j.kills.load(Ordering::Relaxed),
        j.leader_kills.load(Ordering::Relaxed),
        j.pg_restarts.load(Ordering::Relaxed),
        j.apiserver_restarts.load(Ordering::Relaxed),
        j.self_exits.load(Ordering::Relaxed),
        j.actions.load(Ordering::Relaxed),
        j.action_errors.load(Ordering::Relaxed),
        j.final_retries.load(Ordering::Relaxed),
        stats,
        violations.len(),
        wall.elapsed().as_secs_f64()
    );
    j.line("SUMMARY", &summary);
    for (i, v) in violations.iter().enumerate() {
        println!("  violation {}: {v}", i + 1);
    }

    // Keep the evidence: PostgreSQL logs live in the servers' own temporary directories.
    let keep = args.keep || args.self_test || !violations.is_empty();
    if keep {
        for pg in &pgs {
            let pg = pg.lock().await;
            let path = pg.log_path();
            if let Some(name) = path.file_name() {
                let _ = std::fs::copy(&path, dir.join(name));
            }
        }
    }
    drop(fleet);
    drop(cp);
    let dir = if keep { tmp.keep() } else { dir };
    if keep {
        println!("run directory kept: {}", dir.display());
    }
    Ok(Outcome { violations, dir })
}

/// `--controller-namespace` and `--server-selector` of every replica.
pub(crate) fn scope_args() -> Vec<String> {
    vec![
        format!("--watch-namespace={NS}"),
        format!("--controller-namespace={SYSTEM_NS}"),
        format!("--server-selector={SERVER_LABEL}={NS}"),
    ]
}

async fn wait_servers_ready(client: &kube::Client) -> Result<()> {
    let api: Api<DatabaseServer> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let mut ready = 0;
        for name in ["chaos-a", "chaos-b"] {
            if let Some(s) = api.get_opt(name).await?
                && s.status.as_ref().is_some_and(|st| {
                    st.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                })
            {
                ready += 1;
            }
        }
        if ready == 2 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the DatabaseServers are not Ready after 180 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The `Ready` condition of a list of conditions: (status, reason, message).
pub(crate) fn ready_condition(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
) -> Option<(&str, &str, &str)> {
    conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| (c.status.as_str(), c.reason.as_str(), c.message.as_str()))
}
