#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! Leader election scenarios: two or more replicas of one controller (`--leader-elect`)
//! beside single replicas of the controllers it needs, one PostgreSQL server (a second for a
//! Migration's target), who holds the Lease and who wrote (the audit log names each replica
//! by its client certificate), kills and takeovers measured; and a TCP proxy to the
//! apiserver that a test can cut.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{Backup, BackupPhase, Database, Migration, MigrationPhase, MigrationStep};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::controllers::ControllerProcess;
use crate::fixtures::{create_backup, create_migration, pgbench_database, server_name};
use crate::harness::bed::{Bed, bed};
use crate::harness::deploy::start_controller;
use crate::harness::object::{InBed, Logged};
use crate::harness::redact::redact;
use crate::postgres::PgServer;
use crate::postgres::redact_passwords;
use crate::wait::{Want, eventually};

/// shared/src/leader.rs: the Lease lasts 15 s.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// What "a few seconds" may add: the standby's wake-up, its forced release of the
/// expired Lease and random wait (up to 1 s), its own acquisition, a loaded machine.
pub const TAKEOVER_SLACK: Duration = Duration::from_secs(6);
pub const READY: Duration = Duration::from_secs(90);
/// The admin Secret (and DatabaseServer) of the scenario's server.
pub const ADMIN: &str = "pg-admin";
/// A standby reads the Lease every 2 s (shared/src/leader.rs, STANDBY_POLL) and takes a
/// released Lease over at once: once a SIGTERMed leader has exited (releasing the Lease
/// on its way out), the other replica leads within this.
pub const TAKEOVER_AFTER_RELEASE: Duration = Duration::from_secs(4);

/// One controller process that ran in this test.
pub struct Replica {
    /// POD_NAME (the Lease's holder identity) and the user in its client certificate
    /// (the audit log's name for it).
    pub identity: String,
    pub process: Option<ControllerProcess>,
    /// When the Lease said it acquired leadership (spec.acquireTime), if it ever did.
    pub acquired: Option<Timestamp>,
    /// When it was killed or had exited.
    pub ended: Option<Timestamp>,
}

pub struct Scenario {
    /// Names this test's replicas (`<prefix>-replica-<n>`): other tests share the apiserver.
    pub prefix: String,
    /// The controller that runs replicas (`database-controller`, ...): its Lease is
    /// `dbops-<controller>` in $POD_NAMESPACE, here the test's namespace.
    pub controller: &'static str,
    /// Flags of every replica after the common ones (a store, pg_dump, ...).
    pub replica_args: Vec<String>,
    /// Other controllers, one process each, without leader election:
    /// (`<prefix>-<controller>`, process).
    pub singles: Vec<(String, ControllerProcess)>,
    pub b: Bed,
    pub pg: PgServer,
    /// A second server (a Migration's target), when the scenario has one.
    pub target: Option<PgServer>,
    /// The `file://` backup store, when the scenario has one.
    pub store: Option<tempfile::TempDir>,
    pub logs: tempfile::TempDir,
    pub replicas: Vec<Replica>,
    pub databases: Vec<String>,
}

impl Scenario {
    /// A namespace, a PostgreSQL server, its admin Secret and DatabaseServer; no replica
    /// yet.
    pub async fn new(prefix: &str) -> Self {
        Self::for_controller(prefix, "database-controller").await
    }

    /// [`Scenario::new`] whose replicas run `dbops-<controller>`.
    pub async fn for_controller(prefix: &str, controller: &'static str) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        crate::fixtures::create_admin_secret(&b.client, b.ns.name(), ADMIN, &pg)
            .await
            .unwrap();
        Self {
            prefix: prefix.to_string(),
            controller,
            replica_args: Vec::new(),
            singles: Vec::new(),
            b,
            pg,
            target: None,
            store: None,
            logs: tempfile::tempdir().unwrap(),
            replicas: Vec::new(),
            databases: Vec::new(),
        }
    }

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    pub fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// The Lease the replicas compete for.
    pub fn lease_name(&self) -> String {
        format!("dbops-{}", self.controller)
    }

    /// The Lease's holder and acquire time, if it is held.
    pub async fn holder(&self) -> anyhow::Result<Option<(String, Option<Timestamp>)>> {
        let lease = self.leases().get_opt(&self.lease_name()).await?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity.map(|h| (h, s.acquire_time.map(|t| t.0)))))
    }

    /// Starts replica number `self.replicas.len()`, which stands by or leads.
    pub async fn start_replica(&mut self) {
        self.start_replica_via(None).await;
    }

    /// [`Scenario::start_replica`], reaching the apiserver through `server` (a proxy)
    /// when given.
    pub async fn start_replica_via(&mut self, server: Option<&str>) {
        let identity = format!("{}-replica-{}", self.prefix, self.replicas.len());
        let mut kubeconfig: PathBuf = self
            .b
            .cp
            .kubeconfig_for(&identity, &["system:masters"])
            .unwrap();
        if let Some(server) = server {
            let text = std::fs::read_to_string(&kubeconfig).unwrap();
            kubeconfig = kubeconfig.with_file_name("kubeconfig-via-proxy");
            std::fs::write(&kubeconfig, text.replace(self.b.cp.server(), server)).unwrap();
        }
        let mut args = vec!["--leader-elect".to_string()];
        args.extend(self.common_args());
        args.extend(self.replica_args.iter().cloned());
        let env = [
            ("POD_NAMESPACE", self.ns()),
            ("POD_NAME", identity.as_str()),
        ];
        let process = start_controller(
            self.controller,
            &identity,
            &kubeconfig,
            self.logs.path(),
            &args,
            &env,
        )
        .await
        .unwrap();
        self.replicas.push(Replica {
            identity,
            process: Some(process),
            acquired: None,
            ended: None,
        });
    }

    /// Waits until replica `i` holds the Lease; records when it acquired it.
    /// Waits for replica `i` to take the Lease over from a leader that stopped renewing
    /// it: the Lease's duration, [`TAKEOVER_SLACK`] and 5 s more at most.
    pub async fn wait_takeover_by(&mut self, i: usize) {
        self.wait_holder(i, LEASE_DURATION + TAKEOVER_SLACK + Duration::from_secs(5))
            .await;
    }

    pub async fn wait_holder(&mut self, i: usize, timeout: Duration) {
        let identity = self.replicas[i].identity.clone();
        let found = crate::wait::wait_for(
            &format!("{identity} to hold the Lease"),
            timeout,
            || self.holder(),
            |h| h.as_ref().is_some_and(|(holder, _)| *holder == identity),
        )
        .await;
        match found {
            Ok(Some((_, acquired))) => self.replicas[i].acquired = acquired,
            Ok(None) => unreachable!(),
            Err(e) => panic!("{e:#}\n{}", self.logs_text()),
        }
    }

    /// The running replica that holds the Lease.
    pub async fn leader(&mut self) -> usize {
        let held = eventually(
            "a running replica to hold the Lease",
            LEASE_DURATION + TAKEOVER_SLACK,
            || self.holder(),
            |h| h.is_some(),
        )
        .await;
        let (holder, acquired) = held.unwrap();
        let i = self
            .replicas
            .iter()
            .position(|r| r.identity == holder && r.process.is_some())
            .unwrap_or_else(|| panic!("the Lease is held by {holder}, which does not run"));
        if self.replicas[i].acquired.is_none() {
            self.replicas[i].acquired = acquired;
        }
        i
    }

    /// The other running replica.
    /// Two more replicas: the one that leads and the one that stands by, once the Lease
    /// has a holder.
    pub async fn start_leader_and_standby(&mut self) -> (usize, usize) {
        self.start_replica().await;
        self.start_replica().await;
        let leader = self.leader().await;
        (leader, self.standby(leader))
    }

    pub fn standby(&self, leader: usize) -> usize {
        self.replicas
            .iter()
            .enumerate()
            .position(|(i, r)| i != leader && r.process.is_some())
            .expect("a standby runs")
    }

    /// Sends replica `i` a signal (STOP, CONT) and goes on.
    pub fn signal(&self, i: usize, signal: &str) {
        let process = self.replicas[i].process.as_ref().expect("the replica runs");
        process.process.signal(signal).unwrap();
    }

    /// SIGSTOPs replica `i` and returns once the kernel shows it stopped (state `T`).
    pub fn freeze(&self, i: usize) {
        self.signal(i, "STOP");
        let pid = self.replicas[i]
            .process
            .as_ref()
            .expect("the replica runs")
            .process
            .pid();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // The state follows the command's closing parenthesis.
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next());
            if state == Some("T") || std::time::Instant::now() > deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Signals replica `i` (KILL or TERM) and waits until it exited; returns its status.
    pub fn stop(&mut self, i: usize, signal: &str) -> std::process::ExitStatus {
        let mut process = self.replicas[i].process.take().expect("the replica runs");
        process.process.signal(signal).unwrap();
        let status = process.process.wait_exit(Duration::from_secs(20)).unwrap();
        self.replicas[i].ended = Some(Timestamp::now());
        status
    }

    pub async fn create_database(&mut self) -> String {
        let name = format!("ledger-{}", self.databases.len());
        let db: Database = serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": {"name": name},
            "spec": {"serverRef": {"name": server_name(self.ns(), ADMIN)}},
        }))
        .unwrap();
        Api::<Database>::namespaced(self.b.client.clone(), self.ns())
            .create(&PostParams::default(), &db)
            .await
            .unwrap();
        self.databases.push(name.clone());
        name
    }

    /// [`Scenario::create_database`], then [`Scenario::wait_ready`].
    pub async fn create_ready_database(&mut self) -> String {
        let name = self.create_database().await;
        self.wait_ready(&name).await;
        name
    }

    pub async fn wait_ready(&self, name: &str) {
        let want = Want::provisioned();
        if let Err(e) =
            crate::wait::database_condition(&self.b.client, self.ns(), name, want, READY).await
        {
            panic!("{e:#}\n{}", self.logs_text());
        }
    }

    /// Waits until the Provisioned Event of Database `name` exists.
    pub async fn wait_provisioned_event(&self, name: &str) {
        let events: Api<Event> = Api::namespaced(self.b.client.clone(), self.ns());
        eventually(
            &format!("the Provisioned Event of {name}"),
            Duration::from_secs(30),
            || async { Ok(events.list(&ListParams::default()).await?.items) },
            |items| {
                items.iter().any(|e| {
                    e.reason.as_deref() == Some("Provisioned")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                })
            },
        )
        .await;
    }

    pub fn logs_text(&self) -> String {
        self.replicas
            .iter()
            .map(|r| r.identity.as_str())
            .chain(self.singles.iter().map(|(identity, _)| identity.as_str()))
            .map(|identity| {
                let path = self.logs.path().join(format!("{identity}.log"));
                let tail = crate::process::log_tail(&path, 3000);
                let target = self.target.as_ref().map(|pg| ("target", pg));
                let servers = std::iter::once(("superuser", &self.pg)).chain(target);
                format!("---- {identity} log ----\n{}\n", redact(&tail, servers))
            })
            .collect()
    }
}

/// Kills (SIGKILL) the leader; the standby must take over within the Lease duration plus
/// a few seconds. A Database created while no replica leads gets Ready. Returns the
/// takeover time.
pub async fn kill_leader_and_measure_takeover(s: &mut Scenario, round: usize) -> Duration {
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let killed_at = Instant::now();
    s.stop(leader, "KILL");
    let orphan = s.create_database().await;
    s.wait_takeover_by(standby).await;
    let takeover = killed_at.elapsed();
    println!(
        "leader election: SIGKILL {} of {}: {} took over after {:.1} s",
        round,
        s.replicas[leader].identity,
        s.replicas[standby].identity,
        takeover.as_secs_f64()
    );
    s.wait_ready(&orphan).await;
    takeover
}

impl Scenario {
    /// Every Database: Ready, with exactly one role, one database, one Secret create and
    /// one Provisioned Event, whichever replica provisioned it.
    pub async fn assert_each_database_ready_once(&self) {
        let s = self;
        let n = i64::try_from(s.databases.len()).unwrap();
        assert_eq!(s.pg.count_databases_like("ledger\\_%").await.unwrap(), n);
        assert_eq!(s.pg.count_roles_like("ledger\\_%").await.unwrap(), n);
        // One created connection Secret per Database, across every replica.
        let mut secret_creates = Vec::new();
        for r in &s.replicas {
            for w in s.b.cp.audit_writes(&r.identity, Some(s.ns())).unwrap() {
                if w.resource == "secrets" && w.verb == "create" && w.code == 201 {
                    secret_creates.push(format!("{} by {}", w.name, r.identity));
                }
            }
        }
        assert_eq!(
            secret_creates.len(),
            s.databases.len(),
            "Secret creates: {secret_creates:#?}"
        );
        let events: Api<Event> = Api::namespaced(s.b.client.clone(), s.ns());
        let events = events.list(&ListParams::default()).await.unwrap().items;
        for name in &s.databases {
            let db = Api::<Database>::namespaced(s.b.client.clone(), s.ns())
                .get(name)
                .await
                .unwrap();
            assert!(
                crate::wait::database_has(&db, Want::provisioned()),
                "{name} is not Ready: {:?}",
                db.status
            );
            let provisioned: Vec<_> = events
                .iter()
                .filter(|e| {
                    e.reason.as_deref() == Some("Provisioned")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                })
                .collect();
            assert_eq!(
                provisioned.len(),
                1,
                "{name}: Provisioned Events {provisioned:#?}"
            );
            assert!(
                provisioned[0].series.is_none(),
                "{:?}",
                provisioned[0].series
            );
        }
    }
}

/// A TCP proxy to the apiserver that a test can cut: existing connections are closed and
/// new ones refused, as in a network partition between one replica and the apiserver.
pub struct Proxy {
    pub port: u16,
    pub cut: Arc<AtomicBool>,
    pub connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    pub accept: JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (cut, connections) = (cut.clone(), connections.clone());
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if cut.load(Ordering::SeqCst) {
                        continue; // dropped: the connection is closed at once
                    }
                    let pipe = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(("127.0.0.1", target_port)).await
                        {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    connections.lock().unwrap().push(pipe);
                }
            })
        };
        Self {
            port,
            cut,
            connections,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// From now on nothing passes.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for pipe in self.connections.lock().unwrap().drain(..) {
            pipe.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

// ---------------------------------------------------------------------------------------
// Two replicas of the backup-controller and of the migration-controller (issue 6).

/// A dump of pgbench data, or a saga, on a busy 2-core machine, with a takeover in it.
pub const WORK: Duration = Duration::from_secs(180);
pub const TARGET_ADMIN: &str = "pg-target-admin";

impl Scenario {
    /// The flags every controller of a scenario gets: this namespace, quick resync and
    /// backoff.
    pub fn common_args(&self) -> Vec<String> {
        crate::harness::bed::watch_args(self.ns(), "5s")
    }

    /// Starts one process of `dbops-<controller>` without leader election, identity
    /// `<prefix>-<controller>` (its client certificate's user and its log's name).
    pub async fn start_single(&mut self, controller: &str, extra: &[String]) {
        let identity = format!("{}-{controller}", self.prefix);
        let kubeconfig = self
            .b
            .cp
            .kubeconfig_for(&identity, &["system:masters"])
            .unwrap();
        let mut args = self.common_args();
        args.extend(extra.iter().cloned());
        let process = start_controller(
            controller,
            &identity,
            &kubeconfig,
            self.logs.path(),
            &args,
            &[],
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "starting {identity}: {}",
                redact_passwords(&format!("{e:#}"))
            )
        });
        self.singles.push((identity, process));
    }

    /// A `file://` backup store in a temporary directory; returns its URL.
    pub fn create_store(&mut self) -> String {
        let store = crate::harness::bed::test_dir(&self.prefix, "store");
        let url = format!("file://{}", store.path().display());
        self.store = Some(store);
        url
    }

    /// SIGTERMs every process still running (replicas and singles), so that nothing writes
    /// while the audit log and the store are read.
    pub fn stop_all(&mut self) {
        for i in 0..self.replicas.len() {
            if self.replicas[i].process.is_some() {
                self.stop(i, "TERM");
            }
        }
        for (_, mut process) in self.singles.drain(..) {
            process.process.signal("TERM").unwrap();
            process.process.wait_exit(Duration::from_secs(20)).unwrap();
        }
    }

    /// Only the holder wrote: each replica's writes (other than to the Lease, and the
    /// backup store's registration, which the first replica creates before it joins the
    /// election) fall between its acquisition of the Lease and its end; a replica that
    /// never led wrote nothing. Returns how many replicas wrote. Call once every replica
    /// has stopped.
    pub fn assert_only_leaders_wrote(&self) -> usize {
        let mut writers = 0;
        for r in &self.replicas {
            let writes: Vec<_> = self
                .b
                .cp
                .audit_writes(&r.identity, Some(self.ns()))
                .unwrap()
                .into_iter()
                .filter(|w| w.resource != "leases")
                .filter(|w| !(w.resource == "configmaps" && w.verb == "create"))
                .collect();
            let Some(acquired) = r.acquired else {
                assert!(
                    writes.is_empty(),
                    "{} never led but wrote: {writes:#?}",
                    r.identity
                );
                continue;
            };
            writers += usize::from(!writes.is_empty());
            let ended = r.ended.expect("every replica was stopped");
            let outside: Vec<_> = writes
                .iter()
                .filter(|w| w.received < acquired || w.received > ended)
                .collect();
            assert!(
                outside.is_empty(),
                "{} (leader from {acquired} to {ended}) wrote outside its leadership: \
                 {outside:#?}",
                r.identity
            );
            println!(
                "leader election: {} led from {acquired} to {ended} and wrote {} times",
                r.identity,
                writes.len()
            );
        }
        writers
    }

    /// `pgbench -i -s <scale>` into Database `db`, as its own role (the connection Secret).
    pub async fn pgbench(&self, db: &str, scale: u32) {
        let done = pgbench_database(&self.b.client, self.ns(), db, scale, None).await;
        if let Err(e) = done {
            panic!("{}", redact_passwords(&format!("{e:#}")));
        }
    }

    pub fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn migrations(&self) -> Api<Migration> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// Backup `name` of Database `db`, not waited for.
    pub async fn create_backup(&self, name: &str, db: &str) {
        create_backup(&self.b.client, self.ns(), name, db, json!({}))
            .await
            .unwrap();
    }

    /// Migration `name` of Database `db` to the target server, not waited for.
    pub async fn create_migration(&self, name: &str, db: &str) {
        assert!(self.target.is_some(), "a Migration needs a target server");
        create_migration(&self.b.client, self.ns(), name, db, TARGET_ADMIN, json!({}))
            .await
            .unwrap();
    }
}

impl Logged for Scenario {
    fn logs_of_all(&self) -> String {
        self.logs_text()
    }
}

impl InBed for Scenario {
    fn bed(&self) -> &Bed {
        &self.b
    }
}

pub fn pg_bin(name: &str) -> PathBuf {
    crate::paths::postgres_bin_dir().unwrap().join(name)
}

pub fn backup_phase(b: &Backup) -> Option<BackupPhase> {
    b.status.as_ref().and_then(|s| s.phase)
}

pub fn migration_phase(m: &Migration) -> Option<MigrationPhase> {
    m.status.as_ref().and_then(|s| s.phase)
}

pub fn current_step(m: &Migration) -> Option<MigrationStep> {
    m.status.as_ref().and_then(|s| s.current_step)
}

/// A SIGKILLed leader, the standby expected to replace it, and when.
pub struct Kill {
    pub leader: usize,
    pub standby: usize,
    pub at: Instant,
}

/// SIGKILLs the current leader.
pub async fn kill_leader(s: &mut Scenario) -> Kill {
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let at = Instant::now();
    s.stop(leader, "KILL");
    Kill {
        leader,
        standby,
        at,
    }
}

/// Waits until the standby holds the Lease after `kill`, prints the takeover time, and
/// starts a fresh standby. Returns the takeover time.
pub async fn await_takeover(s: &mut Scenario, round: usize, kill: Kill) -> Duration {
    s.wait_takeover_by(kill.standby).await;
    let takeover = kill.at.elapsed();
    println!(
        "leader election ({}): SIGKILL {round} of {}: {} took over after {:.1} s",
        s.controller,
        s.replicas[kill.leader].identity,
        s.replicas[kill.standby].identity,
        takeover.as_secs_f64()
    );
    s.start_replica().await;
    takeover
}

pub fn assert_takeovers_in_time(takeovers: &[Duration]) {
    for takeover in takeovers {
        assert!(
            *takeover <= LEASE_DURATION + TAKEOVER_SLACK,
            "takeover after SIGKILL took {takeover:?}: more than the Lease ({LEASE_DURATION:?}) \
             plus {TAKEOVER_SLACK:?}"
        );
    }
}

/// pgbench scale of each migrated Database.
pub const MIGRATION_PGBENCH_SCALE: u32 = 8;

/// A DDL log line as `user@database: statement`: the same statement run again by any
/// session has the same key.
pub fn ddl_key(line: &str) -> String {
    let who = line
        .split_once("] ")
        .and_then(|(_, rest)| rest.split(' ').next())
        .unwrap_or("");
    let statement = line
        .split_once("statement: ")
        .map(|(_, s)| s)
        .or_else(|| {
            line.split_once("LOG:  execute ")
                .and_then(|(_, rest)| rest.split_once(": "))
                .map(|(_, s)| s)
        })
        .unwrap_or(line);
    format!("{who}: {statement}")
}
