#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! One migration test's world: a namespace, two PostgreSQL servers (source and target) with
//! their admin Secrets, a backup store and the three controllers run with tokens of their own
//! ServiceAccounts; what the tests ask of a Migration; and the writer that keeps inserting
//! numbered rows through a connection Secret while a Database moves.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use dbops_api::{ChosenMode, Database, Migration, MigrationPhase, MigrationStep, StepState};
use k8s_openapi::api::core::v1::Event;
use kube::api::Api;
use serde_json::json;

use crate::controllers::ControllerProcess;
use crate::fixtures::{create_admin_secret, pgbench_database, server_name};
use crate::harness::bed::{Bed, bed};
use crate::harness::object::{InBed, Logged};
use crate::harness::redact::redact;
use crate::jaeger::Jaeger;
use crate::live_writer::{Failure, LiveWriter, Options};
use crate::postgres::PgServer;
use crate::tls::TestCa;

pub const SOURCE_ADMIN: &str = "pg-source-admin";
pub const TARGET_ADMIN: &str = "pg-target-admin";
/// Provisioning, a small dump and restore on a busy 2-core machine.
pub const READY: Duration = Duration::from_secs(120);
/// A whole saga with pgbench data on a busy 2-core machine.
pub const SAGA: Duration = Duration::from_secs(240);
/// The exit code of the migration-controller's `--debug-exit-at`.
pub const DEBUG_EXIT: i32 = 86;

/// One test's world: namespace, two servers, admin Secrets, store, three controllers.
pub struct Setup {
    // Dropped in this order: the controllers first, then PostgreSQL, then the namespace.
    pub migration_controller: Option<ControllerProcess>,
    pub backup_controller: Option<ControllerProcess>,
    pub database_controller: Option<ControllerProcess>,
    pub source: PgServer,
    pub target: PgServer,
    pub b: Bed,
    pub store: tempfile::TempDir,
    /// The backup-controller's `--backup-store`.
    pub store_url: String,
    /// Where the controllers export spans, when the test reads traces.
    pub jaeger: Option<Jaeger>,
    /// Each controller's ServiceAccount kubeconfig.
    pub identities: &'static std::collections::BTreeMap<String, std::path::PathBuf>,
    pub logs: tempfile::TempDir,
}

/// The major of the Logical tests' target: the newest the Debian-built clients here
/// restore into (pg_restore 17 and newer cannot restore into older servers).
pub const LOGICAL_TARGET_MAJOR: u32 = 17;

impl Logged for Setup {
    fn logs_of_all(&self) -> String {
        format!(
            "---- migration-controller log ----\n{}",
            self.log("migration-controller", 12000)
        )
    }
}

impl InBed for Setup {
    fn bed(&self) -> &Bed {
        &self.b
    }
}

impl Setup {
    pub async fn new(prefix: &str) -> Self {
        Self::build(prefix, false, None, &[], None).await
    }

    /// [`Setup::new`] with a target of [`LOGICAL_TARGET_MAJOR`] (a Logical mode's
    /// prerequisite on the target side), the source as in [`Setup::new`].
    pub async fn with_logical_target(prefix: &str) -> Self {
        Self::build(prefix, false, None, &[], Some(LOGICAL_TARGET_MAJOR)).await
    }

    /// [`Setup::new`] with both servers started with these settings (for example
    /// `wal_level=logical`, which lets Verify count before the freeze), the target of
    /// [`LOGICAL_TARGET_MAJOR`]: the Logical mode subscribes only on PostgreSQL 16 and
    /// newer (`LogicalUnsafeBefore16`).
    pub async fn with_source_settings(prefix: &str, settings: &[(&str, &str)]) -> Self {
        Self::build(prefix, false, None, settings, Some(LOGICAL_TARGET_MAJOR)).await
    }

    /// [`Setup::new`] with a real Jaeger that every controller exports its spans to.
    pub async fn traced(prefix: &str) -> Self {
        Self::build(prefix, true, None, &[], None).await
    }

    /// [`Setup::new`] with both servers speaking TLS with a certificate for `localhost`
    /// from `ca`, their DatabaseServers on `localhost` with `verify-full` and the CA, and
    /// every login but the harness's superuser refused without TLS (the admin Secrets hold
    /// the test's admin, [`crate::postgres::AdminKind::for_tests`]).
    pub async fn over_tls(prefix: &str, ca: &TestCa) -> Self {
        Self::build(prefix, false, Some(ca), &[], None).await
    }

    pub async fn build(
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
            Some(major) if !source_settings.is_empty() => {
                PgServer::start_major_with_settings(
                    &format!("{prefix}-dst"),
                    major,
                    source_settings,
                )
                .await
            }
            Some(major) => {
                PgServer::start_major_with_tls(&format!("{prefix}-dst"), major, cert.as_ref()).await
            }
        }
        .unwrap();
        let store = crate::harness::bed::test_dir(prefix, "store");
        let store_url = format!("file://{}", store.path().display());
        let logs = crate::harness::bed::test_dir(prefix, "logs");
        let jaeger = traced.then(|| Jaeger::start(logs.path()).unwrap());
        let identities = crate::harness::bed::controller_identities(b.cp).await;
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

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    /// The admin Secret `name` and its DatabaseServer, for the source or the target.
    pub async fn create_admin_secret(&self, name: &str, source: bool) {
        let pg = if source { &self.source } else { &self.target };
        create_admin_secret(&self.b.client, self.ns(), name, pg)
            .await
            .unwrap();
    }

    /// For [`Setup::over_tls`]: the admin [`AdminKind::for_tests`] names on the source or
    /// the target, its admin Secret, the CA Secret and a `verify-full` DatabaseServer on
    /// `localhost`; then TLS is required of every login but the harness's superuser.
    pub async fn create_tls_admin(&self, name: &str, source: bool, ca: &TestCa) {
        use crate::fixtures::{create_ca_secret, create_secret, create_server, server_spec};
        let pg = if source { &self.source } else { &self.target };
        let (user, password) = pg
            .admin_login(crate::postgres::admin::AdminKind::for_tests())
            .await
            .unwrap();
        let ns = self.ns();
        create_secret(
            &self.b.client,
            ns,
            name,
            &[("username", &user), ("password", &password)],
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
    pub fn server(&self, admin: &str) -> String {
        server_name(self.ns(), admin)
    }

    /// The flags every controller of a test gets.
    pub fn common_args(&self) -> Vec<String> {
        let mut args = crate::harness::bed::watch_args(self.ns(), "5s");
        if let Some(jaeger) = &self.jaeger {
            args.push(format!("--otlp-endpoint={}", jaeger.otlp_endpoint()));
        }
        args
    }

    pub fn start(&self, name: &str, extra: Vec<String>) -> ControllerProcess {
        self.launch(name, extra, ControllerProcess::start)
    }

    /// Starts controller `name` by `how` (`ControllerProcess::start`, …) with its own
    /// identity, the common flags and `extra`; a failure to start panics with the error.
    fn launch(
        &self,
        name: &str,
        extra: Vec<String>,
        how: fn(&str, &Path, &Path, &[String]) -> anyhow::Result<ControllerProcess>,
    ) -> ControllerProcess {
        let kubeconfig = self.identities[name].clone();
        let mut args = self.common_args();
        args.extend(extra);
        how(name, &kubeconfig, self.logs.path(), &args)
            .unwrap_or_else(|e| panic!("starting the {name}: {}", self.redact(&format!("{e:#}"))))
    }

    /// Starts the migration-controller with `extra` flags after the defaults.
    pub fn start_migration_controller(&mut self, extra: &[&str]) {
        let mut args = vec![
            format!("--pg-dump={}", bin("pg_dump")),
            format!("--pg-restore={}", bin("pg_restore")),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        if extra.iter().any(|a| a.starts_with("--debug-exit-at")) {
            // It may reach its exit point before /healthz is first asked.
            let c = self.launch(
                "migration-controller",
                args,
                ControllerProcess::start_expecting_exit,
            );
            self.migration_controller = Some(c);
            return;
        }
        self.migration_controller = Some(self.start("migration-controller", args));
    }

    /// Starts the migration-controller told to exit at `point` (`--debug-exit-at`:
    /// `<Step>:started`, `<Step>:done`, …) and waits ([`SAGA`] at most) for that exit.
    pub fn run_until_exit_at(&mut self, point: &str) {
        self.start_migration_controller(&[&format!("--debug-exit-at={point}")]);
        let code = self.wait_migration_controller_exit(SAGA);
        assert_eq!(code, Some(DEBUG_EXIT), "the process stopped at {point}");
    }

    /// Waits for the migration-controller to exit by itself; returns its exit code.
    pub fn wait_migration_controller_exit(&mut self, timeout: Duration) -> Option<i32> {
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
    pub fn stop_migration_controller(&mut self) {
        crate::controllers::end(
            self.migration_controller.take(),
            "TERM",
            Duration::from_secs(20),
        );
    }

    pub fn log(&self, controller: &str, max_bytes: u64) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        self.redact(&crate::process::log_tail(&path, max_bytes))
    }

    pub fn redact(&self, text: &str) -> String {
        redact(text, [("source", &self.source), ("target", &self.target)])
    }

    pub fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn migrations(&self) -> Api<Migration> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// A Database on the source server, Ready.
    pub async fn create_database(&self, name: &str) -> Database {
        self.create_database_with(name, &[]).await
    }

    /// A Database on the source server with these extensions, Ready.
    pub async fn create_database_with(&self, name: &str, extensions: &[&str]) -> Database {
        self.create_database_spec(name, json!({"extensions": extensions}))
            .await
    }

    /// A Database on the source server with `spec` merged into its spec, Ready.
    pub async fn create_database_spec(&self, name: &str, spec: serde_json::Value) -> Database {
        crate::fixtures::create_provisioned_database(
            &self.b.client,
            self.ns(),
            name,
            SOURCE_ADMIN,
            spec,
            READY,
            || self.log("database-controller", 6000),
        )
        .await
    }

    /// After a rollback: nothing of Database `db` on the target, and the Database on the
    /// source server again.
    pub async fn assert_back_on_source(&self, db: &str) {
        self.target.assert_dropped(db).await;
        let got = self.databases().get(db).await.unwrap();
        assert_eq!(got.spec.server_ref.name, self.server(SOURCE_ADMIN));
    }

    /// The connection Secret's values.
    pub async fn connection(&self, db: &str) -> Conn {
        Conn::of_database(&self.b.client, self.ns(), db)
            .await
            .unwrap()
    }

    /// `pgbench -i -s <scale>` into the Database, as its own role.
    pub async fn pgbench(&self, db: &str, scale: u32) {
        // Whatever the Secret says (verify-full needs its ca.crt as a file): TLS whenever
        // the server offers it.
        let done = pgbench_database(&self.b.client, self.ns(), db, scale, Some("prefer")).await;
        if let Err(e) = done {
            panic!("{}", self.redact(&format!("{e:#}")));
        }
    }

    pub async fn create_migration(&self, name: &str, db: &str, extra: serde_json::Value) {
        crate::fixtures::create_migration(&self.b.client, self.ns(), name, db, TARGET_ADMIN, extra)
            .await
            .unwrap();
    }

    /// Creates Migration `name` of Database `db` (`extra` added to its spec) and waits
    /// ([`SAGA`] at most) for it to reach `phase`.
    pub async fn migrate(
        &self,
        name: &str,
        db: &str,
        extra: serde_json::Value,
        phase: MigrationPhase,
    ) -> Migration {
        self.create_migration(name, db, extra).await;
        self.wait_phase(name, phase, SAGA).await
    }

    /// Approves Migration `name`'s Manual cutover and waits ([`SAGA`] at most) for it to
    /// reach `phase`.
    pub async fn approve(&self, name: &str, phase: MigrationPhase) -> Migration {
        crate::fixtures::approve_migration(&self.migrations(), name)
            .await
            .unwrap();
        self.wait_phase(name, phase, SAGA).await
    }

    pub async fn wait_phase(
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

    pub async fn events_about(&self, kind: &str, name: &str) -> Vec<Event> {
        crate::fixtures::events_about(&self.b.client, self.ns(), kind, name)
            .await
            .unwrap()
    }

    /// Whether the owner role can write to the Database on the source (what an
    /// application would do), creating a probe table if needed.
    pub async fn source_writable(&self, db: &str, c: &Conn) -> Result<(), String> {
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

    pub async fn superuser_scalar_i64(pg: &PgServer, db: &str, sql: &str) -> i64 {
        let client = pg.connect_as_superuser_to(db).await.unwrap();
        crate::postgres::scalar(&client, sql).await
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
pub use crate::fixtures::Connection as Conn;

pub fn bin(name: &str) -> String {
    crate::paths::postgres_bin_dir()
        .unwrap()
        .join(name)
        .display()
        .to_string()
}

pub fn phase_of(m: &Migration) -> Option<MigrationPhase> {
    m.status.as_ref().and_then(|s| s.phase)
}

/// The mode the Migration chose (Dump, Logical), once it did.
pub fn mode_of(m: &Migration) -> Option<ChosenMode> {
    m.status.as_ref().and_then(|s| s.mode)
}

pub use crate::wait::condition;

/// The Migration's `Failed` condition, asserted to be there and for `reason`.
pub fn assert_failed<'a>(
    m: &'a Migration,
    reason: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    let failed = condition(m, "Failed").expect("a Failed condition");
    assert_eq!(failed.reason, reason, "{failed:?}");
    failed
}

/// Asserts that one of `events` has `reason`; the message lists the reasons there are.
pub fn assert_has_event(events: &[Event], reason: &str) {
    assert!(
        events.iter().any(|e| e.reason.as_deref() == Some(reason)),
        "no {reason} Event: {:?}",
        events.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
    );
}

/// Each of `needles` stands in exactly one statement of `ddl` (a server's DDL log).
pub fn assert_each_once(ddl: &[String], needles: &[&str]) {
    for needle in needles {
        let n = ddl.iter().filter(|l| l.contains(needle)).count();
        assert_eq!(n, 1, "{needle}: {ddl:#?}");
    }
}

/// Asserts that `step` of Migration `m` is in `state`.
pub fn assert_step(m: &Migration, step: MigrationStep, state: StepState) {
    assert_eq!(step_state(m, step), Some(state), "{step:?}");
}

pub fn step_state(m: &Migration, step: MigrationStep) -> Option<StepState> {
    m.status
        .as_ref()
        .and_then(|s| s.steps.iter().find(|x| x.name == step))
        .map(|s| s.state)
}

/// The writer: [`LiveWriter`] inserting 1, 2, 3, ... into `writes`, one autocommit
/// statement each, through the connection Secret's values as read at its start (the
/// source), reconnecting after an error, until told to stop. Pacing (1 ms between
/// attempts) keeps it from spinning on refused connections; nothing waits on a sleep.
pub struct Writer(LiveWriter);

impl Writer {
    pub fn start(pg_port: u16, c: Conn) -> Self {
        let connect = move || {
            let mut config = tokio_postgres::Config::new();
            config
                .host(&c.host)
                .port(pg_port)
                .user(&c.user)
                .password(&c.password)
                .dbname(&c.dbname)
                .connect_timeout(Duration::from_secs(5));
            async move { crate::postgres::connect_config(&config).await }
        };
        let pace = Duration::from_millis(1);
        Self(LiveWriter::start(
            connect,
            Options::new("writes").pause(pace).retry(pace),
        ))
    }

    pub fn committed(&self) -> usize {
        self.0.commits()
    }

    /// Waits until at least `at_least` inserts have committed, for at most `limit`.
    pub async fn wait_commits(&self, at_least: usize, limit: Duration) {
        self.0.wait_commits(at_least, limit).await.unwrap();
    }

    /// Stops it: the numbers committed, in order, and the first failed attempt.
    pub async fn finish(self) -> (Vec<i64>, Option<Failure>) {
        let log = self.0.finish().await;
        (log.numbers(), log.first_failure)
    }
}

/// The rows of `writes` in `app` on a server.
pub async fn writes_on(pg: &PgServer) -> BTreeSet<i64> {
    pg.connect_as_superuser_to("app")
        .await
        .unwrap()
        .query("SELECT n FROM writes", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Every write a writer saw committed is among `rows`.
pub fn assert_every_commit_in(committed: &[i64], rows: &BTreeSet<i64>) {
    let committed: BTreeSet<i64> = committed.iter().copied().collect();
    assert!(
        committed.is_subset(rows),
        "{} committed rows missing on the target, first {:?}",
        committed.difference(rows).count(),
        committed.difference(rows).take(10).collect::<Vec<_>>()
    );
}
