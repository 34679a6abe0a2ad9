//! What every task of a chaos run shares: the namespaces, the servers, the [`World`]
//! (client, run directory, journal, history, stop flags), the [`Journal`], a `spawn` that
//! keeps the caller's tracing dispatcher, and small readings of objects and logs.

use std::fmt::Display;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dbops_api::{Database, Migration, MigrationPhase};
use k8s_openapi::jiff::Timestamp;

use super::history;

/// The tenant namespace and the controllers' own (admin Secrets, Leases, store
/// registration).
pub(crate) const NS: &str = "chaos";
pub(crate) const SYSTEM_NS: &str = "chaos-system";
/// The label selecting this run's DatabaseServers (`--server-selector`).
pub(crate) const SERVER_LABEL: &str = "dbops.dev/bench";

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
    pub fn new(path: &Path) -> Self {
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

/// `tokio::spawn` in the caller's tracing dispatcher (see `chaos::run`).
pub(crate) fn spawn<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    use tracing::instrument::WithSubscriber;
    tokio::spawn(f.with_current_subscriber())
}

/// `--controller-namespace` and `--server-selector` of every replica.
pub(crate) fn scope_args() -> Vec<String> {
    vec![
        format!("--watch-namespace={NS}"),
        format!("--controller-namespace={SYSTEM_NS}"),
        format!("--server-selector={SERVER_LABEL}={NS}"),
    ]
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

pub(crate) fn is_ready(d: &Database) -> bool {
    d.status
        .as_ref()
        .and_then(|s| ready_condition(&s.conditions))
        .is_some_and(|(st, _, _)| st == "True")
}

pub(crate) fn migration_terminal(m: &Migration) -> bool {
    matches!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(MigrationPhase::Succeeded | MigrationPhase::RolledBack | MigrationPhase::Failed)
    )
}

pub(crate) fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
