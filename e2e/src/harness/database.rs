#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! One database-controller test's world: a namespace, a PostgreSQL server, its admin Secret
//! and DatabaseServer, and the controller run with a token of its own ServiceAccount
//! `dbops-system/dbops-database-controller` (the RBAC of `deploy/`); and what its tests ask
//! of a Database, a Secret and a login. No password is printed: Secrets are shown by their
//! keys, logs are redacted.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use dbops_api::{Backup, Database, DatabaseServer};
use k8s_openapi::api::core::v1::{Event, Secret};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use crate::controllers::ControllerProcess;
use crate::harness::bed::{Bed, bed};
use crate::harness::redact::redact;
use crate::postgres::PgServer;
use crate::wait::{Want, describe_database, eventually, holds_for};

/// The admin Secret every test creates.
pub use crate::harness::bed::ADMIN_SECRET;

/// The controller's Event reporter (`reportingComponent`).
pub const CONTROLLER_USER: &str = "dbops-database-controller";
pub const FINALIZER: &str = "dbops.dev/database-cleanup";
/// Long enough for provisioning on a busy 2-core machine, short enough to fail usefully.
pub const READY: Duration = Duration::from_secs(60);
/// Resync interval given to the controller.
pub const RESYNC: Duration = Duration::from_secs(3);

pub fn ready() -> Want<'static> {
    Want::provisioned()
}

pub fn not_ready(reason: &'static str) -> Want<'static> {
    Want::not_ready(reason)
}

/// One test's world: namespace, PostgreSQL server, admin Secret, DatabaseServer and
/// controller.
pub struct Setup {
    // Dropped in this order: the controller first, so it does not act on a stopping
    // server; then PostgreSQL; then the namespace.
    pub controller: Option<ControllerProcess>,
    pub pg: PgServer,
    pub b: Bed,
    pub kubeconfig: PathBuf,
    pub extra_args: Vec<String>,
    pub logs: tempfile::TempDir,
}

impl Setup {
    /// A namespace, a PostgreSQL server, the admin Secret and its DatabaseServer, and a
    /// running controller.
    pub async fn new(prefix: &str) -> Self {
        Self::with_args(prefix, &[]).await
    }

    /// [`Setup::new`] with more controller flags.
    pub async fn with_args(prefix: &str, extra_args: &[&str]) -> Self {
        Self::build(prefix, extra_args, None).await
    }

    /// [`Setup::new`] on a PostgreSQL server of major version `major`.
    pub async fn with_major(prefix: &str, major: u32) -> Self {
        Self::build(prefix, &[], Some(major)).await
    }

    pub async fn build(prefix: &str, extra_args: &[&str], major: Option<u32>) -> Self {
        let b = bed(prefix).await;
        let pg = match major {
            Some(major) => PgServer::start_major(prefix, major).await.unwrap(),
            None => PgServer::start(prefix).await.unwrap(),
        };
        let kubeconfig =
            crate::harness::bed::controller_kubeconfig(b.cp, "database-controller").await;
        let mut setup = Self {
            controller: None,
            pg,
            b,
            kubeconfig,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            logs: crate::harness::bed::test_dir(prefix, "logs"),
        };
        let (user, password) = setup
            .pg
            .admin_login(crate::postgres::admin::AdminKind::for_tests())
            .await
            .unwrap();
        setup
            .create_admin_secret(ADMIN_SECRET, Some(&user), Some(&password))
            .await;
        setup.create_server(ADMIN_SECRET, json!({})).await;
        setup.start_controller();
        setup
    }

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    pub fn start_controller(&mut self) {
        let mut args =
            crate::harness::bed::watch_args(self.ns(), &format!("{}s", RESYNC.as_secs()));
        args.extend(self.extra_args.iter().cloned());
        let controller = ControllerProcess::start(
            "database-controller",
            &self.kubeconfig,
            self.logs.path(),
            &args,
        )
        .unwrap_or_else(|e| {
            panic!(
                "starting the database-controller: {}",
                self.redact(&format!("{e:#}"))
            )
        });
        self.controller = Some(controller);
    }

    /// SIGKILL: no chance to finish anything.
    pub fn kill_controller(&mut self) {
        crate::controllers::end(self.controller.take(), "KILL", Duration::from_secs(10));
    }

    pub fn controller(&self) -> &ControllerProcess {
        self.controller.as_ref().expect("the controller runs")
    }

    /// The controller's log (every run of it: the file is appended to), redacted.
    pub fn controller_log(&self, max_bytes: u64) -> String {
        let path = self.logs.path().join("database-controller.log");
        self.redact(&crate::process::log_tail(&path, max_bytes))
    }

    /// The controller's log, unredacted: only for checking it holds no secret.
    pub fn controller_log_raw(&self) -> String {
        let path = self.logs.path().join("database-controller.log");
        std::fs::read_to_string(path).unwrap_or_default()
    }

    pub fn redact(&self, text: &str) -> String {
        redact(text, [("superuser", &self.pg)])
    }

    pub fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// An admin Secret with the given keys.
    pub async fn create_admin_secret(
        &self,
        name: &str,
        username: Option<&str>,
        password: Option<&str>,
    ) {
        let mut data = BTreeMap::new();
        if let Some(u) = username {
            data.insert("username".to_string(), u.to_string());
        }
        if let Some(p) = password {
            data.insert("password".to_string(), p.to_string());
        }
        let mut secret = Secret::default();
        secret.metadata.name = Some(name.to_string());
        secret.string_data = Some(data);
        self.secrets()
            .create(&PostParams::default(), &secret)
            .await
            .unwrap_or_else(|e| panic!("creating Secret {name}: {e}"));
    }

    /// The name of the DatabaseServer made by [`Setup::create_server`] for `admin`.
    pub fn server(&self, admin: &str) -> String {
        crate::fixtures::server_name(self.ns(), admin)
    }

    /// The DatabaseServer [`Setup::server`]`(admin)` on this test's server with admin
    /// Secret `admin` (plain TCP, every namespace allowed); `spec` is merged into its spec
    /// (e.g. `{"port": 1}`).
    pub async fn create_server(&self, admin: &str, spec: serde_json::Value) -> DatabaseServer {
        let mut full = crate::fixtures::server_spec(&self.pg, admin);
        merge(&mut full, spec);
        crate::fixtures::create_server(&self.b.client, self.ns(), &self.server(admin), full)
            .await
            .unwrap()
    }

    /// A Database on the DatabaseServer of the admin Secret; `spec` is merged into the
    /// spec (e.g. `{"deletionPolicy": "Delete"}`, or another `serverRef`).
    pub fn database(&self, name: &str, spec: serde_json::Value) -> Database {
        let mut full = json!({
            "serverRef": {"name": self.server(ADMIN_SECRET)},
        });
        merge(&mut full, spec);
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": {"name": name},
            "spec": full,
        }))
        .unwrap()
    }

    pub async fn create(&self, name: &str, spec: serde_json::Value) -> Database {
        let db = self.database(name, spec);
        self.databases()
            .create(&PostParams::default(), &db)
            .await
            .unwrap_or_else(|e| panic!("creating Database {name}: {e}"))
    }

    /// Waits for a condition; on timeout the panic shows the object and the controller's
    /// log tail.
    pub async fn wait(&self, name: &str, want: Want<'_>, timeout: Duration) -> Database {
        match crate::wait::database_condition(&self.b.client, self.ns(), name, want, timeout).await
        {
            Ok(db) => db,
            Err(e) => panic!(
                "{e:#}\n---- controller log tail ----\n{}",
                self.controller_log(6000)
            ),
        }
    }

    pub async fn wait_ready(&self, name: &str) -> Database {
        self.wait(name, ready(), READY).await
    }

    /// [`Setup::create`], then [`Setup::wait_ready`]: Database `name`, provisioned.
    pub async fn create_ready(&self, name: &str, spec: serde_json::Value) -> Database {
        self.create(name, spec).await;
        self.wait_ready(name).await
    }

    /// Waits for a condition of DatabaseServer `name`; on timeout the panic shows its
    /// status and the controller's log tail.
    pub async fn wait_server(&self, name: &str, want: Want<'_>) -> DatabaseServer {
        match crate::fixtures::server_condition(&self.b.client, name, want, READY).await {
            Ok(server) => server,
            Err(e) => panic!(
                "{e:#}\n---- controller log tail ----\n{}",
                self.controller_log(6000)
            ),
        }
    }

    /// Deletes the Database (foreground is not needed: the controller's finalizer holds it).
    pub async fn delete(&self, name: &str) {
        self.databases()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting Database {name}: {e}"));
    }

    /// Waits until the Database with this uid is gone.
    pub async fn wait_gone(&self, db: &Database, timeout: Duration) {
        let name = db.metadata.name.clone().unwrap();
        let uid = db.metadata.uid.clone().unwrap();
        let waited = crate::wait::deleted(self.databases(), &name, &uid, timeout).await;
        if waited.is_err() {
            panic!(
                "Database {}/{name} still exists after {timeout:?} ({waited:?}):\n{}\n---- controller log tail ----\n{}",
                self.ns(),
                describe_database(&self.databases(), &name).await,
                self.controller_log(6000)
            );
        }
    }

    /// The connection Secret of a Database, waited for.
    pub async fn connection_secret(&self, db_name: &str) -> Secret {
        let secrets = self.secrets();
        let name = format!("{db_name}-connection");
        eventually(
            &format!("Secret {name}"),
            READY,
            || async { Ok(secrets.get_opt(&name).await?.map(SecretView)) },
            |s| s.is_some(),
        )
        .await
        .map(|v| v.0)
        .unwrap()
    }

    /// Core/v1 Events about a Database.
    pub async fn events_for(&self, name: &str) -> Vec<Event> {
        crate::fixtures::events_about(&self.b.client, self.ns(), "Database", name)
            .await
            .unwrap()
    }

    /// Waits until `user` with `password` can log in to `dbname` (a role's password is
    /// set right after the Secret is written, or right before).
    pub async fn wait_login(&self, user: &str, password: &str, dbname: &str, what: &str) {
        eventually(
            what,
            Duration::from_secs(30),
            || async { login(self.pg.port(), user, password, dbname).await },
            |ok| *ok,
        )
        .await;
    }
    /// Waits until the controller's writes settle, then asserts that over two resyncs it
    /// writes nothing to the API and runs no DDL on the server, and that it did look
    /// (at least two reconciles): what converged objects must cost.
    pub async fn assert_quiet(&self) {
        let user = crate::harness::bed::controller_user("database-controller");
        let ns = self.ns().to_string();
        let controller_writes = || self.b.cp.audit_writes(&user, Some(&ns));

        // Settled: no write by the controller for a full resync and a half.
        let settle = RESYNC + RESYNC / 2;
        eventually(
            "the controller's writes to settle",
            READY,
            || async {
                let writes = controller_writes()?;
                let since_last = writes.last().map(|w| {
                    k8s_openapi::jiff::Timestamp::now()
                        .duration_since(w.timestamp)
                        .unsigned_abs()
                });
                // The latest few, for the failure message when they never stop.
                let latest: Vec<String> = writes
                    .iter()
                    .rev()
                    .take(6)
                    .map(ToString::to_string)
                    .collect();
                Ok((writes.len(), since_last, latest))
            },
            |(n, since_last, _)| *n > 0 && since_last.is_some_and(|d| d >= settle),
        )
        .await;

        let writes_before = controller_writes().unwrap().len();
        let ddl_before = self.pg.ddl_statements().unwrap().len();
        let reconciles_before = reconciles(self.controller()).unwrap();
        let window = RESYNC * 2 + Duration::from_secs(1);
        let observed = holds_for(
            "no API write and no DDL by the controller",
            window,
            || async {
                let writes = controller_writes()?;
                let ddl = self.pg.ddl_statements()?;
                Ok((
                    writes[writes_before.min(writes.len())..]
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>(),
                    ddl[ddl_before.min(ddl.len())..].to_vec(),
                ))
            },
            |(writes, ddl)| writes.is_empty() && ddl.is_empty(),
        )
        .await;
        if let Err(e) = observed {
            panic!(
                "{e:#}\n---- controller log tail ----\n{}",
                self.controller_log(4000)
            );
        }
        let reconciles_after = reconciles(self.controller()).unwrap();
        tracing::info!(
            writes_before,
            ddl_before,
            reconciles_before,
            reconciles_after,
            "quiet over {window:?}"
        );
        assert!(
            reconciles_after - reconciles_before >= 2.0,
            "the controller reconciled {} times in {window:?} with resync {RESYNC:?}: the quiet \
             proves nothing if it did not look",
            reconciles_after - reconciles_before
        );
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- database-controller log tail ({}) ----\n{}\n---- postgres log tail ----\n{}",
                self.ns(),
                self.controller_log(8000),
                self.redact(&self.pg.log_tail(4000)),
            );
        }
    }
}

/// A Secret shown by its keys only, for failure messages.
pub struct SecretView(pub Secret);

impl std::fmt::Debug for SecretView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&String> = self.0.data.iter().flat_map(|d| d.keys()).collect();
        write!(
            f,
            "Secret {:?} (uid {:?}) keys {keys:?}",
            self.0.metadata.name, self.0.metadata.uid
        )
    }
}

/// A value of a Secret as text; panics (without values) when the key is missing.
pub fn value(secret: &Secret, key: &str) -> String {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .unwrap_or_else(|| panic!("Secret {:?} has no key {key}", secret.metadata.name));
    String::from_utf8(bytes.0.clone()).unwrap_or_else(|_| panic!("Secret key {key} is not UTF-8"))
}

/// Merges JSON object `patch` into `base`, recursively.
pub fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
    match (base, patch) {
        (serde_json::Value::Object(b), serde_json::Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, p) => *b = p,
    }
}

/// A connection with exactly these parameters (no TLS: the test servers have none).
pub async fn connect(
    host: &str,
    port: u16,
    user: &str,
    password: &str,
    dbname: &str,
) -> Result<tokio_postgres::Client> {
    let mut config = tokio_postgres::Config::new();
    config
        .host(host)
        .port(port)
        .user(user)
        .password(password)
        .dbname(dbname)
        .connect_timeout(Duration::from_secs(5));
    connect_config(&config).await
}

pub use crate::postgres::connect_config;

/// Whether a login works: Ok(false) when the server refuses the password, an error when
/// the server could not be asked.
pub async fn login(port: u16, user: &str, password: &str, dbname: &str) -> Result<bool> {
    match connect("127.0.0.1", port, user, password, dbname).await {
        Ok(_) => Ok(true),
        Err(e) => {
            let refused = e
                .downcast_ref::<tokio_postgres::Error>()
                .and_then(|e| e.code())
                .is_some_and(|code| {
                    *code == tokio_postgres::error::SqlState::INVALID_PASSWORD
                        || *code
                            == tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
                });
            if refused {
                Ok(false)
            } else {
                Err(e).context("trying to log in")
            }
        }
    }
}

/// The sum of `dbops_reconciles_total` over its labels, from the controller's /metrics.
pub fn reconciles(controller: &ControllerProcess) -> Result<f64> {
    let (code, body) = controller.get("/metrics")?;
    anyhow::ensure!(code == 200, "/metrics answered {code}");
    Ok(body
        .lines()
        .filter(|l| l.starts_with("dbops_reconciles_total"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

pub fn has_finalizer(db: &Database) -> bool {
    db.metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|f| f == FINALIZER))
}

pub fn mark(db: &Database) -> String {
    format!("dbops.dev/uid={}", db.metadata.uid.as_deref().unwrap())
}
