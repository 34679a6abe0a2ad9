//! Leader election (`--leader-elect`) of the database-controller against the real
//! apiserver and PostgreSQL: two replicas, Databases created over time, the leader
//! SIGKILLed twice and SIGTERMed once. The standby takes over within the Lease duration
//! plus a few seconds (measured and printed), only the Lease holder writes (the audit
//! log, one client-certificate identity per replica), SIGTERM releases the Lease and the
//! standby takes it at once, and every Database ends Ready once, with one role and one
//! database each. A leader frozen (SIGSTOP) past its Lease steps down when it runs again,
//! without a write; a leader cut off from the apiserver steps down before its Lease
//! expires, so before any other replica can lead.
//!
//! The same for the backup-controller (Backups of pgbench data created over time, the
//! leader killed twice, once mid-dump: one checksummed artifact per Backup, nothing
//! partial) and the migration-controller (two Migrations, the leader killed twice during
//! CopyData: both Succeeded, every DDL statement on the target ran once), each beside single
//! replicas of the controllers it needs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{Backup, BackupPhase, Database, Migration, MigrationPhase, MigrationStep};
use dbops_e2e::fixtures::{create_backup, create_migration, pgbench_database, server_name};
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::wait::{Want, eventually};
use dbops_e2e::{ControllerProcess, PgServer};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::{Bed, bed};
use dbops_e2e::harness::deploy::start_controller;

/// shared/src/leader.rs: the Lease lasts 15 s.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// What "a few seconds" may add: the standby's wake-up, its forced release of the
/// expired Lease and random wait (up to 1 s), its own acquisition, a loaded machine.
const TAKEOVER_SLACK: Duration = Duration::from_secs(6);
const READY: Duration = Duration::from_secs(90);
/// The admin Secret (and DatabaseServer) of the scenario's server.
const ADMIN: &str = "pg-admin";
/// A standby reads the Lease every 2 s (shared/src/leader.rs, STANDBY_POLL) and takes a
/// released Lease over at once: once a SIGTERMed leader has exited (releasing the Lease
/// on its way out), the other replica leads within this.
const TAKEOVER_AFTER_RELEASE: Duration = Duration::from_secs(4);

/// One controller process that ran in this test.
struct Replica {
    /// POD_NAME (the Lease's holder identity) and the user in its client certificate
    /// (the audit log's name for it).
    identity: String,
    process: Option<ControllerProcess>,
    /// When the Lease said it acquired leadership (spec.acquireTime), if it ever did.
    acquired: Option<Timestamp>,
    /// When it was killed or had exited.
    ended: Option<Timestamp>,
}

struct Scenario {
    /// Names this test's replicas (`<prefix>-replica-<n>`): other tests share the apiserver.
    prefix: String,
    /// The controller that runs replicas (`database-controller`, ...): its Lease is
    /// `dbops-<controller>` in $POD_NAMESPACE, here the test's namespace.
    controller: &'static str,
    /// Flags of every replica after the common ones (a store, pg_dump, ...).
    replica_args: Vec<String>,
    /// Other controllers, one process each, without leader election:
    /// (`<prefix>-<controller>`, process).
    singles: Vec<(String, ControllerProcess)>,
    b: Bed,
    pg: PgServer,
    /// A second server (a Migration's target), when the scenario has one.
    target: Option<PgServer>,
    /// The `file://` backup store, when the scenario has one.
    store: Option<tempfile::TempDir>,
    logs: tempfile::TempDir,
    replicas: Vec<Replica>,
    databases: Vec<String>,
}

impl Scenario {
    /// A namespace, a PostgreSQL server, its admin Secret and DatabaseServer; no replica
    /// yet.
    async fn new(prefix: &str) -> Self {
        Self::for_controller(prefix, "database-controller").await
    }

    /// [`Scenario::new`] whose replicas run `dbops-<controller>`.
    async fn for_controller(prefix: &str, controller: &'static str) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        dbops_e2e::fixtures::create_admin_secret(&b.client, b.ns.name(), ADMIN, &pg)
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

    fn ns(&self) -> &str {
        self.b.ns.name()
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// The Lease the replicas compete for.
    fn lease_name(&self) -> String {
        format!("dbops-{}", self.controller)
    }

    /// The Lease's holder and acquire time, if it is held.
    async fn holder(&self) -> anyhow::Result<Option<(String, Option<Timestamp>)>> {
        let lease = self.leases().get_opt(&self.lease_name()).await?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity.map(|h| (h, s.acquire_time.map(|t| t.0)))))
    }

    /// Starts replica number `self.replicas.len()`, which stands by or leads.
    async fn start_replica(&mut self) {
        self.start_replica_via(None).await;
    }

    /// [`Scenario::start_replica`], reaching the apiserver through `server` (a proxy)
    /// when given.
    async fn start_replica_via(&mut self, server: Option<&str>) {
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
    async fn wait_holder(&mut self, i: usize, timeout: Duration) {
        let identity = self.replicas[i].identity.clone();
        let found = dbops_e2e::wait::wait_for(
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
    async fn leader(&mut self) -> usize {
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
    fn standby(&self, leader: usize) -> usize {
        self.replicas
            .iter()
            .enumerate()
            .position(|(i, r)| i != leader && r.process.is_some())
            .expect("a standby runs")
    }

    /// Sends replica `i` a signal (STOP, CONT) and goes on.
    fn signal(&self, i: usize, signal: &str) {
        let process = self.replicas[i].process.as_ref().expect("the replica runs");
        process.process.signal(signal).unwrap();
    }

    /// Signals replica `i` (KILL or TERM) and waits until it exited; returns its status.
    fn stop(&mut self, i: usize, signal: &str) -> std::process::ExitStatus {
        let mut process = self.replicas[i].process.take().expect("the replica runs");
        process.process.signal(signal).unwrap();
        let status = process.process.wait_exit(Duration::from_secs(20)).unwrap();
        self.replicas[i].ended = Some(Timestamp::now());
        status
    }

    async fn create_database(&mut self) -> String {
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

    async fn wait_ready(&self, name: &str) {
        let want = Want::new("Ready", "True", Some("Provisioned"));
        if let Err(e) =
            dbops_e2e::wait::database_condition(&self.b.client, self.ns(), name, want, READY).await
        {
            panic!("{e:#}\n{}", self.logs_text());
        }
    }

    /// Waits until the Provisioned Event of Database `name` exists.
    async fn wait_provisioned_event(&self, name: &str) {
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

    fn logs_text(&self) -> String {
        self.replicas
            .iter()
            .map(|r| r.identity.as_str())
            .chain(self.singles.iter().map(|(identity, _)| identity.as_str()))
            .map(|identity| {
                let path = self.logs.path().join(format!("{identity}.log"));
                let mut text = dbops_e2e::process::log_tail(&path, 3000)
                    .replace(self.pg.superuser_password(), "<superuser-password>");
                if let Some(target) = &self.target {
                    text = text.replace(target.superuser_password(), "<target-password>");
                }
                format!("---- {identity} log ----\n{}\n", redact_passwords(&text))
            })
            .collect()
    }
}

/// Kills (SIGKILL) the leader; the standby must take over within the Lease duration plus
/// a few seconds. A Database created while no replica leads gets Ready. Returns the
/// takeover time.
async fn kill_leader_and_measure_takeover(s: &mut Scenario, round: usize) -> Duration {
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let killed_at = Instant::now();
    s.stop(leader, "KILL");
    let orphan = s.create_database().await;
    s.wait_holder(
        standby,
        LEASE_DURATION + TAKEOVER_SLACK + Duration::from_secs(5),
    )
    .await;
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

#[tokio::test]
async fn a_killed_leader_is_replaced_and_only_the_holder_writes() {
    let mut s = Scenario::new("leader").await;

    // Two replicas: one leads, the other stands by (and says so on /readyz).
    s.start_replica().await;
    s.start_replica().await;
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let first = s.create_database().await;
    s.wait_ready(&first).await;
    let (code, body) = s.replicas[standby]
        .process
        .as_ref()
        .unwrap()
        .get("/readyz")
        .unwrap();
    assert_eq!(code, 200, "a standby is ready: {body}");
    assert!(body.contains("standby"), "{body}");

    // Twice: the leader is SIGKILLed, the standby takes over, a fresh replica stands by.
    let mut takeovers = Vec::new();
    for round in 1..=2 {
        takeovers.push(kill_leader_and_measure_takeover(&mut s, round).await);
        s.start_replica().await;
        let name = s.create_database().await;
        s.wait_ready(&name).await;
    }
    for takeover in &takeovers {
        assert!(
            *takeover <= LEASE_DURATION + TAKEOVER_SLACK,
            "takeover after SIGKILL took {takeover:?}: more than the Lease ({LEASE_DURATION:?}) \
             plus {TAKEOVER_SLACK:?}"
        );
    }

    // SIGTERM: the leader stops cleanly and releases the Lease on its way out.
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let leader_identity = s.replicas[leader].identity.clone();
    let termed_at = Instant::now();
    let status = s.stop(leader, "TERM");
    let stopped_in = termed_at.elapsed();
    assert!(
        status.success(),
        "SIGTERM: exit {status}\n{}",
        s.logs_text()
    );
    let after_exit = s.holder().await.unwrap();
    assert!(
        after_exit
            .as_ref()
            .is_none_or(|(holder, _)| *holder != leader_identity),
        "the Lease still names {leader_identity} after it exited on SIGTERM: {after_exit:?}"
    );
    let released_at = Instant::now();
    s.wait_holder(standby, LEASE_DURATION + TAKEOVER_SLACK)
        .await;
    let takeover = released_at.elapsed();
    println!(
        "leader election: SIGTERM of {leader_identity}: exited after {:.1} s with the Lease \
         released; {} took over {:.1} s after the exit",
        stopped_in.as_secs_f64(),
        s.replicas[standby].identity,
        takeover.as_secs_f64()
    );
    assert!(
        takeover <= TAKEOVER_AFTER_RELEASE,
        "a released Lease was taken over {takeover:?} after the exit, not within \
         {TAKEOVER_AFTER_RELEASE:?}\n{}",
        s.logs_text()
    );
    let last = s.create_database().await;
    s.wait_ready(&last).await;

    // Stop everything before counting, so no write happens while the log is read.
    for i in 0..s.replicas.len() {
        if s.replicas[i].process.is_some() {
            s.stop(i, "TERM");
        }
    }

    // Only the holder wrote: each replica's writes (other than to the Lease) fall between
    // its acquisition of the Lease and its end; a replica that never led wrote nothing.
    let writers = s.assert_only_leaders_wrote();
    assert!(
        writers >= 3,
        "three leaders in turn, each provisioning: {writers} wrote"
    );

    s.assert_each_database_ready_once().await;
}

impl Scenario {
    /// Every Database: Ready, with exactly one role, one database, one Secret create and
    /// one Provisioned Event, whichever replica provisioned it.
    async fn assert_each_database_ready_once(&self) {
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
                dbops_e2e::wait::database_has(&db, Want::new("Ready", "True", Some("Provisioned"))),
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

#[tokio::test]
async fn a_frozen_leader_steps_down_without_a_stale_write() {
    let mut s = Scenario::new("leader-frozen").await;
    s.start_replica().await;
    s.start_replica().await;
    let leader = s.leader().await;
    let standby = s.standby(leader);
    let first = s.create_database().await;
    s.wait_ready(&first).await;
    // The leader is idle once the Event that follows the Ready status is written.
    s.wait_provisioned_event(&first).await;

    // SIGSTOP: the leader neither renews nor notices anything; its Lease expires and the
    // standby takes over and provisions what is created meanwhile.
    let frozen = s.replicas[leader].identity.clone();
    let frozen_at = Timestamp::now();
    let stopped = Instant::now();
    s.signal(leader, "STOP");
    let during = s.create_database().await;
    s.wait_holder(
        standby,
        LEASE_DURATION + TAKEOVER_SLACK + Duration::from_secs(5),
    )
    .await;
    println!(
        "leader election: {frozen} frozen; {} took over after {:.1} s",
        s.replicas[standby].identity,
        stopped.elapsed().as_secs_f64()
    );
    s.wait_ready(&during).await;
    // Work that the frozen replica's watch delivers the moment it runs again.
    let stale = s.create_database().await;

    // SIGCONT: it steps down at once, writes nothing, and leaves the Lease alone.
    let resumed = Instant::now();
    let resumed_at = Timestamp::now();
    s.signal(leader, "CONT");
    let mut process = s.replicas[leader].process.take().unwrap();
    let status = process.process.wait_exit(Duration::from_secs(10)).unwrap();
    s.replicas[leader].ended = Some(Timestamp::now());
    let log = redact_passwords(&process.process.log_tail(4000));
    println!(
        "leader election: {frozen} resumed and exited ({status}) after {:.1} s",
        resumed.elapsed().as_secs_f64()
    );
    assert!(
        !status.success(),
        "a deposed leader exits with an error, to be restarted as a standby:\n{log}"
    );
    // Whichever notices first: the renew deadline, the Lease read, or the Lease manager.
    assert!(
        ["stepping down", "another holder", "lost leadership"]
            .iter()
            .any(|m| log.contains(m)),
        "{log}"
    );
    s.wait_ready(&stale).await;
    let holder = s.holder().await.unwrap().map(|(h, _)| h);
    assert_eq!(holder.as_ref(), Some(&s.replicas[standby].identity));

    // Nothing from the frozen replica after it was frozen: no object, no Event, no Lease.
    let late: Vec<_> =
        s.b.cp
            .audit_writes(&frozen, None)
            .unwrap()
            .into_iter()
            .filter(|w| w.timestamp > frozen_at)
            .collect();
    assert!(
        late.is_empty(),
        "{frozen} (frozen at {frozen_at}, resumed at {resumed_at}) wrote after it was \
         frozen: {late:#?}"
    );

    for i in 0..s.replicas.len() {
        if s.replicas[i].process.is_some() {
            s.stop(i, "TERM");
        }
    }
    s.assert_each_database_ready_once().await;
}

/// A TCP proxy to the apiserver that a test can cut: existing connections are closed and
/// new ones refused, as in a network partition between one replica and the apiserver.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(target_port: u16) -> Self {
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

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// From now on nothing passes.
    fn cut(&self) {
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

// Multi-threaded: the proxy must keep forwarding while the test waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_apiserver_steps_down_before_its_lease_expires() {
    let mut s = Scenario::new("leader-cut").await;
    let apiserver_port: u16 =
        s.b.cp
            .server()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap();
    let proxy = Proxy::start(apiserver_port).await;

    // replica-0 reaches the apiserver through the proxy, and leads; replica-1 stands by.
    s.start_replica_via(Some(&proxy.url())).await;
    s.wait_holder(0, Duration::from_secs(30)).await;
    s.start_replica().await;
    let first = s.create_database().await;
    s.wait_ready(&first).await;
    s.wait_provisioned_event(&first).await;

    // The partition: replica-0 can neither renew its Lease nor learn that it lost it.
    let cut_at = Instant::now();
    proxy.cut();
    let leader = s.replicas[0].process.as_ref().unwrap();
    let stepped_down = dbops_e2e::wait::wait_for(
        "the cut-off leader to stop leading",
        LEASE_DURATION + TAKEOVER_SLACK,
        // A process that has exited (its health server gone) leads no more either.
        || async { Ok(leader.get("/readyz").unwrap_or((0, "exited".to_string()))) },
        |(_, body)| !body.contains("(leader)"),
    )
    .await;
    let stepped_down_at = Timestamp::now();
    let step_down = cut_at.elapsed();
    if let Err(e) = stepped_down {
        panic!("{e:#}\n{}", s.logs_text());
    }
    s.wait_holder(1, LEASE_DURATION + TAKEOVER_SLACK).await;
    let takeover = cut_at.elapsed();
    let (cut_off, standby) = (
        s.replicas[0].identity.clone(),
        s.replicas[1].identity.clone(),
    );
    let acquired = s.replicas[1]
        .acquired
        .expect("replica-1 acquired the Lease");
    println!(
        "leader election: {cut_off} cut off; it stopped leading after {:.1} s, {standby} \
         took over after {:.1} s",
        step_down.as_secs_f64(),
        takeover.as_secs_f64()
    );
    assert!(
        stepped_down_at < acquired,
        "{cut_off} stopped leading at {stepped_down_at}, after {standby} acquired the Lease \
         at {acquired}: two leaders at once\n{}",
        s.logs_text()
    );
    let mut process = s.replicas[0].process.take().unwrap();
    let status = process.process.wait_exit(Duration::from_secs(15)).unwrap();
    s.replicas[0].ended = Some(stepped_down_at);
    assert!(!status.success(), "a deposed leader exits with an error");
    let log = redact_passwords(&process.process.log_tail(4000));
    assert!(log.contains("not renewed in time"), "{log}");

    let last = s.create_database().await;
    s.wait_ready(&last).await;
    s.stop(1, "TERM");
    drop(proxy);
    s.assert_each_database_ready_once().await;
}

// ---------------------------------------------------------------------------------------
// Two replicas of the backup-controller and of the migration-controller (issue 6).

/// A dump of pgbench data, or a saga, on a busy 2-core machine, with a takeover in it.
const WORK: Duration = Duration::from_secs(180);
const TARGET_ADMIN: &str = "pg-target-admin";

impl Scenario {
    /// The flags every controller of a scenario gets: this namespace, quick resync and
    /// backoff.
    fn common_args(&self) -> Vec<String> {
        crate::watch_args(self.ns(), "5s")
    }

    /// Starts one process of `dbops-<controller>` without leader election, identity
    /// `<prefix>-<controller>` (its client certificate's user and its log's name).
    async fn start_single(&mut self, controller: &str, extra: &[String]) {
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
    fn create_store(&mut self) -> String {
        let store = crate::test_dir(&self.prefix, "store");
        let url = format!("file://{}", store.path().display());
        self.store = Some(store);
        url
    }

    /// SIGTERMs every process still running (replicas and singles), so that nothing writes
    /// while the audit log and the store are read.
    fn stop_all(&mut self) {
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
    fn assert_only_leaders_wrote(&self) -> usize {
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
                .filter(|w| w.timestamp < acquired || w.timestamp > ended)
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
    async fn pgbench(&self, db: &str, scale: u32) {
        let done = pgbench_database(&self.b.client, self.ns(), db, scale, None).await;
        if let Err(e) = done {
            panic!("{}", redact_passwords(&format!("{e:#}")));
        }
    }

    fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    fn migrations(&self) -> Api<Migration> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// Backup `name` of Database `db`, not waited for.
    async fn create_backup(&self, name: &str, db: &str) {
        create_backup(&self.b.client, self.ns(), name, db, json!({}))
            .await
            .unwrap();
    }

    /// Waits until Backup `name` satisfies `done`; on timeout the panic shows the logs.
    async fn wait_backup(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Backup) -> bool,
    ) -> Backup {
        dbops_e2e::wait::object_or_logs(&self.backups(), name, what, timeout, done, || {
            self.logs_text()
        })
        .await
    }

    /// Migration `name` of Database `db` to the target server, not waited for.
    async fn create_migration(&self, name: &str, db: &str) {
        assert!(self.target.is_some(), "a Migration needs a target server");
        create_migration(&self.b.client, self.ns(), name, db, TARGET_ADMIN, json!({}))
            .await
            .unwrap();
    }

    /// Waits until Migration `name` satisfies `done`; on timeout the panic shows the logs.
    async fn wait_migration(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Migration) -> bool,
    ) -> Migration {
        dbops_e2e::wait::object_or_logs(&self.migrations(), name, what, timeout, done, || {
            self.logs_text()
        })
        .await
    }
}

fn pg_bin(name: &str) -> PathBuf {
    dbops_e2e::paths::postgres_bin_dir().unwrap().join(name)
}

fn backup_phase(b: &Backup) -> Option<BackupPhase> {
    b.status.as_ref().and_then(|s| s.phase)
}

fn migration_phase(m: &Migration) -> Option<MigrationPhase> {
    m.status.as_ref().and_then(|s| s.phase)
}

fn current_step(m: &Migration) -> Option<MigrationStep> {
    m.status.as_ref().and_then(|s| s.current_step)
}

/// `sha256sum` of a file, hex.
fn sha256_of(path: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// A SIGKILLed leader, the standby expected to replace it, and when.
struct Kill {
    leader: usize,
    standby: usize,
    at: Instant,
}

/// SIGKILLs the current leader.
async fn kill_leader(s: &mut Scenario) -> Kill {
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
async fn await_takeover(s: &mut Scenario, round: usize, kill: Kill) -> Duration {
    s.wait_holder(
        kill.standby,
        LEASE_DURATION + TAKEOVER_SLACK + Duration::from_secs(5),
    )
    .await;
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

fn assert_takeovers_in_time(takeovers: &[Duration]) {
    for takeover in takeovers {
        assert!(
            *takeover <= LEASE_DURATION + TAKEOVER_SLACK,
            "takeover after SIGKILL took {takeover:?}: more than the Lease ({LEASE_DURATION:?}) \
             plus {TAKEOVER_SLACK:?}"
        );
    }
}

/// Two backup-controller replicas while Backups of pgbench data are created over time and
/// the leader is SIGKILLed twice (once mid-dump when the dump is slow enough to be seen):
/// every Backup ends Completed with exactly one artifact and manifest whose checksum
/// matches, nothing partial is left, and each replica wrote only while it led.
#[tokio::test]
async fn two_backup_controllers_survive_two_killed_leaders() {
    let mut s = Scenario::for_controller("leader-backup", "backup-controller").await;
    let store_url = s.create_store();
    s.replica_args = vec![
        format!("--backup-store={store_url}"),
        format!("--pg-dump={}", pg_bin("pg_dump").display()),
    ];
    // The database-controller reads the store the backup-controller writes.
    s.start_single(
        "database-controller",
        &[format!("--backup-store={store_url}")],
    )
    .await;
    let db = s.create_database().await;
    s.wait_ready(&db).await;
    s.pgbench(&db, 5).await;

    s.start_replica().await;
    s.start_replica().await;
    let completed = |b: &Backup| backup_phase(b) == Some(BackupPhase::Completed);
    let mut backups: Vec<String> = Vec::new();
    let first = "snap-0".to_string();
    s.create_backup(&first, &db).await;
    s.wait_backup(&first, "Completed", WORK, completed).await;
    backups.push(first);

    let mut takeovers = Vec::new();
    for round in 1..=2 {
        // A Backup being dumped by the leader when it is killed...
        let busy = format!("snap-{}", backups.len());
        s.create_backup(&busy, &db).await;
        let seen = s
            .wait_backup(&busy, "Running or Completed", WORK, |b| {
                matches!(
                    backup_phase(b),
                    Some(BackupPhase::Running | BackupPhase::Completed)
                )
            })
            .await;
        println!(
            "leader election (backup-controller): SIGKILL {round} with {busy} {:?}",
            backup_phase(&seen)
        );
        backups.push(busy);
        // ...and one created while no replica leads.
        let kill = kill_leader(&mut s).await;
        let orphan = format!("snap-{}", backups.len());
        s.create_backup(&orphan, &db).await;
        backups.push(orphan);
        takeovers.push(await_takeover(&mut s, round, kill).await);
    }
    let last = format!("snap-{}", backups.len());
    s.create_backup(&last, &db).await;
    backups.push(last);
    assert_eq!(backups.len(), 6);

    let mut done = Vec::new();
    for name in &backups {
        done.push(s.wait_backup(name, "Completed", WORK, completed).await);
    }
    s.stop_all();
    assert_takeovers_in_time(&takeovers);

    // The store: exactly an artifact and a manifest per Backup, nothing else (no
    // `.partial`), and checksums that match the files.
    let dir = s.store.as_ref().unwrap().path().join(s.ns());
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let mut expected = Vec::new();
    for b in &done {
        let stem = format!(
            "{}-{}",
            b.metadata.name.as_deref().unwrap(),
            b.metadata.uid.as_deref().unwrap()
        );
        let artifact = dir.join(format!("{stem}.dump"));
        let manifest = dir.join(format!("{stem}.manifest.json"));
        let sum = sha256_of(&artifact);
        let status = b.status.as_ref().unwrap();
        assert_eq!(status.checksum.as_deref(), Some(sum.as_str()), "{stem}");
        assert_eq!(
            status.size_bytes,
            Some(i64::try_from(std::fs::metadata(&artifact).unwrap().len()).unwrap())
        );
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
        assert_eq!(m["checksum"], json!(sum), "{stem}");
        assert_eq!(m["backup"]["uid"], json!(b.metadata.uid), "{stem}");
        expected.push(format!("{stem}.dump"));
        expected.push(format!("{stem}.manifest.json"));
    }
    expected.sort();
    assert_eq!(
        files, expected,
        "exactly one artifact and manifest per Backup"
    );

    let writers = s.assert_only_leaders_wrote();
    assert!(
        writers >= 3,
        "three leaders in turn, each backing up: {writers} wrote"
    );
}

/// Two migration-controller replicas while two Migrations of pgbench data run, started
/// a few seconds apart, and the leader is SIGKILLed twice mid-saga: both Migrations
/// succeed, every DDL statement on the target ran once, the source was frozen once per
/// Database, and each replica wrote only while it led.
#[tokio::test]
async fn two_migration_controllers_survive_two_killed_leaders() {
    let mut s = Scenario::for_controller("leader-mig", "migration-controller").await;
    let target = PgServer::start("leader-mig-dst").await.unwrap();
    dbops_e2e::fixtures::create_admin_secret(&s.b.client, s.ns(), TARGET_ADMIN, &target)
        .await
        .unwrap();
    s.target = Some(target);
    let store_url = s.create_store();
    s.replica_args = vec![
        format!("--pg-dump={}", pg_bin("pg_dump").display()),
        format!("--pg-restore={}", pg_bin("pg_restore").display()),
    ];
    s.start_single(
        "database-controller",
        &[format!("--backup-store={store_url}")],
    )
    .await;
    s.start_single(
        "backup-controller",
        &[
            format!("--backup-store={store_url}"),
            format!("--pg-dump={}", pg_bin("pg_dump").display()),
            "--max-concurrent-backups=2".to_string(),
        ],
    )
    .await;
    // Enough data that CopyData (pg_restore) lasts long enough to be seen and killed.
    let mut dbs = Vec::new();
    for _ in 0..2 {
        let db = s.create_database().await;
        s.wait_ready(&db).await;
        s.pgbench(&db, MIGRATION_PGBENCH_SCALE).await;
        dbs.push(db);
    }

    s.start_replica().await;
    s.start_replica().await;
    s.leader().await;

    let terminal = |m: &Migration| {
        matches!(
            migration_phase(m),
            Some(MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::RolledBack)
        )
    };
    let copying = |m: &Migration| {
        current_step(m).is_some_and(|step| step >= MigrationStep::CopyData) || terminal(m)
    };
    let moves: Vec<String> = dbs.iter().map(|db| format!("{db}-move")).collect();
    let mut takeovers = Vec::new();
    // Round 1: the first Migration is copying data when its leader dies; the second is
    // created a moment later, while no replica leads.
    s.create_migration(&moves[0], &dbs[0]).await;
    for (round, name) in moves.iter().enumerate() {
        let round = round + 1;
        let m = s
            .wait_migration(name, "at CopyData or later", WORK, copying)
            .await;
        assert!(
            !terminal(&m),
            "{name} ended ({:?}) before the leader could be killed during it: use more \
             pgbench data",
            migration_phase(&m)
        );
        println!(
            "leader election (migration-controller): SIGKILL {round} with {name} at {:?}",
            current_step(&m)
        );
        let kill = kill_leader(&mut s).await;
        if round == 1 {
            s.create_migration(&moves[1], &dbs[1]).await;
        }
        takeovers.push(await_takeover(&mut s, round, kill).await);
    }
    for name in &moves {
        let m = s.wait_migration(name, "Succeeded", WORK, terminal).await;
        assert_eq!(
            migration_phase(&m),
            Some(MigrationPhase::Succeeded),
            "{name}: {:?}\n{}",
            m.status,
            s.logs_text()
        );
    }
    s.stop_all();
    assert_takeovers_in_time(&takeovers);

    // Every DDL statement on the target ran once (keyed by user@database and text); the
    // role and the database of each Database were created there once.
    let target = s.target.as_ref().unwrap();
    let target_ddl = target.ddl_statements().unwrap();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for line in &target_ddl {
        *counts.entry(ddl_key(line)).or_default() += 1;
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "DDL run more than once on the target: {repeated:#?}"
    );
    let source_ddl = s.pg.ddl_statements().unwrap();
    for db in &dbs {
        let pg_name = db.replace('-', "_");
        let count = |ddl: &[String], needle: &str| {
            ddl.iter()
                .filter(|l| l.contains(needle) && l.contains(&format!("\"{pg_name}\"")))
                .count()
        };
        assert_eq!(count(&target_ddl, "CREATE ROLE"), 1, "{target_ddl:#?}");
        assert_eq!(count(&target_ddl, "CREATE DATABASE"), 1, "{target_ddl:#?}");
        assert_eq!(
            target_ddl
                .iter()
                .filter(|l| l.contains(&format!("@{pg_name} "))
                    && l.contains("CREATE TABLE public.pgbench_accounts"))
                .count(),
            1,
            "{target_ddl:#?}"
        );
        assert_eq!(
            count(&source_ddl, "CONNECTION LIMIT 0"),
            1,
            "{source_ddl:#?}"
        );
    }

    let writers = s.assert_only_leaders_wrote();
    assert!(
        writers >= 2,
        "the leaders in turn moved the Databases: {writers} wrote"
    );
}

/// pgbench scale of each migrated Database.
const MIGRATION_PGBENCH_SCALE: u32 = 8;

/// A DDL log line as `user@database: statement`: the same statement run again by any
/// session has the same key.
fn ddl_key(line: &str) -> String {
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
