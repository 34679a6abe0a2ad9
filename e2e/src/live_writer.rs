//! The live writer: an application under load. It inserts `first`, `first + 1`, ... into a
//! table, one autocommit `INSERT` each, through whatever session its `connect` gives at
//! the moment (a connection Secret read again after every failure follows a Migration's
//! switch to the target, as an application would), and records which inserts committed
//! (the server acknowledged them), when, and what failed. A failed insert ends the
//! session; the next attempt connects again.
//!
//! One writer for everyone who loads a Database while something happens to it: the
//! migration tests, the deployed suite's disruption work, and the chaos and migration
//! benchmarks. What differs between them is in [`Options`] (the table, the first number,
//! the pacing, a bound on each insert) and in `connect` (plain or TLS, which Secret).
//! A committed number must be on the server the Database ends on; an insert that failed
//! or timed out may or may not have committed, and is not counted.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use tokio::sync::watch;
use tracing::instrument::WithSubscriber;

use crate::fixtures::Connection;
use crate::wait::wait_for;

/// How a writer writes.
#[derive(Clone, Debug)]
pub struct Options {
    /// The table it inserts into (`n bigint PRIMARY KEY`, other columns defaulted).
    pub table: String,
    /// The first number; each insert takes the next.
    pub first: i64,
    /// Creates the table (`IF NOT EXISTS`, with `at timestamptz DEFAULT now()`) on each new
    /// session, within 10 s, before inserting (a failure counts as a failed connect).
    pub create_table: bool,
    /// The pause after a committed insert (none when zero).
    pub after_commit: Duration,
    /// The pause after a failed insert, before connecting again.
    pub after_failed_insert: Duration,
    /// The pause after a failed connect, before trying again.
    pub after_failed_connect: Duration,
    /// The bound of one insert (none: as long as the server takes).
    pub insert_timeout: Option<Duration>,
    /// Each insert in the simple query protocol, its number written into the statement
    /// (no prepared statement): what works through PgBouncer 1.20 and older in
    /// transaction mode, which may run a statement's Bind on another server connection
    /// than its Parse.
    pub simple_protocol: bool,
}

impl Options {
    /// Into `table` from 1, no pause after an insert, 20 ms after a failed connect, each
    /// insert unbounded.
    pub fn new(table: &str) -> Self {
        Self {
            table: table.to_string(),
            first: 1,
            create_table: false,
            after_commit: Duration::ZERO,
            after_failed_insert: Duration::ZERO,
            after_failed_connect: Duration::from_millis(20),
            insert_timeout: None,
            simple_protocol: false,
        }
    }

    /// Numbers from `first` on.
    pub fn first(mut self, first: i64) -> Self {
        self.first = first;
        self
    }

    /// Creates the table on each new session (see [`Options::create_table`]).
    pub fn create_table(mut self) -> Self {
        self.create_table = true;
        self
    }

    /// `pause` after every insert, committed or failed (so that a refused insert never
    /// spins).
    pub fn pause(mut self, pause: Duration) -> Self {
        self.after_commit = pause;
        self.after_failed_insert = pause;
        self
    }

    /// `pause` after a failed insert only (see [`Options::pause`]).
    pub fn after_failed_insert(mut self, pause: Duration) -> Self {
        self.after_failed_insert = pause;
        self
    }

    /// `pause` after a failed connect.
    pub fn retry(mut self, pause: Duration) -> Self {
        self.after_failed_connect = pause;
        self
    }

    /// Each insert bounded by `limit` (a timed-out insert is a failed one).
    pub fn insert_timeout(mut self, limit: Duration) -> Self {
        self.insert_timeout = Some(limit);
        self
    }

    /// Inserts in the simple query protocol (see [`Options::simple_protocol`]).
    pub fn simple_protocol(mut self) -> Self {
        self.simple_protocol = true;
        self
    }
}

/// A committed insert.
#[derive(Clone, Copy, Debug)]
pub struct Commit {
    pub n: i64,
    /// When the server's acknowledgement arrived (for gaps).
    pub at: Instant,
    /// The same moment in UTC (to match logs).
    pub time: Timestamp,
}

/// A failed attempt.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The insert's number, or for a failed connect the number the next insert takes.
    pub n: i64,
    /// Whether connecting (or creating the table) failed, not an insert.
    pub connecting: bool,
    pub error: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.connecting {
            write!(f, "connect (before {}): {}", self.n, self.error)
        } else {
            write!(f, "insert {}: {}", self.n, self.error)
        }
    }
}

/// What a writer did.
#[derive(Clone, Debug, Default)]
pub struct Log {
    /// Every committed insert, in order.
    pub committed: Vec<Commit>,
    pub failed_inserts: usize,
    pub failed_connects: usize,
    pub first_failure: Option<Failure>,
    pub last_failure: Option<Failure>,
}

impl Log {
    /// The committed numbers, in order.
    pub fn numbers(&self) -> Vec<i64> {
        self.committed.iter().map(|c| c.n).collect()
    }

    /// Failed attempts, inserts and connects.
    pub fn failures(&self) -> usize {
        self.failed_inserts + self.failed_connects
    }

    /// The longest time between two commits, and the number committed before it (zero
    /// with fewer than two commits).
    pub fn longest_gap(&self) -> (Duration, i64) {
        self.committed
            .windows(2)
            .map(|w| (w[1].at - w[0].at, w[0].n))
            .max()
            .unwrap_or_default()
    }

    fn failed(&mut self, failure: Failure) {
        if failure.connecting {
            self.failed_connects += 1;
        } else {
            self.failed_inserts += 1;
        }
        if self.first_failure.is_none() {
            self.first_failure = Some(failure.clone());
        }
        self.last_failure = Some(failure);
    }
}

/// A running writer; [`LiveWriter::finish`] stops it.
pub struct LiveWriter {
    log: Arc<Mutex<Log>>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl LiveWriter {
    /// Starts writing through the sessions `connect` gives (called at the start and after
    /// every failure). The task runs in the caller's tracing dispatcher.
    pub fn start<F, Fut>(connect: F, options: Options) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<tokio_postgres::Client>> + Send + 'static,
    {
        let log = Arc::new(Mutex::new(Log::default()));
        let (stop, stopped) = watch::channel(false);
        let task =
            tokio::spawn(write(connect, options, log.clone(), stopped).with_current_subscriber());
        Self {
            log,
            stop,
            task: Mutex::new(Some(task)),
        }
    }

    /// [`LiveWriter::start`] through Secret `name` of `secrets` as it is at each connect
    /// (no TLS; 5 s to connect).
    pub fn through_secret(secrets: Api<Secret>, name: &str, options: Options) -> Self {
        let name = name.to_string();
        Self::start(
            move || {
                let (secrets, name) = (secrets.clone(), name.clone());
                async move {
                    let mut config = Connection::read(&secrets, &name).await?.config();
                    config.connect_timeout(Duration::from_secs(5));
                    crate::postgres::connect_config(&config).await
                }
            },
            options,
        )
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Committed inserts so far.
    pub fn commits(&self) -> usize {
        self.lock().committed.len()
    }

    /// The numbers committed so far, from the `from`-th commit on.
    pub fn numbers_from(&self, from: usize) -> Vec<i64> {
        self.lock()
            .committed
            .get(from..)
            .unwrap_or_default()
            .iter()
            .map(|c| c.n)
            .collect()
    }

    /// What it did so far.
    pub fn log(&self) -> Log {
        self.lock().clone()
    }

    /// Waits (polling) until at least `at_least` inserts have committed, for at most
    /// `limit`.
    pub async fn wait_commits(&self, at_least: usize, limit: Duration) -> Result<()> {
        wait_for(
            &format!("{at_least} commits of the writer"),
            limit,
            || async { Ok(self.commits()) },
            |n| *n >= at_least,
        )
        .await
        .map(|_| ())
    }

    /// Stops it (an insert under way ends first) and waits for its task; a panic of the
    /// task goes on in the caller.
    pub async fn stop(&self) {
        let _ = self.stop.send(true);
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task
            && let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    /// Stops it; what it did.
    pub async fn finish(self) -> Log {
        self.stop().await;
        self.log()
    }
}

/// The writer's loop, until `stopped`.
async fn write<F, Fut>(
    connect: F,
    o: Options,
    log: Arc<Mutex<Log>>,
    mut stopped: watch::Receiver<bool>,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<tokio_postgres::Client>>,
{
    let record = || log.lock().unwrap_or_else(|p| p.into_inner());
    let insert = format!("INSERT INTO {} (n) VALUES ($1)", o.table);
    let mut session: Option<tokio_postgres::Client> = None;
    let mut n = o.first - 1;
    while !*stopped.borrow() {
        let Some(client) = session.as_ref().filter(|c| !c.is_closed()) else {
            match open(&connect, &o).await {
                Ok(c) => session = Some(c),
                Err(error) => {
                    record().failed(Failure {
                        n: n + 1,
                        connecting: true,
                        error,
                    });
                    nap(&mut stopped, o.after_failed_connect).await;
                }
            }
            continue;
        };
        n += 1;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&n];
        let simple = format!("INSERT INTO {} (n) VALUES ({n})", o.table);
        let done = async {
            if o.simple_protocol {
                client.batch_execute(&simple).await.map(|()| 1)
            } else {
                client.execute(&insert, &params).await
            }
        };
        let done = match o.insert_timeout {
            Some(limit) => match tokio::time::timeout(limit, done).await {
                Ok(done) => done.map_err(|e| described(&e)),
                Err(_) => Err("INSERT timed out".to_string()),
            },
            None => done.await.map_err(|e| described(&e)),
        };
        match done {
            Ok(_) => {
                record().committed.push(Commit {
                    n,
                    at: Instant::now(),
                    time: Timestamp::now(),
                });
                nap(&mut stopped, o.after_commit).await;
            }
            Err(error) => {
                record().failed(Failure {
                    n,
                    connecting: false,
                    error,
                });
                session = None;
                nap(&mut stopped, o.after_failed_insert).await;
            }
        }
    }
}

/// A failure as text: the server's message and SQLSTATE when it sent one (the error's own
/// text is only "db error").
fn described(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({}: {})", e, db.code().code(), db.message()),
        None => format!("{e:#}"),
    }
}

/// A new session, with the table when asked for; the error as text.
async fn open<F, Fut>(connect: &F, o: &Options) -> Result<tokio_postgres::Client, String>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<tokio_postgres::Client>>,
{
    let client = connect().await.map_err(|e| format!("{e:#}"))?;
    if o.create_table {
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {} (n bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())",
            o.table
        );
        match tokio::time::timeout(Duration::from_secs(10), client.batch_execute(&create)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(described(&e)),
            Err(_) => return Err("CREATE TABLE timed out".into()),
        }
    }
    Ok(client)
}

/// Sleeps `d` (not at all when zero), waking early when the writer must stop.
async fn nap(stopped: &mut watch::Receiver<bool>, d: Duration) {
    if d.is_zero() {
        return;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stopped.changed() => {}
    }
}
