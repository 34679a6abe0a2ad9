//! Leader election (`--leader-elect`) of the database-controller against the real
//! apiserver and PostgreSQL: two replicas, Databases created over time, the leader
//! SIGKILLed twice and SIGTERMed once. The standby takes over within the Lease duration
//! plus a few seconds (measured and printed), only the Lease holder writes (the audit
//! log, one client-certificate identity per replica), SIGTERM releases the Lease and the
//! standby takes it at once, and every Database ends Ready once, with one role and one
//! database each. A leader frozen (SIGSTOP) past its Lease steps down when it runs again,
//! without a write; a leader cut off from the apiserver steps down before its Lease
//! expires, so before any other replica can lead.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::Database;
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::wait::{Want, eventually};
use dbops_e2e::{ControllerProcess, PgServer};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::deploy::start_controller;
use crate::{Bed, bed};

/// The Lease the database-controller holds (in $POD_NAMESPACE: here the test's namespace).
const LEASE: &str = "dbops-database-controller";
/// shared/src/leader.rs: the Lease lasts 15 s.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// What "a few seconds" may add: the standby's wake-up, its forced release of the
/// expired Lease and random wait (up to 1 s), its own acquisition, a loaded machine.
const TAKEOVER_SLACK: Duration = Duration::from_secs(6);
const READY: Duration = Duration::from_secs(90);
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
    b: Bed,
    pg: PgServer,
    logs: tempfile::TempDir,
    replicas: Vec<Replica>,
    databases: Vec<String>,
}

impl Scenario {
    /// A namespace, a PostgreSQL server and its admin Secret; no replica yet.
    async fn new(prefix: &str) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        let secrets: Api<Secret> = Api::namespaced(b.client.clone(), b.ns.name());
        let mut admin = Secret::default();
        admin.metadata.name = Some("pg-admin".into());
        admin.string_data = Some(BTreeMap::from([
            ("username".to_string(), "postgres".to_string()),
            ("password".to_string(), pg.superuser_password().to_string()),
        ]));
        secrets
            .create(&PostParams::default(), &admin)
            .await
            .unwrap();
        Self {
            prefix: prefix.to_string(),
            b,
            pg,
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

    /// The Lease's holder and acquire time, if it is held.
    async fn holder(&self) -> anyhow::Result<Option<(String, Option<Timestamp>)>> {
        let lease = self.leases().get_opt(LEASE).await?;
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
        let args = [
            "--leader-elect".to_string(),
            format!("--watch-namespace={}", self.ns()),
            "--resync-interval=5s".to_string(),
            "--backoff-base=1s".to_string(),
            "--backoff-max=5s".to_string(),
        ];
        let env = [
            ("POD_NAMESPACE", self.ns()),
            ("POD_NAME", identity.as_str()),
        ];
        let process = start_controller(
            "database-controller",
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
            "spec": {"server": {
                "host": self.pg.host(),
                "port": self.pg.port(),
                "adminSecretRef": {"name": "pg-admin"},
                "sslMode": "disable",
            }},
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
            .map(|r| {
                let path = self.logs.path().join(format!("{}.log", r.identity));
                let text = dbops_e2e::process::log_tail(&path, 3000);
                let text = text.replace(self.pg.superuser_password(), "<superuser-password>");
                format!(
                    "---- {} log ----\n{}\n",
                    r.identity,
                    redact_passwords(&text)
                )
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
    let mut writers = 0;
    for r in &s.replicas {
        let writes: Vec<_> =
            s.b.cp
                .audit_writes(&r.identity, Some(s.ns()))
                .unwrap()
                .into_iter()
                .filter(|w| w.resource != "leases")
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
            "{} (leader from {acquired} to {ended}) wrote outside its leadership: {outside:#?}",
            r.identity
        );
    }
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
