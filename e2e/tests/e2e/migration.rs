//! The migration-controller against a real control plane, two real PostgreSQL servers
//! (source and target) and the other two controllers as processes: the saga moves a
//! Database with pgbench data while a writer keeps inserting, without losing a write the
//! writer saw committed; failures at Preflight, Snapshot and after the freeze roll back;
//! a controller killed at every step resumes to Succeeded without repeating DDL; Manual
//! cutover waits for approval; a second Migration of the same Database is refused, and
//! deleting an active Migration rolls it back.
//!
//! Each test has its own namespace, two servers, a backup store and the three controllers
//! (watching only that namespace, resync 5 s, backoff 1 s..5 s). No test prints a
//! password: logs are redacted before they are shown.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dbops_api::{
    Backup, BackupPhase, Database, Migration, MigrationPhase, MigrationStep, StepState,
};
use dbops_e2e::fixtures::approve_migration;
use dbops_e2e::fixtures::{create_admin_secret, pgbench_database, server_name};
use dbops_e2e::jaeger::Jaeger;
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::tls::TestCa;
use dbops_e2e::wait::ObjectView;
use dbops_e2e::wait::{Want, wait_for};
use dbops_e2e::{ControllerProcess, PgServer};
use k8s_openapi::api::core::v1::{Event, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::{Bed, bed};

pub(crate) const SOURCE_ADMIN: &str = "pg-source-admin";
pub(crate) const TARGET_ADMIN: &str = "pg-target-admin";
/// Provisioning, a small dump and restore on a busy 2-core machine.
pub(crate) const READY: Duration = Duration::from_secs(120);
/// A whole saga with pgbench data on a busy 2-core machine.
pub(crate) const SAGA: Duration = Duration::from_secs(240);
/// The exit code of the migration-controller's `--debug-exit-at`.
pub(crate) const DEBUG_EXIT: i32 = 86;

/// One test's world: namespace, two servers, admin Secrets, store, three controllers.
pub(crate) struct Setup {
    // Dropped in this order: the controllers first, then PostgreSQL, then the namespace.
    pub(crate) migration_controller: Option<ControllerProcess>,
    backup_controller: Option<ControllerProcess>,
    database_controller: Option<ControllerProcess>,
    pub(crate) source: PgServer,
    pub(crate) target: PgServer,
    pub(crate) b: Bed,
    store: tempfile::TempDir,
    /// The backup-controller's `--backup-store`.
    store_url: String,
    /// Where the controllers export spans, when the test reads traces.
    jaeger: Option<Jaeger>,
    /// Each controller's ServiceAccount kubeconfig.
    identities: &'static std::collections::BTreeMap<String, std::path::PathBuf>,
    logs: tempfile::TempDir,
}

/// The major of the Logical tests' target: the newest the Debian-built clients here
/// restore into (pg_restore 17 and newer cannot restore into older servers).
pub(crate) const LOGICAL_TARGET_MAJOR: u32 = 17;

impl Setup {
    pub(crate) async fn new(prefix: &str) -> Self {
        Self::build(prefix, false, None, &[], None).await
    }

    /// [`Setup::new`] with a target of [`LOGICAL_TARGET_MAJOR`] (a Logical mode's
    /// prerequisite on the target side), the source as in [`Setup::new`].
    pub(crate) async fn with_logical_target(prefix: &str) -> Self {
        Self::build(prefix, false, None, &[], Some(LOGICAL_TARGET_MAJOR)).await
    }

    /// [`Setup::new`] with a source server started with these settings (for example
    /// `wal_level=logical`), and a target of [`LOGICAL_TARGET_MAJOR`]: the Logical mode
    /// subscribes only on PostgreSQL 16 and newer (`LogicalUnsafeBefore16`).
    pub(crate) async fn with_source_settings(prefix: &str, settings: &[(&str, &str)]) -> Self {
        Self::build(prefix, false, None, settings, Some(LOGICAL_TARGET_MAJOR)).await
    }

    /// [`Setup::new`] with a real Jaeger that every controller exports its spans to.
    async fn traced(prefix: &str) -> Self {
        Self::build(prefix, true, None, &[], None).await
    }

    /// [`Setup::new`] with both servers speaking TLS with a certificate for `localhost`
    /// from `ca`, their DatabaseServers on `localhost` with `verify-full` and the CA, and
    /// every login but the harness's superuser refused without TLS (the admin Secrets hold
    /// a role `dbops_admin` of their own).
    async fn over_tls(prefix: &str, ca: &TestCa) -> Self {
        Self::build(prefix, false, Some(ca), &[], None).await
    }

    async fn build(
        prefix: &str,
        traced: bool,
        tls: Option<&TestCa>,
        source_settings: &[(&str, &str)],
        target_major: Option<u32>,
    ) -> Self {
        let b = bed(prefix).await;
        let cert = tls.map(|ca| {
            ca.server_cert(&["localhost"], &["127.0.0.1".parse().unwrap()])
                .unwrap()
        });
        let source = if source_settings.is_empty() {
            PgServer::start_with_tls(&format!("{prefix}-src"), cert.as_ref()).await
        } else {
            PgServer::start_with_settings(&format!("{prefix}-src"), source_settings).await
        }
        .unwrap();
        let target = match target_major {
            None => PgServer::start_with_tls(&format!("{prefix}-dst"), cert.as_ref()).await,
            Some(major) => {
                PgServer::start_major_with_tls(&format!("{prefix}-dst"), major, cert.as_ref()).await
            }
        }
        .unwrap();
        let store = crate::test_dir(prefix, "store");
        let store_url = format!("file://{}", store.path().display());
        let logs = crate::test_dir(prefix, "logs");
        let jaeger = traced.then(|| Jaeger::start(logs.path()).unwrap());
        let identities = crate::controller_identities(b.cp).await;
        let mut s = Self {
            migration_controller: None,
            backup_controller: None,
            database_controller: None,
            source,
            target,
            b,
            store,
            store_url,
            jaeger,
            identities,
            logs,
        };
        match tls {
            None => {
                s.create_admin_secret(SOURCE_ADMIN, true).await;
                s.create_admin_secret(TARGET_ADMIN, false).await;
            }
            Some(ca) => {
                s.create_tls_admin(SOURCE_ADMIN, true, ca).await;
                s.create_tls_admin(TARGET_ADMIN, false, ca).await;
            }
        }
        // The database-controller reads the store the backup-controller writes.
        let store = format!("--backup-store={}", s.store_url);
        s.database_controller = Some(s.start("database-controller", vec![store]));
        s.backup_controller = Some(s.start(
            "backup-controller",
            vec![
                format!("--backup-store={}", s.store_url),
                format!("--pg-dump={}", bin("pg_dump")),
                "--max-concurrent-backups=2".into(),
            ],
        ));
        s
    }

    pub(crate) fn ns(&self) -> &str {
        self.b.ns.name()
    }

    /// The admin Secret `name` and its DatabaseServer, for the source or the target.
    async fn create_admin_secret(&self, name: &str, source: bool) {
        let pg = if source { &self.source } else { &self.target };
        create_admin_secret(&self.b.client, self.ns(), name, pg)
            .await
            .unwrap();
    }

    /// For [`Setup::over_tls`]: a superuser `dbops_admin` with a random password on the
    /// source or the target, its admin Secret, the CA Secret and a `verify-full`
    /// DatabaseServer on `localhost`; then TLS is required of every login but the harness's.
    async fn create_tls_admin(&self, name: &str, source: bool, ca: &TestCa) {
        use dbops_e2e::fixtures::{create_ca_secret, create_secret, create_server, server_spec};
        let pg = if source { &self.source } else { &self.target };
        let password = rand::distr::SampleString::sample_string(
            &rand::distr::Alphanumeric,
            &mut rand::rng(),
            24,
        );
        pg.connect_as_superuser()
            .await
            .unwrap()
            .batch_execute(&format!(
                "CREATE ROLE dbops_admin LOGIN SUPERUSER PASSWORD {}",
                dbops_e2e::postgres::quote_literal(&password)
            ))
            .await
            .unwrap();
        let ns = self.ns();
        create_secret(
            &self.b.client,
            ns,
            name,
            &[("username", "dbops_admin"), ("password", &password)],
        )
        .await
        .unwrap();
        let ca_secret = format!("{name}-ca");
        create_ca_secret(&self.b.client, ns, &ca_secret, ca.pem())
            .await
            .unwrap();
        let mut spec = server_spec(pg, name);
        spec["host"] = json!("localhost");
        spec["tls"] = json!({"mode": "verify-full", "caSecretRef": {"name": ca_secret}});
        create_server(&self.b.client, ns, &server_name(ns, name), spec)
            .await
            .unwrap();
        pg.require_tls_except_superuser().await.unwrap();
    }

    /// The DatabaseServer of admin Secret `admin` ([`SOURCE_ADMIN`], [`TARGET_ADMIN`]).
    pub(crate) fn server(&self, admin: &str) -> String {
        server_name(self.ns(), admin)
    }

    /// The flags every controller of a test gets.
    fn common_args(&self) -> Vec<String> {
        let mut args = crate::watch_args(self.ns(), "5s");
        if let Some(jaeger) = &self.jaeger {
            args.push(format!("--otlp-endpoint={}", jaeger.otlp_endpoint()));
        }
        args
    }

    fn start(&self, name: &str, extra: Vec<String>) -> ControllerProcess {
        let kubeconfig = self.identities[name].clone();
        let mut args = self.common_args();
        args.extend(extra);
        ControllerProcess::start(name, &kubeconfig, self.logs.path(), &args)
            .unwrap_or_else(|e| panic!("starting the {name}: {}", self.redact(&format!("{e:#}"))))
    }

    /// Starts the migration-controller with `extra` flags after the defaults.
    pub(crate) fn start_migration_controller(&mut self, extra: &[&str]) {
        let mut args = vec![
            format!("--pg-dump={}", bin("pg_dump")),
            format!("--pg-restore={}", bin("pg_restore")),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        if extra.iter().any(|a| a.starts_with("--debug-exit-at")) {
            // It may reach its exit point before /healthz is first asked.
            let kubeconfig = self.identities["migration-controller"].clone();
            let mut all = self.common_args();
            all.extend(args);
            let c = ControllerProcess::start_expecting_exit(
                "migration-controller",
                &kubeconfig,
                self.logs.path(),
                &all,
            )
            .unwrap_or_else(|e| {
                panic!(
                    "starting the migration-controller: {}",
                    self.redact(&format!("{e:#}"))
                )
            });
            self.migration_controller = Some(c);
            return;
        }
        self.migration_controller = Some(self.start("migration-controller", args));
    }

    /// Waits for the migration-controller to exit by itself; returns its exit code.
    pub(crate) fn wait_migration_controller_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut c = self.migration_controller.take().unwrap();
        match c.process.wait_exit(timeout) {
            Ok(status) => status.code(),
            Err(e) => panic!(
                "{e:#}\n---- migration-controller log ----\n{}",
                self.log("migration-controller", 8000)
            ),
        }
    }

    /// SIGTERM, and waits for the exit.
    pub(crate) fn stop_migration_controller(&mut self) {
        if let Some(mut c) = self.migration_controller.take() {
            c.process.signal("TERM").unwrap();
            c.process.wait_exit(Duration::from_secs(20)).unwrap();
        }
    }

    pub(crate) fn log(&self, controller: &str, max_bytes: u64) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        self.redact(&dbops_e2e::process::log_tail(&path, max_bytes))
    }

    pub(crate) fn redact(&self, text: &str) -> String {
        redact_passwords(
            &text
                .replace(self.source.superuser_password(), "<source-password>")
                .replace(self.target.superuser_password(), "<target-password>"),
        )
    }

    pub(crate) fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub(crate) fn migrations(&self) -> Api<Migration> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// A Database on the source server, Ready.
    pub(crate) async fn create_database(&self, name: &str) -> Database {
        self.create_database_with(name, &[]).await
    }

    /// A Database on the source server with these extensions, Ready.
    async fn create_database_with(&self, name: &str, extensions: &[&str]) -> Database {
        self.create_database_spec(name, json!({"extensions": extensions}))
            .await
    }

    /// A Database on the source server with `spec` merged into its spec, Ready.
    async fn create_database_spec(&self, name: &str, spec: serde_json::Value) -> Database {
        dbops_e2e::fixtures::create_database(&self.b.client, self.ns(), name, SOURCE_ADMIN, spec)
            .await
            .unwrap();
        dbops_e2e::wait::database_condition_or_log(
            &self.b.client,
            self.ns(),
            name,
            Want::provisioned(),
            READY,
            || self.log("database-controller", 6000),
        )
        .await
    }

    /// After a rollback: nothing of Database `db` on the target, and the Database on the
    /// source server again.
    async fn assert_back_on_source(&self, db: &str) {
        self.target.assert_dropped(db).await;
        let got = self.databases().get(db).await.unwrap();
        assert_eq!(got.spec.server_ref.name, self.server(SOURCE_ADMIN));
    }

    /// The connection Secret's values.
    pub(crate) async fn connection(&self, db: &str) -> Conn {
        Conn::of_database(&self.b.client, self.ns(), db)
            .await
            .unwrap()
    }

    /// `pgbench -i -s <scale>` into the Database, as its own role.
    async fn pgbench(&self, db: &str, scale: u32) {
        // Whatever the Secret says (verify-full needs its ca.crt as a file): TLS whenever
        // the server offers it.
        let done = pgbench_database(&self.b.client, self.ns(), db, scale, Some("prefer")).await;
        if let Err(e) = done {
            panic!("{}", self.redact(&format!("{e:#}")));
        }
    }

    pub(crate) async fn create_migration(&self, name: &str, db: &str, extra: serde_json::Value) {
        dbops_e2e::fixtures::create_migration(
            &self.b.client,
            self.ns(),
            name,
            db,
            TARGET_ADMIN,
            extra,
        )
        .await
        .unwrap();
    }

    /// Waits for the Migration to satisfy `done`; on timeout the panic shows its status
    /// and the controllers' logs.
    pub(crate) async fn wait_migration(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Migration) -> bool,
    ) -> Migration {
        dbops_e2e::wait::object_or_logs(&self.migrations(), name, what, timeout, done, || {
            format!(
                "---- migration-controller log ----\n{}",
                self.log("migration-controller", 12000)
            )
        })
        .await
    }

    pub(crate) async fn wait_phase(
        &self,
        name: &str,
        phase: MigrationPhase,
        timeout: Duration,
    ) -> Migration {
        self.wait_migration(name, &format!("phase {phase:?}"), timeout, |m| {
            phase_of(m) == Some(phase)
        })
        .await
    }

    pub(crate) async fn events_about(&self, kind: &str, name: &str) -> Vec<Event> {
        dbops_e2e::fixtures::events_about(&self.b.client, self.ns(), kind, name)
            .await
            .unwrap()
    }

    /// Whether the owner role can write to the Database on the source (what an
    /// application would do), creating a probe table if needed.
    async fn source_writable(&self, db: &str, c: &Conn) -> Result<(), String> {
        let client = self
            .source
            .connect(&c.user, &c.password, db)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        client
            .batch_execute("CREATE TABLE IF NOT EXISTS probe (x int); INSERT INTO probe VALUES (1)")
            .await
            .map_err(|e| format!("write: {e}"))
    }

    pub(crate) async fn superuser_scalar_i64(pg: &PgServer, db: &str, sql: &str) -> i64 {
        let client = pg.connect_as_superuser_to(db).await.unwrap();
        client.query_one(sql, &[]).await.unwrap().get(0)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- migration-controller log tail ({}) ----\n{}\n---- database-controller log tail ----\n{}\n---- backup-controller log tail ----\n{}\n---- source postgres log tail ----\n{}\n---- target postgres log tail ----\n{}",
                self.ns(),
                self.log("migration-controller", 12000),
                self.log("database-controller", 4000),
                self.log("backup-controller", 3000),
                self.redact(&self.source.log_tail(3000)),
                self.redact(&self.target.log_tail(3000)),
            );
        }
    }
}

/// What a connection Secret says.
pub(crate) use dbops_e2e::fixtures::Connection as Conn;

fn bin(name: &str) -> String {
    dbops_e2e::paths::postgres_bin_dir()
        .unwrap()
        .join(name)
        .display()
        .to_string()
}

pub(crate) fn phase_of(m: &Migration) -> Option<MigrationPhase> {
    m.status.as_ref().and_then(|s| s.phase)
}

pub(crate) fn condition<'a>(
    m: &'a Migration,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    m.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
}

/// Asserts that one of `events` has `reason`; the message lists the reasons there are.
pub(crate) fn assert_has_event(events: &[Event], reason: &str) {
    assert!(
        events.iter().any(|e| e.reason.as_deref() == Some(reason)),
        "no {reason} Event: {:?}",
        events.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
    );
}

/// Each of `needles` stands in exactly one statement of `ddl` (a server's DDL log).
pub(crate) fn assert_each_once(ddl: &[String], needles: &[&str]) {
    for needle in needles {
        let n = ddl.iter().filter(|l| l.contains(needle)).count();
        assert_eq!(n, 1, "{needle}: {ddl:#?}");
    }
}

/// Asserts that `step` of Migration `m` is in `state`.
pub(crate) fn assert_step(m: &Migration, step: MigrationStep, state: StepState) {
    assert_eq!(step_state(m, step), Some(state), "{step:?}");
}

pub(crate) fn step_state(m: &Migration, step: MigrationStep) -> Option<StepState> {
    m.status
        .as_ref()
        .and_then(|s| s.steps.iter().find(|x| x.name == step))
        .map(|s| s.state)
}

/// The writer: inserts 1, 2, 3, ... one autocommit statement each, through the
/// connection Secret's values as read at its start (the source), reconnecting after an
/// error, until told to stop. Pacing (1 ms between attempts) keeps it from spinning on
/// refused connections; nothing waits on a sleep.
struct Writer {
    committed: Arc<Mutex<Vec<i64>>>,
    /// (number, error) of every attempt that failed.
    failed: Arc<Mutex<Vec<(i64, String)>>>,
    stop: tokio_util_like::Stop,
    task: tokio::task::JoinHandle<()>,
}

/// A tiny stop flag (tokio-util is not a dependency of the e2e crate).
mod tokio_util_like {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Clone, Default)]
    pub struct Stop(Arc<AtomicBool>);

    impl Stop {
        pub fn stop(&self) {
            self.0.store(true, Ordering::Release);
        }
        pub fn stopped(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }
}

impl Writer {
    fn start(pg_port: u16, c: Conn) -> Self {
        let committed = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let stop = tokio_util_like::Stop::default();
        let (com, fail, st) = (committed.clone(), failed.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut client: Option<tokio_postgres::Client> = None;
            let mut n: i64 = 0;
            while !st.stopped() {
                n += 1;
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    let mut config = tokio_postgres::Config::new();
                    config
                        .host(&c.host)
                        .port(pg_port)
                        .user(&c.user)
                        .password(&c.password)
                        .dbname(&c.dbname)
                        .connect_timeout(Duration::from_secs(5));
                    match config.connect(tokio_postgres::NoTls).await {
                        Ok((cl, connection)) => {
                            tokio::spawn(async move {
                                let _ = connection.await;
                            });
                            client = Some(cl);
                        }
                        Err(e) => {
                            fail.lock().unwrap().push((n, format!("connect: {e}")));
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                    }
                }
                let cl = client.as_ref().unwrap();
                match cl
                    .execute("INSERT INTO writes (n) VALUES ($1)", &[&n])
                    .await
                {
                    Ok(_) => com.lock().unwrap().push(n),
                    Err(e) => {
                        fail.lock().unwrap().push((n, format!("insert: {e}")));
                        client = None;
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        Self {
            committed,
            failed,
            stop,
            task,
        }
    }

    fn committed(&self) -> usize {
        self.committed.lock().unwrap().len()
    }

    async fn finish(self) -> (Vec<i64>, Vec<(i64, String)>) {
        self.stop.stop();
        self.task.await.unwrap();
        let committed = self.committed.lock().unwrap().clone();
        let failed = self.failed.lock().unwrap().clone();
        (committed, failed)
    }
}

/// (1) The happy path: pgbench data and a writer inserting numbered rows; the writer is
/// stopped by the freeze (loudly: every later attempt fails), every row it saw committed
/// is on the target, and the Database is Ready there with the same connection Secret.
#[tokio::test]
async fn a_database_moves_with_every_committed_write() {
    let mut s = Setup::new("mig-happy").await;
    s.start_migration_controller(&[]);
    // pgcrypto: an extension the owner does not own (created by the database-controller).
    s.create_database_with("app", &["pgcrypto"]).await;
    s.pgbench("app", 1).await;
    let c = s.connection("app").await;
    let owner = s.source.connect(&c.user, &c.password, "app").await.unwrap();
    owner
        .batch_execute(
            "CREATE TABLE writes (n bigint PRIMARY KEY); \
             CREATE TABLE hashed AS SELECT digest('x', 'sha256') AS h; \
             COMMENT ON TABLE writes IS 'numbered rows'",
        )
        .await
        .unwrap();
    drop(owner);

    let writer = Writer::start(s.source.port(), c.clone());
    wait_for(
        "the writer to commit 50 rows",
        Duration::from_secs(30),
        || async { Ok(writer.committed()) },
        |n| *n >= 50,
    )
    .await
    .unwrap();
    s.create_migration("app-move", "app", json!({})).await;
    let done = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let (committed, failed) = writer.finish().await;

    // The freeze stopped the writer, loudly, and for good.
    let first_failure = failed
        .first()
        .map(|(n, _)| *n)
        .expect("the freeze made writes fail");
    assert!(
        committed.iter().all(|n| *n < first_failure),
        "a write succeeded after the freeze: first failure at {first_failure}, last success {:?}",
        committed.last()
    );
    assert!(committed.len() >= 50);

    // Every committed row is on the target, and nothing the writer did not attempt.
    let target_db = s.target.connect_as_superuser_to("app").await.unwrap();
    let rows: BTreeSet<i64> = target_db
        .query("SELECT n FROM writes", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let committed_set: BTreeSet<i64> = committed.iter().copied().collect();
    assert!(
        committed_set.is_subset(&rows),
        "committed rows missing on the target: {:?}",
        committed_set.difference(&rows).take(10).collect::<Vec<_>>()
    );
    assert!(
        rows.iter().all(|n| *n <= first_failure),
        "the target holds rows never attempted before the freeze"
    );
    let accounts: i64 = target_db
        .query_one("SELECT count(*) FROM pgbench_accounts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(accounts, 100_000);
    let owner_of_table: String = target_db
        .query_one(
            "SELECT tableowner::text FROM pg_tables WHERE tablename = 'pgbench_accounts'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        owner_of_table, c.user,
        "objects belong to the Database's owner role"
    );
    let (hashed, comment): (i64, Option<String>) = {
        let row = target_db
            .query_one(
                "SELECT (SELECT count(*) FROM hashed WHERE h = digest('x', 'sha256')), \
                        obj_description('writes'::regclass, 'pg_class')",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        hashed, 1,
        "pgcrypto works on the target and the data matches"
    );
    assert_eq!(
        comment.as_deref(),
        Some("numbered rows"),
        "comments are copied"
    );

    // Every step Succeeded with times; the snapshot Backup Completed.
    let status = done.status.clone().unwrap();
    assert_eq!(status.steps.len(), 8);
    for step in &status.steps {
        assert_eq!(step.state, StepState::Succeeded, "{step:?}");
        assert!(
            step.started_at.is_some() && step.finished_at.is_some(),
            "{step:?}"
        );
    }
    assert!(condition(&done, "Ready").is_some_and(|c| c.status == "True"));
    let snapshot = status.snapshot_ref.clone().unwrap().name;
    let backup = Api::<Backup>::namespaced(s.b.client.clone(), s.ns())
        .get(&snapshot)
        .await
        .unwrap();
    assert_eq!(
        backup.status.as_ref().and_then(|b| b.phase),
        Some(BackupPhase::Completed)
    );

    // The Database is Ready on the target at the switched generation; the Secret (same
    // name) points there and works.
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(
        status.source_server.as_ref().map(|r| r.name.as_str()),
        Some(s.server(SOURCE_ADMIN).as_str()),
        "Preflight recorded the source server"
    );
    let db_status = db.status.clone().unwrap();
    assert!(db_status.observed_generation >= status.switched_generation);
    assert!(dbops_e2e::wait::database_has(
        &db,
        Want::new("Ready", "True", Some("Provisioned"))
    ));
    let after = s.connection("app").await;
    assert_eq!(after.port, s.target.port());
    let app = s
        .target
        .connect(&after.user, &after.password, &after.dbname)
        .await
        .expect("the connection Secret logs in on the target");
    app.execute("INSERT INTO writes (n) VALUES (-1)", &[])
        .await
        .expect("the target is writable for the application");

    // The source is kept frozen (sourceRetention Keep).
    let limit = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT datconnlimit::bigint FROM pg_database WHERE datname = 'app'",
    )
    .await;
    assert_eq!(limit, 0);

    // An Event per step, and the step durations in the metrics.
    let events = s.events_about("Migration", "app-move").await;
    for step in MigrationStep::DUMP {
        assert_has_event(&events, &format!("{}Succeeded", step.as_str()));
    }
    let (_, metrics) = s
        .migration_controller
        .as_ref()
        .unwrap()
        .get("/metrics")
        .unwrap();
    for step in MigrationStep::DUMP {
        let line = format!(
            "dbops_migration_step_duration_seconds_count{{step=\"{}\"}} 1",
            step.as_str()
        );
        assert!(metrics.contains(&line), "no {line} in\n{metrics}");
    }
}

/// (2a) A database of that name already on the target: Preflight fails, nothing is
/// changed anywhere, and the Migration ends RolledBack saying why.
#[tokio::test]
async fn a_name_conflict_on_the_target_fails_preflight_and_changes_nothing() {
    let mut s = Setup::new("mig-conflict").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    let admin = s.target.connect_as_superuser().await.unwrap();
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin
        .batch_execute("COMMENT ON DATABASE app IS 'someone else''s'")
        .await
        .unwrap();
    s.create_migration("app-move", "app", json!({})).await;
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, READY)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::Preflight));
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "NameConflict")
    );
    assert!(
        failed.message.contains("already exists"),
        "{}",
        failed.message
    );
    assert!(status.snapshot_ref.is_none(), "no snapshot was taken");
    assert_step(&m, MigrationStep::Snapshot, StepState::Pending);
    // Nothing changed: the foreign database keeps its comment, no role appeared, the
    // source stays writable.
    assert_eq!(
        s.target.database_comment("app").await.unwrap().as_deref(),
        Some("someone else's")
    );
    assert!(!s.target.role_exists("app").await.unwrap());
    let c = s.connection("app").await;
    s.source_writable("app", &c).await.unwrap();
    assert!(
        m.finalizers().is_empty(),
        "the finalizer is gone at the end"
    );
}

/// (2b) The snapshot Backup fails (the store cannot be written): RolledBack at Snapshot,
/// the source never frozen, the target untouched.
#[tokio::test]
async fn a_failed_snapshot_rolls_back() {
    let mut s = Setup::new("mig-snapfail").await;
    // The store breaks after the controllers started: this namespace's directory in it
    // is a regular file, so the snapshot's dump cannot be written.
    std::fs::write(s.store.path().join(s.ns()), b"not a directory").unwrap();
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-move", "app", json!({})).await;
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::Snapshot));
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "SnapshotFailed", "{failed:?}");
    assert!(status.freeze.is_none(), "the source was never frozen");
    assert_step(&m, MigrationStep::FreezeSource, StepState::Pending);
    let c = s.connection("app").await;
    s.source_writable("app", &c).await.unwrap();
    s.target.assert_dropped("app").await;
    let events = s.events_about("Migration", "app-move").await;
    assert_has_event(&events, "RolledBack");
}

/// (2c) The target goes away after the freeze: ProvisionTarget fails its attempts, the
/// rollback unfreezes exactly what was frozen, and the target (once back) is clean.
#[tokio::test]
async fn the_target_stopped_after_the_freeze_rolls_back_and_unfreezes() {
    let mut s = Setup::new("mig-tgtdown").await;
    s.create_database("app").await;
    let c = s.connection("app").await;
    // Stop right after ProvisionTarget's record says it began, before it touched anything.
    s.start_migration_controller(&["--debug-exit-at=ProvisionTarget:started"]);
    s.create_migration("app-move", "app", json!({})).await;
    let code = s.wait_migration_controller_exit(SAGA);
    assert_eq!(code, Some(DEBUG_EXIT));
    assert!(
        s.source_writable("app", &c).await.is_err(),
        "the source is frozen at this point"
    );
    s.target.stop().unwrap();
    s.start_migration_controller(&["--step-max-attempts=2"]);
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let status = m.status.clone().unwrap();
    assert_eq!(status.failed_step, Some(MigrationStep::ProvisionTarget));
    assert_eq!(condition(&m, "Failed").unwrap().reason, "ServerUnreachable");
    assert_step(&m, MigrationStep::FreezeSource, StepState::Compensated);
    // Exactly what was frozen is undone: the limit and the setting as they were.
    s.source_writable("app", &c).await.unwrap();
    let limit = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT datconnlimit::bigint FROM pg_database WHERE datname = 'app'",
    )
    .await;
    assert_eq!(limit, -1);
    let settings = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = 'app'",
    )
    .await;
    assert_eq!(
        settings, 0,
        "default_transaction_read_only was reset, not set off"
    );
    s.target.start_again().await.unwrap();
    s.target.assert_dropped("app").await;
}

/// (2d) The target goes away after ProvisionTarget created the role and database there:
/// CopyData fails, the rollback unfreezes the source at once although the target's
/// compensation cannot run yet, and completes (target clean) once the target is back.
#[tokio::test]
async fn a_target_down_during_the_copy_holds_up_only_its_own_compensation() {
    let mut s = Setup::new("mig-tgtlate").await;
    s.create_database("app").await;
    let c = s.connection("app").await;
    s.start_migration_controller(&["--debug-exit-at=CopyData:started"]);
    s.create_migration("app-move", "app", json!({})).await;
    assert_eq!(s.wait_migration_controller_exit(SAGA), Some(DEBUG_EXIT));
    assert!(s.target.database_exists("app").await.unwrap());
    s.target.stop().unwrap();
    s.start_migration_controller(&["--step-max-attempts=2", "--breaker-open-for=2s"]);
    let m = s
        .wait_migration(
            "app-move",
            "rolling back with the target's compensation pending",
            SAGA,
            |m| {
                phase_of(m) == Some(MigrationPhase::RollingBack)
                    && step_state(m, MigrationStep::FreezeSource) == Some(StepState::Compensated)
            },
        )
        .await;
    assert_eq!(
        m.status.as_ref().unwrap().failed_step,
        Some(MigrationStep::CopyData)
    );
    assert_eq!(
        step_state(&m, MigrationStep::ProvisionTarget),
        Some(StepState::Succeeded),
        "not compensated while the target is down"
    );
    s.source_writable("app", &c)
        .await
        .expect("the source is writable again while the target is down");

    s.target.start_again().await.unwrap();
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    assert_step(&m, MigrationStep::ProvisionTarget, StepState::Compensated);
    s.assert_back_on_source("app").await;
}

/// (3) The controller exits at every step, after the step's effects and before its record
/// says Succeeded (and at a few step starts); each new process resumes, and in the end
/// the Migration Succeeded with every DDL statement run once.
#[tokio::test]
async fn a_controller_killed_at_every_step_resumes_to_succeeded() {
    let mut s = Setup::new("mig-crash").await;
    s.create_database("app").await;
    s.pgbench("app", 1).await;
    s.create_migration("app-move", "app", json!({"sourceRetention": "Drop"}))
        .await;
    let mut points: Vec<String> = MigrationStep::DUMP
        .iter()
        .map(|step| format!("{}:done", step.as_str()))
        .collect();
    points.insert(4, "CopyData:started".into());
    points.insert(7, "SwitchTraffic:started".into());
    for point in &points {
        s.start_migration_controller(&[&format!("--debug-exit-at={point}")]);
        let code = s.wait_migration_controller_exit(SAGA);
        assert_eq!(code, Some(DEBUG_EXIT), "the process stopped at {point}");
    }
    s.start_migration_controller(&[]);
    let m = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    for step in MigrationStep::DUMP {
        assert_step(&m, step, StepState::Succeeded);
    }
    // Exactly one snapshot, dumped once.
    let backups = Api::<Backup>::namespaced(s.b.client.clone(), s.ns())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(backups.len(), 1);
    assert_eq!(backups[0].status.as_ref().and_then(|b| b.attempts), Some(1));
    // The data is there, once.
    let accounts =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM pgbench_accounts")
            .await;
    assert_eq!(accounts, 100_000);
    // No side effect was repeated: each DDL of the saga ran once.
    let target_ddl = s.target.ddl_statements().unwrap();
    let source_ddl = s.source.ddl_statements().unwrap();
    assert_each_once(
        &target_ddl,
        &[
            "CREATE ROLE \"app\"",
            "CREATE DATABASE \"app\"",
            "CREATE TABLE public.pgbench_accounts",
        ],
    );
    assert_each_once(
        &source_ddl,
        &["CONNECTION LIMIT 0", "DROP DATABASE IF EXISTS \"app\""],
    );
    // sourceRetention Drop: the source database and role are gone; the Database lives on
    // the target.
    s.source.assert_dropped("app").await;
    let c = s.connection("app").await;
    assert_eq!(c.port, s.target.port());
    s.target
        .connect(&c.user, &c.password, &c.dbname)
        .await
        .expect("the Secret logs in on the target");
}

/// (4) Manual cutover: the Migration waits in AwaitingApproval after Verify with the
/// Database untouched; `approved: true` switches it.
#[tokio::test]
async fn a_manual_cutover_waits_for_approval() {
    let mut s = Setup::new("mig-manual").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-move", "app", json!({"cutover": "Manual"}))
        .await;
    let m = s
        .wait_phase("app-move", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    assert_step(&m, MigrationStep::Verify, StepState::Succeeded);
    assert_step(&m, MigrationStep::SwitchTraffic, StepState::Pending);
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(
        db.spec.server_ref.name,
        s.server(SOURCE_ADMIN),
        "not switched yet"
    );
    assert_eq!(s.connection("app").await.port, s.source.port());

    approve_migration(&s.migrations(), "app-move")
        .await
        .unwrap();
    s.wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(s.connection("app").await.port, s.target.port());
}

/// (5) A second Migration of a Database with an active one is refused with a condition;
/// deleting the active one (parked for approval) rolls it back before it goes.
#[tokio::test]
async fn a_second_migration_is_refused_and_a_deleted_one_rolls_back() {
    let mut s = Setup::new("mig-second").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("first", "app", json!({"cutover": "Manual"}))
        .await;
    s.wait_phase("first", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    s.create_migration("second", "app", json!({})).await;
    let second = s.wait_phase("second", MigrationPhase::Failed, READY).await;
    let ready = condition(&second, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "MigrationAlreadyActive")
    );
    assert!(ready.message.contains("first"), "{}", ready.message);
    assert!(
        second.status.as_ref().unwrap().steps.is_empty(),
        "the refused Migration did nothing"
    );
    let first = s.migrations().get("first").await.unwrap();
    assert_eq!(phase_of(&first), Some(MigrationPhase::AwaitingApproval));

    // Deleting the parked Migration rolls it back first: the source is writable again,
    // the target clean, and then the Migration is gone.
    let c = s.connection("app").await;
    assert!(
        s.source_writable("app", &c).await.is_err(),
        "frozen while parked"
    );
    s.migrations()
        .delete("first", &DeleteParams::default())
        .await
        .unwrap();
    let api = s.migrations();
    wait_for(
        "Migration first to be gone",
        SAGA,
        || async { Ok(api.get_opt("first").await?.map(ObjectView)) },
        |m| m.is_none(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", s.log("migration-controller", 8000)));
    s.source_writable("app", &c).await.unwrap();
    s.assert_back_on_source("app").await;
}

/// (6) A whole Migration is one trace in a real Jaeger: the migration-controller's
/// reconciles, the backup-controller's dump of the snapshot Backup, and the
/// database-controller's reconcile after the switch, found through Jaeger's HTTP API by
/// the trace id the Migration carries in `dbops.dev/traceparent`.
#[tokio::test]
async fn a_migration_is_one_trace_across_the_three_controllers() {
    let mut s = Setup::traced("mig-trace").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-move", "app", json!({})).await;
    let m = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let traceparent = m
        .annotations()
        .get("dbops.dev/traceparent")
        .cloned()
        .unwrap_or_else(|| panic!("no dbops.dev/traceparent on the Migration"));
    let trace_id = traceparent.split('-').nth(1).unwrap().to_string();
    let snapshot = Api::<Backup>::namespaced(s.b.client.clone(), s.ns())
        .get("app-move-snapshot")
        .await
        .unwrap();
    assert_eq!(
        snapshot
            .annotations()
            .get("dbops.dev/traceparent")
            .map(|t| t.split('-').nth(1)),
        Some(Some(trace_id.as_str())),
        "the snapshot Backup continues the Migration's trace"
    );

    let services = [
        "dbops-backup-controller",
        "dbops-database-controller",
        "dbops-migration-controller",
    ];
    let jaeger = s.jaeger.as_ref().unwrap();
    // Spans are exported in batches: wait for all three services in the one trace.
    let trace = wait_for(
        "the Migration's trace with spans of all three controllers",
        READY,
        || async { jaeger.trace(&trace_id).map(Some).or_else(|_| Ok(None)) },
        |t| {
            t.as_ref()
                .is_some_and(|t| services.iter().all(|svc| t.services().contains(svc)))
        },
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(trace.services(), services.into());
    let ops = |service: &str, op: &str| {
        trace
            .spans_of(service, op)
            .filter(|sp| sp.tag("object.namespace").as_deref() == Some(s.ns()))
            .count()
    };
    assert!(ops("dbops-migration-controller", "reconcile Migration") >= 3);
    assert!(
        trace
            .spans_of("dbops-backup-controller", "reconcile Backup")
            .any(|sp| sp.tag("object.name").as_deref() == Some("app-move-snapshot")),
        "no reconcile of the snapshot Backup in the trace"
    );
    assert!(
        trace
            .spans_of("dbops-database-controller", "reconcile Database")
            .any(|sp| sp.tag("object.name").as_deref() == Some("app")),
        "no reconcile of the switched Database in the trace"
    );
    // SQL of the saga on both servers is in it, never a password.
    let statements: Vec<String> = trace
        .spans
        .iter()
        .filter_map(|sp| sp.tag("db.statement"))
        .collect();
    assert!(statements.iter().any(|st| st.contains("CREATE DATABASE")));
    for st in &statements {
        assert!(!st.contains("SCRAM-SHA-256$"), "a verifier in a span: {st}");
        assert!(!st.contains(s.source.superuser_password()));
        assert!(!st.contains(s.target.superuser_password()));
    }
}

/// Waits until the Database with `uid` is gone.
async fn wait_database_gone(s: &Setup, name: &str, uid: &str) {
    if let Err(e) = dbops_e2e::wait::deleted(s.databases(), name, uid, SAGA).await {
        panic!(
            "{e:#}:\n{}\n---- database-controller log ----\n{}",
            dbops_e2e::wait::describe_database(&s.databases(), name).await,
            s.log("database-controller", 6000)
        );
    }
}

/// Issue 10, item 3: a Database deleted while its Migration waits for a Manual cutover,
/// then the Migration approved. Before, the Database waited for the Migration and the
/// Migration for the Database (Ready on the target) forever. Now a Migration that has not
/// switched rolls back at once (`DatabaseDeleted`): the source is unfrozen and then
/// dropped by the Database's `deletionPolicy: Delete`, the target is left clean, and
/// neither object is stuck.
#[tokio::test]
async fn deleting_a_database_awaiting_cutover_rolls_its_migration_back() {
    let mut s = Setup::new("mig-del-approve").await;
    s.start_migration_controller(&[]);
    let db = s
        .create_database_spec("app", json!({"deletionPolicy": "Delete"}))
        .await;
    s.create_migration("app-move", "app", json!({"cutover": "Manual"}))
        .await;
    s.wait_phase("app-move", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    s.databases()
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    approve_migration(&s.migrations(), "app-move")
        .await
        .unwrap();
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "DatabaseDeleted", "{}", failed.message);
    wait_database_gone(&s, "app", db.metadata.uid.as_deref().unwrap()).await;
    assert!(
        !s.source.database_exists("app").await.unwrap(),
        "Delete: the source is dropped"
    );
    assert!(
        !s.target.database_exists("app").await.unwrap(),
        "the target is clean"
    );
    assert!(
        !s.target.role_exists("app").await.unwrap(),
        "the target is clean"
    );
}

/// Issue 10, item 3, at every step: the migration-controller stops right after a step's
/// Running record (`--debug-exit-at=<Step>:started`), the Database (deletionPolicy
/// Delete) is deleted, and a new controller process takes over. Before SwitchTraffic has
/// changed the Database's server the Migration rolls back (`DatabaseDeleted`) and the
/// source database is dropped; at Cleanup (switched) it finishes, and the Database's
/// policy drops the database on the target. Both objects end every time.
#[tokio::test]
async fn deleting_a_database_at_any_step_of_its_migration_ends_both() {
    let mut s = Setup::new("mig-del-steps").await;
    for (i, step) in MigrationStep::DUMP.into_iter().enumerate() {
        let name = format!("app{i}");
        let db = s
            .create_database_spec(&name, json!({"deletionPolicy": "Delete"}))
            .await;
        let migration = format!("{name}-move");
        s.create_migration(&migration, &name, json!({})).await;
        let point = format!("{}:started", step.as_str());
        s.start_migration_controller(&[&format!("--debug-exit-at={point}")]);
        let code = s.wait_migration_controller_exit(SAGA);
        assert_eq!(code, Some(DEBUG_EXIT), "the process stopped at {point}");
        s.databases()
            .delete(&name, &DeleteParams::default())
            .await
            .unwrap();
        s.start_migration_controller(&[]);
        let m = s
            .wait_migration(&migration, "an end", SAGA, |m| {
                matches!(
                    phase_of(m),
                    Some(MigrationPhase::RolledBack | MigrationPhase::Succeeded)
                )
            })
            .await;
        wait_database_gone(&s, &name, db.metadata.uid.as_deref().unwrap()).await;
        let switched = step > MigrationStep::SwitchTraffic;
        if switched {
            assert_eq!(
                phase_of(&m),
                Some(MigrationPhase::Succeeded),
                "deleted at {point}"
            );
            assert!(
                !s.target.database_exists(&name).await.unwrap(),
                "deleted at {point}: the policy Delete drops the database where it now lives"
            );
        } else {
            assert_eq!(
                phase_of(&m),
                Some(MigrationPhase::RolledBack),
                "deleted at {point}"
            );
            assert_eq!(
                condition(&m, "Failed").map(|c| c.reason.as_str()),
                Some("DatabaseDeleted"),
                "deleted at {point}"
            );
            assert!(
                !s.source.database_exists(&name).await.unwrap(),
                "deleted at {point}: the source is dropped after the rollback"
            );
            assert!(
                !s.target.database_exists(&name).await.unwrap()
                    && !s.target.role_exists(&name).await.unwrap(),
                "deleted at {point}: the target is clean"
            );
        }
        // Its finalizer is gone too: nothing holds the Migration any more.
        s.wait_migration(&migration, "no finalizer", READY, |m| {
            m.metadata.finalizers.iter().flatten().next().is_none()
        })
        .await;
        s.stop_migration_controller();
    }
}

/// Issue 10, "also found": CopyData decides that an earlier attempt committed by counting
/// user objects in the target database; a schema that belongs to an extension (one
/// ProvisionTarget created) made it skip the copy, and Verify then rolled the Migration
/// back. The controller stops after ProvisionTarget; the target database then gets what
/// such an extension brings, a schema of its own (`ALTER EXTENSION ... ADD SCHEMA`); the
/// next process must still copy every row.
#[tokio::test]
async fn an_extension_schema_on_the_target_does_not_pass_for_copied_data() {
    let mut s = Setup::new("mig-ext-schema").await;
    s.create_database_with("app", &["pgcrypto"]).await;
    s.pgbench("app", 1).await;
    s.create_migration("app-move", "app", json!({})).await;
    s.start_migration_controller(&["--debug-exit-at=ProvisionTarget:done"]);
    assert_eq!(s.wait_migration_controller_exit(SAGA), Some(DEBUG_EXIT));
    let t = s.target.connect_as_superuser_to("app").await.unwrap();
    t.batch_execute("CREATE SCHEMA pgcrypto_own; ALTER EXTENSION pgcrypto ADD SCHEMA pgcrypto_own")
        .await
        .unwrap();
    s.start_migration_controller(&[]);
    let m = s
        .wait_migration("app-move", "an end", SAGA, |m| {
            matches!(
                phase_of(m),
                Some(MigrationPhase::RolledBack | MigrationPhase::Succeeded)
            )
        })
        .await;
    assert_eq!(
        phase_of(&m),
        Some(MigrationPhase::Succeeded),
        "{:?}",
        ObjectView(m.clone())
    );
    let accounts =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM pgbench_accounts")
            .await;
    assert_eq!(accounts, 100_000);
}

/// TLS end to end: with both servers refusing every login without TLS (but the harness's)
/// and `verify-full` against their own CA, a Database is provisioned, backed up (pg_dump
/// reads the CA from a private file), restored (pg_restore likewise) and moved to the other
/// server; the application logs in on the target with the connection Secret alone.
#[tokio::test]
async fn backup_restore_and_migration_work_over_verified_tls() {
    let ca = TestCa::new("dbops-test-ca").unwrap();
    let mut s = Setup::over_tls("mig-tls", &ca).await;
    // The rule is live: a plain TCP login is refused.
    let plain = s.source.connect("dbops_admin", "x", "postgres").await;
    assert!(plain.is_err(), "a plain TCP login must be refused");
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.pgbench("app", 1).await;

    // A Backup over TLS, then a Database restored from it over TLS.
    let backup: Backup = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": "app-tls"},
        "spec": {"databaseRef": {"name": "app"}},
    }))
    .unwrap();
    let backups: Api<Backup> = Api::namespaced(s.b.client.clone(), s.ns());
    backups
        .create(&PostParams::default(), &backup)
        .await
        .unwrap();
    let done = wait_for(
        "Backup app-tls Completed",
        READY,
        || async { Ok(backups.get("app-tls").await?) },
        |b: &Backup| b.status.as_ref().and_then(|st| st.phase) == Some(BackupPhase::Completed),
    )
    .await;
    if let Err(e) = done {
        panic!(
            "{e:#}\n---- backup-controller log ----\n{}",
            s.log("backup-controller", 6000)
        );
    }
    s.create_database_spec(
        "restored",
        json!({"restoreFrom": {"backupRef": {"name": "app-tls"}}}),
    )
    .await;
    let restored = Setup::superuser_scalar_i64(
        &s.source,
        "restored",
        "SELECT count(*) FROM pgbench_accounts",
    )
    .await;
    assert_eq!(restored, 100_000);

    // The Migration, over TLS on both ends.
    s.create_migration("app-move", "app", json!({})).await;
    s.wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let moved =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM pgbench_accounts")
            .await;
    assert_eq!(moved, 100_000);

    // The application on the target: the Secret's keys, its ca.crt as a mounted file.
    assert_eq!(s.connection("app").await.port, s.target.port());
    let secret = Api::<Secret>::namespaced(s.b.client.clone(), s.ns())
        .get("app-connection")
        .await
        .unwrap();
    let data = secret.data.unwrap_or_default();
    let value = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
    assert_eq!(value("sslmode"), "verify-full");
    assert_eq!(value("ca.crt"), ca.pem());
    let mounted = tempfile::tempdir().unwrap();
    std::fs::write(mounted.path().join("ca.crt"), value("ca.crt")).unwrap();
    let out = Command::new(bin("psql"))
        .env_clear()
        .env("PGHOST", value("PGHOST"))
        .env("PGPORT", value("PGPORT"))
        .env("PGUSER", value("PGUSER"))
        .env("PGPASSWORD", value("PGPASSWORD"))
        .env("PGDATABASE", value("PGDATABASE"))
        .env("PGSSLMODE", value("PGSSLMODE"))
        .env("PGSSLROOTCERT", mounted.path().join("ca.crt"))
        .args([
            "-X",
            "-A",
            "-t",
            "-c",
            "SELECT count(*) FROM pgbench_accounts",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the application's verify-full login on the target: {}",
        s.redact(&String::from_utf8_lossy(&out.stderr))
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100000");
}

// ---- Issue 13 groundwork: the Logical mode's Preflight --------------------------------

/// The migration-controller's Logical-mode Preflight, compiled from its source: the
/// controller is a binary without a library target to depend on.
#[path = "../../../migration-controller/src/logical.rs"]
mod logical;

/// Settings that need a restart (`wal_level`, `max_replication_slots`...): written with
/// `ALTER SYSTEM` (postgresql.auto.conf; the harness passes none of them with `-c`), then
/// the server restarted on the same data.
async fn restart_with(pg: &mut PgServer, settings: &[(&str, &str)]) {
    let client = pg.connect_as_superuser().await.unwrap();
    for (name, value) in settings {
        client
            .batch_execute(&format!(
                "ALTER SYSTEM SET {name} = {}",
                dbops_e2e::postgres::quote_literal(value)
            ))
            .await
            .unwrap();
    }
    drop(client);
    pg.stop().unwrap();
    pg.start_again().await.unwrap();
}

/// The Preflight as the controller would run it: the admin's session (a
/// `dbops_shared::postgres::Session`) on the source database.
async fn logical_preflight(pg: &PgServer, dbname: &str) -> Vec<logical::Unmet> {
    use dbops_shared::postgres::{Credentials, Endpoint, Servers};
    let endpoint = Endpoint::new("127.0.0.1", pg.port(), dbops_api::TlsMode::Disable);
    let credentials = Credentials {
        username: "postgres".into(),
        password: pg.superuser_password().into(),
    };
    let session = Servers::new(1, 5, Duration::from_secs(30))
        .connect(&endpoint, &credentials, dbname)
        .await
        .unwrap();
    // A target of 17: what these tests look at is the source.
    let unmet = logical::preflight(&session, 170000, "17").await.unwrap();
    println!(
        "{dbname} on {}: {:?}",
        pg.port(),
        logical::condition(&unmet)
    );
    unmet
}

/// Backends of type walsender on `pg`.
async fn wal_senders(pg: &PgServer) -> i64 {
    pg.connect_as_superuser()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn logical_preflight_names_each_missing_prerequisite() {
    use logical::{Mode, Unmet, auto_mode};
    let (default, logical_server) = tokio::join!(
        PgServer::start("preflight-default"),
        PgServer::start("preflight-logical"),
    );
    let (default, mut pg) = (default.unwrap(), logical_server.unwrap());
    restart_with(
        &mut pg,
        &[
            ("wal_level", "logical"),
            ("max_replication_slots", "1"),
            ("max_wal_senders", "1"),
        ],
    )
    .await;

    // (a) A default server: wal_level replica, and nothing else missing.
    let unmet = logical_preflight(&default, "postgres").await;
    assert_eq!(
        unmet,
        [Unmet::WalLevelNotLogical {
            wal_level: "replica".into()
        }]
    );
    assert!(
        unmet[0]
            .message()
            .contains("ALTER SYSTEM SET wal_level = logical and restart")
    );

    // (b) Tables: no primary key (refused); REPLICA IDENTITY FULL, USING INDEX, a primary
    // key in another schema (accepted); and a large object.
    let admin = pg.connect_as_superuser().await.unwrap();
    for db in ["messy", "clean"] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
    }
    pg.connect_as_superuser_to("messy")
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE keyed (id int PRIMARY KEY); \
             CREATE TABLE no_pk (v text); \
             CREATE TABLE full_identity (v text); \
             ALTER TABLE full_identity REPLICA IDENTITY FULL; \
             CREATE TABLE by_index (id int NOT NULL, v text); \
             CREATE UNIQUE INDEX by_index_id ON by_index (id); \
             ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_id; \
             CREATE SCHEMA other; CREATE TABLE other.keyed (id int PRIMARY KEY); \
             SELECT lo_from_bytea(0, 'a large object')",
        )
        .await
        .unwrap();
    let unmet = logical_preflight(&pg, "messy").await;
    assert_eq!(
        unmet,
        [
            Unmet::TablesWithoutReplicaIdentity {
                tables: vec!["public.no_pk".into()]
            },
            Unmet::LargeObjectsPresent { count: 1 },
        ]
    );
    assert_eq!(
        auto_mode(unmet.clone()),
        Mode::Dump {
            because: unmet.clone()
        }
    );

    // (d) A clean database on the logical server: everything met, Auto picks Logical.
    let clean = pg.connect_as_superuser_to("clean").await.unwrap();
    clean
        .batch_execute("CREATE TABLE keyed (id int PRIMARY KEY, v text)")
        .await
        .unwrap();
    let unmet = logical_preflight(&pg, "clean").await;
    assert_eq!(unmet, []);
    assert_eq!(auto_mode(unmet), Mode::Logical);

    // (c) The only replication slot taken.
    clean
        .query_one(
            "SELECT slot_name::text FROM pg_create_logical_replication_slot('x', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let no_slot = Unmet::NoFreeReplicationSlot { max: 1, in_use: 1 };
    assert_eq!(
        logical_preflight(&pg, "clean").await,
        std::slice::from_ref(&no_slot)
    );

    // (e) The only WAL sender taken too (a physical WAL stream without a slot): both
    // reported at once.
    let wal = tempfile::tempdir().unwrap();
    let mut receiver = tokio::process::Command::new(pg.bin_dir().join("pg_receivewal"))
        .env("PGPASSWORD", pg.superuser_password())
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port().to_string(),
            "-U",
            "postgres",
        ])
        // No --slot: pg_receivewal then streams without one.
        .args(["--no-loop", "--no-password", "-D"])
        .arg(wal.path())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while wal_senders(&pg).await < 1 {
        let exited = receiver.try_wait().unwrap();
        assert!(
            exited.is_none() && std::time::Instant::now() < deadline,
            "pg_receivewal never streamed ({exited:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        logical_preflight(&pg, "clean").await,
        [no_slot, Unmet::NoFreeWalSender { max: 1, active: 1 }]
    );

    // Both given back: the slot dropped, the stream ended; everything met again.
    receiver.kill().await.unwrap();
    while wal_senders(&pg).await > 0 {
        assert!(std::time::Instant::now() < deadline, "the WAL sender stays");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    clean
        .batch_execute("SELECT pg_drop_replication_slot('x')")
        .await
        .unwrap();
    assert_eq!(logical_preflight(&pg, "clean").await, []);
}
