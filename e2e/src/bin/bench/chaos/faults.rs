//! The six controller replicas and the faults: SIGKILLs of replicas, restarts of a
//! PostgreSQL server and of kube-apiserver; and a supervisor that starts again a replica
//! that exited by itself (as a kubelet would).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_e2e::controllers::http_get;
use dbops_e2e::process::{Spec, Supervised, free_port};
use dbops_e2e::{ControlPlane, PgServer};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::args::ChaosArgs;
use super::world::{SYSTEM_NS, World, scope_args, spawn};

pub(crate) const CONTROLLERS: [&str; 3] = [
    "database-controller",
    "backup-controller",
    "migration-controller",
];

/// One replica: how to start it and, while it runs, its process.
pub(crate) struct Replica {
    pub controller: &'static str,
    pub index: usize,
    /// `<controller>-<index>`: the replica's log directory and client certificate user.
    pub slot: String,
    /// `POD_NAME`, the Lease holder identity: the slot, or after a restart "as a new pod"
    /// the slot and a number (a new name, as a ReplicaSet would give).
    identity: Mutex<String>,
    kubeconfig: PathBuf,
    /// The run's own copy of the controller binary: a rebuild of the workspace during
    /// the run changes nothing here.
    binary: PathBuf,
    pub log_dir: PathBuf,
    args: Vec<String>,
    running: Mutex<Option<Supervised>>,
    /// How many times it was started.
    starts: std::sync::atomic::AtomicU64,
}

impl Replica {
    pub fn identity(&self) -> String {
        self.identity
            .lock()
            .map(|i| i.clone())
            .unwrap_or_else(|_| self.slot.clone())
    }

    pub fn log_path(&self) -> PathBuf {
        self.log_dir.join(format!("{}.log", self.controller))
    }

    fn is_running(&self) -> bool {
        self.running.lock().is_ok_and(|r| r.is_some())
    }

    /// A line in the replica's own log, so its log shows where the harness acted.
    fn mark_log(&self, what: &str) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.log_path())
        {
            let _ = writeln!(
                f,
                "{} ===== dbops-bench chaos: {what} =====",
                Timestamp::now()
            );
        }
    }

    /// Starts the binary as `identity` on a free metrics port; returns once `/healthz`
    /// answers (blocking, at most 30 s).
    fn launch(&self, identity: &str) -> Result<Supervised> {
        let port = free_port()?;
        let spec = Spec::new(self.controller, &self.binary)
            .args([format!("--metrics-addr=127.0.0.1:{port}")])
            .args(self.args.iter().cloned())
            .env("KUBECONFIG", self.kubeconfig.display().to_string())
            .env("POD_NAME", identity);
        let mut process = Supervised::start(&spec, &self.log_dir)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = process.try_exit()? {
                bail!("exited ({status}) while starting");
            }
            if http_get(port, "/healthz").is_ok_and(|(code, _)| code == 200) {
                return Ok(process);
            }
            if Instant::now() > deadline {
                bail!("/healthz not answering after 30 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts the process (blocking until `/healthz` answers), retrying every 2 s.
    async fn start(self: &Arc<Self>, world: &World) {
        loop {
            let me = self.clone();
            let identity = self.identity();
            let started = tokio::task::spawn_blocking(move || {
                me.mark_log(&format!("start as {identity}"));
                me.launch(&identity)
            })
            .await;
            match started {
                Ok(Ok(process)) => {
                    let pid = process.pid();
                    if let Ok(mut r) = self.running.lock() {
                        *r = Some(process);
                    }
                    let n = self.starts.fetch_add(1, Ordering::Relaxed);
                    if n > 0 {
                        world.journal.line(
                            "STARTED",
                            format!("{} as {} (pid {pid})", self.slot, self.identity()),
                        );
                    }
                    return;
                }
                Ok(Err(e)) => world.journal.line(
                    "START-ERR",
                    format!("{}: {}", self.slot, first_line(&format!("{e:#}"))),
                ),
                Err(e) => world
                    .journal
                    .line("START-ERR", format!("{}: {e}", self.slot)),
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}

/// The six replicas.
pub(crate) struct Fleet {
    pub replicas: Vec<Arc<Replica>>,
}

impl Fleet {
    pub fn new(
        cp: &ControlPlane,
        dir: &Path,
        store: &Path,
        replicas: usize,
        leader_elect: bool,
    ) -> Result<Self> {
        let bin = dbops_e2e::paths::postgres_bin_dir()?;
        let pg_dump = format!("--pg-dump={}", bin.join("pg_dump").display());
        let pg_restore = format!("--pg-restore={}", bin.join("pg_restore").display());
        let backup_store = format!("--backup-store=file://{}", store.display());
        let bin_dir = dir.join("bin");
        std::fs::create_dir_all(&bin_dir)?;
        let count = replicas;
        let mut replicas = Vec::new();
        for controller in CONTROLLERS {
            let mut args = vec![
                format!("--leader-elect={leader_elect}"),
                "--resync-interval=5s".to_string(),
                "--backoff-base=1s".to_string(),
                "--backoff-max=10s".to_string(),
                // A watch that keeps failing (seen after apiserver restarts) ends its replica
                // well within --max-latency; the default, 90 s, would not leave room for the
                // standby's takeover.
                "--watch-stall-timeout=45s".to_string(),
                // Every reconcile's outcome (debug in the shared runner), for the evidence.
                "--log-filter=info,dbops_shared::controller=debug".to_string(),
            ];
            args.extend(scope_args());
            match controller {
                "database-controller" => args.extend([backup_store.clone(), pg_restore.clone()]),
                "backup-controller" => args.extend([backup_store.clone(), pg_dump.clone()]),
                _ => args.extend([pg_dump.clone(), pg_restore.clone()]),
            }
            let built = dbops_e2e::paths::workspace_bin(&format!("dbops-{controller}"))?;
            let binary = bin_dir.join(format!("dbops-{controller}"));
            std::fs::copy(&built, &binary)
                .with_context(|| format!("copying {}", built.display()))?;
            for index in 0..count {
                let slot = format!("{controller}-{index}");
                let log_dir = dir.join("logs").join(&slot);
                std::fs::create_dir_all(&log_dir)?;
                let kubeconfig =
                    cp.kubeconfig_for(&format!("dbops-{slot}"), &["system:masters"])?;
                replicas.push(Arc::new(Replica {
                    controller,
                    index,
                    identity: Mutex::new(slot.clone()),
                    slot,
                    kubeconfig,
                    binary: binary.clone(),
                    log_dir,
                    args: args.clone(),
                    running: Mutex::new(None),
                    starts: std::sync::atomic::AtomicU64::new(0),
                }));
            }
        }
        Ok(Self { replicas })
    }

    pub async fn start_all(&self, world: &World) -> Result<()> {
        for r in &self.replicas {
            tokio::time::timeout(Duration::from_secs(120), r.start(world))
                .await
                .with_context(|| format!("starting {}", r.slot))?;
        }
        Ok(())
    }

    /// The other replica of the same controller.
    fn sibling(&self, r: &Replica) -> Option<&Arc<Replica>> {
        self.replicas
            .iter()
            .find(|o| o.controller == r.controller && o.index != r.index)
    }

    pub async fn wait_all_running(&self, world: &World, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while !self.replicas.iter().all(|r| r.is_running()) {
            if Instant::now() > deadline {
                bail!("not every replica runs again after {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        world
            .journal
            .line("FLEET", format!("all {} replicas run", self.replicas.len()));
        Ok(())
    }

    /// The replicas of `controller`.
    pub fn of(&self, controller: &str) -> Vec<Arc<Replica>> {
        self.replicas
            .iter()
            .filter(|r| r.controller == controller)
            .cloned()
            .collect()
    }

    /// Stops the replica gracefully (SIGTERM) and starts it again; for the diagnostics
    /// after a stuck object was found.
    pub async fn restart_gracefully(&self, world: &World, r: &Arc<Replica>) {
        let process = r.running.lock().ok().and_then(|mut p| p.take());
        if let Some(mut process) = process {
            r.mark_log("SIGTERM (diagnostic restart)");
            let _ = tokio::task::spawn_blocking(move || {
                let _ = process.signal("TERM");
                let _ = process.wait_exit(Duration::from_secs(30));
            })
            .await;
        }
        world.journal.line(
            "DIAG",
            format!("{} stopped (SIGTERM), starting again", r.slot),
        );
        r.start(world).await;
    }
}

/// Who holds `dbops-<controller>` now (bounded; `?` when unknown).
pub(crate) async fn lease_holder(client: &kube::Client, controller: &str) -> String {
    let api: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NS);
    match tokio::time::timeout(
        Duration::from_secs(2),
        api.get_opt(&format!("dbops-{controller}")),
    )
    .await
    {
        Ok(Ok(Some(l))) => l
            .spec
            .and_then(|s| s.holder_identity)
            .unwrap_or_else(|| "nobody".into()),
        Ok(Ok(None)) => "nobody".into(),
        _ => "?".into(),
    }
}

/// Starts again every replica that exited by itself (a deposed leader exits non-zero),
/// one second later, as a kubelet would.
pub(crate) async fn supervise(world: Arc<World>, fleet: Arc<Fleet>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        for r in &fleet.replicas {
            let exited = {
                let Ok(mut slot) = r.running.lock() else {
                    continue;
                };
                let status = match slot.as_mut() {
                    Some(p) => p.try_exit().ok().flatten(),
                    None => None,
                };
                match status {
                    Some(status) => slot.take().map(|p| (status, p)),
                    None => None,
                }
            };
            if let Some((status, process)) = exited {
                world.journal.self_exits.fetch_add(1, Ordering::Relaxed);
                let tail = super::world::strip_ansi(&process.log_tail(600));
                let last = tail
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or_default()
                    .to_string();
                world.journal.fault(
                    "SELF-EXIT",
                    format!(
                        "{} exited by itself ({status}); last log line: {last}",
                        r.slot
                    ),
                );
                drop(process);
                let (world, r) = (world.clone(), r.clone());
                spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    r.start(&world).await;
                });
            }
        }
    }
}

/// The fault loop: until `args.kills` kills (it then sets `world.stop_faults`) or the
/// faults must stop.
pub(crate) async fn kill_loop(
    world: Arc<World>,
    fleet: Arc<Fleet>,
    cp: Arc<tokio::sync::Mutex<ControlPlane>>,
    pgs: Vec<Arc<tokio::sync::Mutex<PgServer>>>,
    args: ChaosArgs,
    seed: u64,
) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    loop {
        let gap = rng.random_range(args.min_gap..=args.max_gap);
        if world.nap_faults(Duration::from_secs_f64(gap)).await {
            return Ok(());
        }
        // However short the run: a PostgreSQL restart by a third of it, an apiserver
        // restart by two thirds, when chance has brought none.
        let progress = match (args.duration, args.kills) {
            (Some(d), _) => started.elapsed().as_secs_f64() / d.max(1) as f64,
            (None, Some(k)) => world.journal.kills.load(Ordering::SeqCst) as f64 / k.max(1) as f64,
            (None, None) => 0.0,
        };
        let forced_pg = progress > 1.0 / 3.0
            && args.pg_restart_chance > 0.0
            && world.journal.pg_restarts.load(Ordering::SeqCst) == 0;
        let forced_api = progress > 2.0 / 3.0
            && args.apiserver_restart_chance > 0.0
            && world.journal.apiserver_restarts.load(Ordering::SeqCst) == 0;
        let dice: f64 = if forced_pg {
            0.0
        } else if forced_api {
            args.pg_restart_chance
        } else {
            rng.random()
        };
        if dice < args.pg_restart_chance {
            let i = rng.random_range(0..pgs.len());
            let down = Duration::from_millis(rng.random_range(1000..8000));
            restart_pg(&world, &pgs[i], down).await?;
        } else if dice < args.pg_restart_chance + args.apiserver_restart_chance {
            let signal = if rng.random_bool(0.5) { "TERM" } else { "KILL" };
            let down = Duration::from_millis(rng.random_range(500..5000));
            restart_apiserver(&world, &cp, signal, down).await?;
        } else {
            // Never both replicas of one controller at once (with one replica each: any).
            let candidates: Vec<&Arc<Replica>> = fleet
                .replicas
                .iter()
                .filter(|r| r.is_running() && fleet.sibling(r).is_none_or(|s| s.is_running()))
                .collect();
            if candidates.is_empty() {
                continue;
            }
            let victim = candidates[rng.random_range(0..candidates.len())].clone();
            let delay = Duration::from_millis(rng.random_range(200..5000));
            // Half the time it comes back as a new pod (a new name: the Lease must expire
            // before anyone leads again), otherwise as the same pod's container restart.
            let new_pod = rng.random_bool(0.5);
            kill(&world, victim, delay, new_pod).await;
            let kills = world.journal.kills.load(Ordering::SeqCst);
            if args.kills.is_some_and(|k| kills >= k) {
                world.stop_faults.store(true, Ordering::SeqCst);
                return Ok(());
            }
        }
    }
}

/// SIGKILLs the replica, then starts it again after `delay` (in the background).
async fn kill(world: &Arc<World>, victim: Arc<Replica>, delay: Duration, new_pod: bool) {
    let holder = lease_holder(&world.client, victim.controller).await;
    let identity = victim.identity();
    let process = victim.running.lock().ok().and_then(|mut p| p.take());
    let Some(mut process) = process else {
        return;
    };
    let pid = process.pid();
    victim.mark_log("SIGKILL");
    let killed = tokio::task::spawn_blocking(move || {
        process.signal("KILL")?;
        process.wait_exit(Duration::from_secs(20))
    })
    .await;
    let n = world.journal.kills.fetch_add(1, Ordering::SeqCst) + 1;
    let leader = holder == identity;
    let comes_back_as = if new_pod {
        let next = format!("{}-{}", victim.slot, n);
        if let Ok(mut i) = victim.identity.lock() {
            *i = next.clone();
        }
        next
    } else {
        identity.clone()
    };
    if leader {
        world.journal.leader_kills.fetch_add(1, Ordering::Relaxed);
    }
    let outcome = match killed {
        Ok(Ok(_)) => String::new(),
        Ok(Err(e)) => format!(" (kill: {e:#})"),
        Err(e) => format!(" (kill: {e})"),
    };
    world.journal.fault(
        "KILL",
        format!(
            "#{n} {} as {identity} (pid {pid}, {}; Lease holder {holder}), back in {:.1} s as {comes_back_as}{outcome}",
            victim.slot,
            if leader { "LEADER" } else { "standby" },
            delay.as_secs_f64()
        ),
    );
    let world = world.clone();
    spawn(async move {
        tokio::time::sleep(delay).await;
        victim.start(&world).await;
    });
}

async fn restart_pg(
    world: &World,
    pg: &Arc<tokio::sync::Mutex<PgServer>>,
    down: Duration,
) -> Result<()> {
    let mut pg = pg.lock().await;
    let name = pg
        .log_path()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    world.journal.pg_restarts.fetch_add(1, Ordering::Relaxed);
    world.journal.fault(
        "PG-DOWN",
        format!(
            "{name}: fast shutdown, down for {:.1} s",
            down.as_secs_f64()
        ),
    );
    pg.stop()?;
    tokio::time::sleep(down).await;
    let mut tries = 0;
    loop {
        match pg.start_again().await {
            Ok(()) => break,
            Err(e) if tries < 5 => {
                tries += 1;
                world
                    .journal
                    .line("PG-ERR", format!("{name}: start failed: {e:#}"));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => return Err(e).context("PostgreSQL does not start again"),
        }
    }
    world
        .journal
        .fault("PG-UP", format!("{name} accepts connections again"));
    Ok(())
}

async fn restart_apiserver(
    world: &World,
    cp: &Arc<tokio::sync::Mutex<ControlPlane>>,
    signal: &str,
    down: Duration,
) -> Result<()> {
    let mut cp = cp.lock().await;
    world
        .journal
        .apiserver_restarts
        .fetch_add(1, Ordering::Relaxed);
    world.journal.fault(
        "API-DOWN",
        format!(
            "kube-apiserver SIG{signal}, down for {:.1} s",
            down.as_secs_f64()
        ),
    );
    let t = Instant::now();
    cp.restart_apiserver(signal, down)
        .await
        .context("kube-apiserver does not start again")?;
    world.journal.fault(
        "API-UP",
        format!(
            "kube-apiserver ready again, {:.1} s after the stop",
            t.elapsed().as_secs_f64()
        ),
    );
    Ok(())
}
