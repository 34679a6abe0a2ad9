#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! One backup-controller test's world: a namespace, a PostgreSQL server and its admin Secret,
//! a store (`file://` by default, or an S3-compatible server), and both controllers run with
//! tokens of their own ServiceAccounts; and the checks of an artifact against its Backup.
//! Logs are redacted before they are shown.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dbops_api::{Backup, BackupPhase, Database};
use kube::api::Api;
use serde_json::json;

use crate::controllers::ControllerProcess;
use crate::fixtures::{create_admin_secret, pgbench_database};
use crate::harness::bed::{Bed, bed};
use crate::harness::object::{InBed, Logged};
use crate::harness::redact::redact;
use crate::postgres::PgServer;
use crate::s3::S3Server;
use crate::wait::Want;

pub use crate::harness::bed::ADMIN_SECRET;
/// The bucket of the `s3://` store tests.
pub const S3_BUCKET: &str = "dbops-backups";
pub const FINALIZER: &str = "dbops.dev/backup-artifact";
/// Provisioning or a small dump on a busy 2-core machine.
pub const READY: Duration = Duration::from_secs(90);
/// A dump of a few hundred MB of pgbench data on a busy 2-core machine.
pub const BIG_DUMP: Duration = Duration::from_secs(300);

/// An S3 store's server, the backup-controller's `AWS_*` settings, and the log directory.
pub type S3Store = (S3Server, Vec<(String, String)>, tempfile::TempDir);

/// One test's world: namespace, PostgreSQL, admin Secret, store, both controllers.
pub struct Setup {
    // Dropped in this order: the controllers first, then PostgreSQL, then the namespace.
    pub backup_controller: Option<ControllerProcess>,
    pub database_controller: Option<ControllerProcess>,
    /// The S3-compatible server of an `s3://` store ([`Setup::with_s3`]).
    pub s3: Option<S3Server>,
    /// The backup-controller's S3 settings (`AWS_*`); empty for a `file://` store.
    pub s3_env: Vec<(String, String)>,
    pub pg: PgServer,
    pub b: Bed,
    pub store: tempfile::TempDir,
    /// The `--backup-store` URL; `file://<store>` unless a test says otherwise.
    pub store_url: String,
    /// Each controller's ServiceAccount kubeconfig.
    pub identities: &'static BTreeMap<String, PathBuf>,
    /// Flags both controllers get after the common ones (a test sets them, then restarts).
    pub extra_args: Vec<String>,
    /// Flags the backup-controller alone gets after the others (`--verify-server`, ...).
    pub backup_args: Vec<String>,
    /// Both controllers' `--resync-interval` (5s unless a test sets it, then restarts).
    pub resync: &'static str,
    pub logs: tempfile::TempDir,
}

impl Logged for Setup {
    fn logs_of_all(&self) -> String {
        format!(
            "---- backup-controller log ----\n{}",
            self.log("backup-controller", 8000)
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
        Self::build(prefix, None, None).await
    }

    /// [`Setup::new`] with the backup-controller writing to `s3://<S3_BUCKET>/<s3_prefix>`
    /// on an S3-compatible server of this test's own (credentials in its environment).
    /// With `secret_key`, the controller signs with that instead of the server's secret.
    pub async fn with_s3(prefix: &str, s3_prefix: &str, secret_key: Option<&str>) -> Self {
        let logs = crate::harness::bed::test_dir(prefix, "s3-logs");
        let server = S3Server::start("s3s-fs", logs.path()).await.unwrap();
        server.create_bucket(S3_BUCKET).unwrap();
        let mut env = server.env();
        if let Some(wrong) = secret_key {
            for (k, v) in &mut env {
                if k == "AWS_SECRET_ACCESS_KEY" {
                    *v = wrong.to_string();
                }
            }
        }
        let url = format!("s3://{S3_BUCKET}/{s3_prefix}");
        Self::build(
            prefix,
            Some(&move |_: &Path| url.clone()),
            Some((server, env, logs)),
        )
        .await
    }

    pub async fn build(
        prefix: &str,
        store_url: Option<&dyn Fn(&Path) -> String>,
        s3: Option<S3Store>,
    ) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        let store = crate::harness::bed::test_dir(prefix, "store");
        let store_url = match store_url {
            Some(f) => f(store.path()),
            None => format!("file://{}", store.path().display()),
        };
        let (s3, s3_env, logs) = match s3 {
            Some((server, env, logs)) => (Some(server), env, logs),
            None => (None, vec![], crate::harness::bed::test_dir(prefix, "logs")),
        };
        let identities = crate::harness::bed::controller_identities(b.cp).await;
        let mut s = Self {
            backup_controller: None,
            database_controller: None,
            s3,
            s3_env,
            pg,
            b,
            store,
            store_url,
            identities,
            extra_args: Vec::new(),
            backup_args: Vec::new(),
            resync: "5s",
            logs,
        };
        s.create_admin_secret(ADMIN_SECRET).await;
        s.start_database_controller();
        s.start_backup_controller();
        s
    }

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    /// An admin Secret (user postgres with the server's superuser password) and its
    /// DatabaseServer.
    pub async fn create_admin_secret(&self, name: &str) {
        create_admin_secret(&self.b.client, self.ns(), name, &self.pg)
            .await
            .unwrap();
    }

    pub fn common_args(&self) -> Vec<String> {
        let mut args = crate::harness::bed::watch_args(self.ns(), self.resync);
        args.extend(self.extra_args.iter().cloned());
        args
    }

    pub fn start_with_env(
        &self,
        name: &str,
        extra: Vec<String>,
        env: &[(String, String)],
    ) -> ControllerProcess {
        let kubeconfig = self.identities[name].clone();
        let mut args = self.common_args();
        args.extend(extra);
        ControllerProcess::start_with_env(name, &kubeconfig, self.logs.path(), &args, env)
            .unwrap_or_else(|e| panic!("starting the {name}: {}", self.redact(&format!("{e:#}"))))
    }

    /// Controller `name` with the store (and its S3 settings, if any) and `flag` naming
    /// Debian's client program `program` (`pg_dump`, `pg_restore`).
    fn start_with_store(&self, name: &str, flag: &str, program: &str) -> ControllerProcess {
        let path = crate::paths::postgres_bin_dir().unwrap().join(program);
        let extra = vec![
            format!("--backup-store={}", self.store_url),
            format!("{flag}={}", path.display()),
        ];
        self.start_with_env(name, extra, &self.s3_env)
    }

    /// The database-controller, with the same store as the backup-controller.
    pub fn start_database_controller(&mut self) {
        let c = self.start_with_store("database-controller", "--pg-restore", "pg_restore");
        self.database_controller = Some(c);
    }

    /// SIGKILL the database-controller.
    pub fn kill_database_controller(&mut self) {
        kill(&mut self.database_controller);
    }

    /// The backup-controller with the store, Debian's pg_dump and pg_restore (a
    /// verification restores with it), and [`Setup::backup_args`].
    pub fn start_backup_controller(&mut self) {
        let bin = crate::paths::postgres_bin_dir().unwrap();
        let mut extra = vec![
            format!("--backup-store={}", self.store_url),
            format!("--pg-dump={}", bin.join("pg_dump").display()),
            format!("--pg-restore={}", bin.join("pg_restore").display()),
        ];
        extra.extend(self.backup_args.iter().cloned());
        let c = self.start_with_env("backup-controller", extra, &self.s3_env);
        self.backup_controller = Some(c);
    }

    /// A DatabaseServer on this test's PostgreSQL that admits no namespace (what a
    /// verification server must be), with the admin Secret; its name.
    pub async fn create_verify_server(&self) -> String {
        let name = format!("{}-verify", self.ns());
        let spec = crate::fixtures::verify_server_spec(&self.pg, ADMIN_SECRET);
        crate::fixtures::create_server(&self.b.client, self.ns(), &name, spec)
            .await
            .unwrap();
        name
    }

    /// SIGKILL: no chance to finish anything.
    pub fn kill_backup_controller(&mut self) {
        kill(&mut self.backup_controller);
    }

    pub fn log(&self, controller: &str, max_bytes: u64) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        self.redact(&crate::process::log_tail(&path, max_bytes))
    }

    pub fn redact(&self, text: &str) -> String {
        let mut text = text.to_string();
        if let Some(s3) = &self.s3 {
            text = text.replace(s3.secret_key(), "<s3-secret-key>");
        }
        redact(&text, [("superuser", &self.pg)])
    }

    pub fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// A Database on this test's server, Ready; `policy` is its deletionPolicy.
    pub async fn create_database(&self, name: &str, policy: &str) -> Database {
        self.create_database_with(name, policy, ADMIN_SECRET).await;
        self.wait_database_ready(name).await
    }

    /// A Database `name` (deletionPolicy Delete), Ready, with `pgbench -i -s <scale>` data
    /// ([`Setup::pgbench`]).
    pub async fn create_pgbench_database(&self, name: &str, scale: u32) {
        self.create_database(name, "Delete").await;
        self.pgbench(name, scale).await;
    }

    /// A Database using admin Secret `admin`, not waited for.
    pub async fn create_database_with(&self, name: &str, policy: &str, admin: &str) {
        self.create_database_spec(name, admin, json!({"deletionPolicy": policy}))
            .await;
    }

    /// A Database on this test's server with these further spec fields, not waited for.
    pub async fn create_database_spec(&self, name: &str, admin: &str, extra: serde_json::Value) {
        crate::fixtures::create_database(&self.b.client, self.ns(), name, admin, extra)
            .await
            .unwrap();
    }

    /// A Database with extension pgcrypto (created by the controller as the admin), Ready.
    pub async fn create_database_with_pgcrypto(&self, name: &str) {
        let extra = json!({"deletionPolicy": "Delete", "extensions": ["pgcrypto"]});
        self.create_database_spec(name, ADMIN_SECRET, extra).await;
        self.wait_database_ready(name).await;
    }

    /// A Database to be restored from Backup `backup` (`spec.restoreFrom`), not waited for.
    pub async fn create_restored_database(&self, name: &str, backup: &str) {
        let extra = json!({
            "deletionPolicy": "Delete",
            "restoreFrom": {"backupRef": {"name": backup}},
        });
        self.create_database_spec(name, ADMIN_SECRET, extra).await;
    }

    /// Waits for a condition of Database `name`; on timeout the panic shows the
    /// database-controller's log.
    pub async fn wait_database(&self, name: &str, want: Want<'_>, timeout: Duration) -> Database {
        crate::wait::database_condition_or_log(
            &self.b.client,
            self.ns(),
            name,
            want,
            timeout,
            || self.log("database-controller", 6000),
        )
        .await
    }

    /// Every table of the public schema of `database` with its exact row count and owner.
    pub async fn tables(&self, database: &str) -> BTreeMap<String, (i64, String)> {
        let (client, connection) =
            tokio_postgres::connect(&self.pg.conn_string(database), tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(connection);
        let rows = client
            .query(
                "SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'",
                &[],
            )
            .await
            .unwrap();
        let mut tables = BTreeMap::new();
        for row in rows {
            let (table, owner): (String, String) = (row.get(0), row.get(1));
            let count: i64 = client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM public.{}",
                        crate::postgres::quote_ident(&table)
                    ),
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            tables.insert(table, (count, owner));
        }
        tables
    }

    pub async fn wait_database_ready(&self, name: &str) -> Database {
        self.wait_database(name, Want::provisioned(), READY).await
    }

    /// `pgbench -i -s <scale>` into the Database, as its own role (the connection Secret).
    pub async fn pgbench(&self, db: &str, scale: u32) {
        let done = pgbench_database(&self.b.client, self.ns(), db, scale, None).await;
        if let Err(e) = done {
            panic!("{}", self.redact(&format!("{e:#}")));
        }
    }

    pub async fn create_backup(&self, name: &str, db: &str, spec: serde_json::Value) -> Backup {
        crate::fixtures::create_backup(&self.b.client, self.ns(), name, db, spec)
            .await
            .unwrap()
    }

    /// Mid-dump: Running, and pg_dump's output is reaching the store.
    pub async fn wait_mid_dump(&self, name: &str) -> Backup {
        self.wait_backup(name, "Running with output in the store", READY, |b| {
            phase(b) == Some(BackupPhase::Running)
                && (b
                    .status
                    .as_ref()
                    .and_then(|st| st.progress_bytes)
                    .unwrap_or(0)
                    > 0
                    || self
                        .store_files()
                        .iter()
                        .any(|f| f.ends_with(".dump.partial")))
        })
        .await
    }

    pub async fn wait_completed(&self, name: &str, timeout: Duration) -> Backup {
        self.wait_backup(name, "Completed and Ready", timeout, |b| {
            phase(b) == Some(BackupPhase::Completed)
                && has(b, Want::new("Ready", "True", Some("Completed")))
        })
        .await
    }

    /// Writes Secret `name` in the controllers' namespace (the test's) with `key: text`.
    pub async fn put_secret(&self, name: &str, key: &str, text: &str) {
        let secrets: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(self.b.client.clone(), self.ns());
        let secret = serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name},
            "stringData": {key: text},
        });
        let apply = kube::api::PatchParams::apply("e2e").force();
        secrets
            .patch(name, &apply, &kube::api::Patch::Apply(&secret))
            .await
            .unwrap();
    }

    /// Waits until Backup `name`'s verification ended with `result` (`Passed`, `Failed`,
    /// `Error`).
    pub async fn wait_verification(&self, name: &str, result: &str, timeout: Duration) -> Backup {
        let what = format!("verification {result}");
        self.wait_backup(name, &what, timeout, |b| {
            b.status
                .as_ref()
                .and_then(|s| s.verification.as_ref())
                .is_some_and(|v| v.result.as_str() == result)
        })
        .await
    }

    /// The sum of the backup-controller's series of `metric` whose labels contain every
    /// one of `labels` (e.g. `result="Passed"`), from its /metrics.
    pub fn backup_metric(&self, metric: &str, labels: &[&str]) -> f64 {
        let controller = self
            .backup_controller
            .as_ref()
            .expect("a backup-controller");
        controller.metric_sum(metric, labels)
    }

    /// The reasons of the Events about Backup `name` of `type_` (Normal, Warning).
    pub async fn backup_event_reasons(&self, name: &str, type_: &str) -> Vec<String> {
        crate::fixtures::events_about(&self.b.client, self.ns(), "Backup", name)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.type_.as_deref() == Some(type_))
            .filter_map(|e| e.reason)
            .collect()
    }

    /// Waits until Backup `name` is Failed.
    pub async fn wait_failed(&self, name: &str, timeout: Duration) -> Backup {
        self.wait_backup(name, "Failed", timeout, |b| {
            phase(b) == Some(BackupPhase::Failed)
        })
        .await
    }

    pub async fn wait_gone<K>(&self, api: Api<K>, name: &str, uid: &str, timeout: Duration)
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let waited = crate::wait::deleted(api, name, uid, timeout).await;
        assert!(
            waited.is_ok(),
            "{name} still exists after {timeout:?}\n---- backup-controller log ----\n{}\n---- database-controller log ----\n{}",
            self.log("backup-controller", 6000),
            self.log("database-controller", 4000)
        );
    }

    /// [`Setup::wait_gone`] for `obj` of `api`: its name and UID.
    pub async fn wait_object_gone<K>(&self, api: Api<K>, obj: &K, timeout: Duration)
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let meta = obj.meta();
        let (name, uid) = (meta.name.as_deref().unwrap(), meta.uid.as_deref().unwrap());
        self.wait_gone(api, name, uid, timeout).await;
    }

    /// Runs `sql` in `database` as the superuser.
    pub async fn exec_as_superuser(&self, database: &str, sql: &str) {
        let client = self.pg.connect_as_superuser_to(database).await.unwrap();
        client.batch_execute(sql).await.unwrap();
    }

    /// The reasons of the Warning Events about Database `name`.
    pub async fn warning_reasons(&self, name: &str) -> Vec<String> {
        crate::fixtures::events_about(&self.b.client, self.ns(), "Database", name)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.type_.as_deref() == Some("Warning"))
            .filter_map(|e| e.reason)
            .collect()
    }

    /// Every file in the store directory of this namespace (hidden ones too), sorted.
    pub fn store_files(&self) -> Vec<String> {
        let dir = self.store.path().join(self.ns());
        let mut names: Vec<String> = match std::fs::read_dir(&dir) {
            Ok(entries) => entries
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect(),
            Err(_) => vec![],
        };
        names.sort();
        names
    }

    /// The artifact and manifest paths of a Backup.
    pub fn artifact_paths(&self, backup: &Backup) -> (PathBuf, PathBuf) {
        let stem = format!(
            "{}-{}",
            backup.metadata.name.as_deref().unwrap(),
            backup.metadata.uid.as_deref().unwrap()
        );
        let dir = self.store.path().join(self.ns());
        (
            dir.join(format!("{stem}.dump")),
            dir.join(format!("{stem}.manifest.json")),
        )
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- backup-controller log tail ({}) ----\n{}\n---- database-controller log tail ----\n{}\n---- postgres log tail ----\n{}",
                self.ns(),
                self.log("backup-controller", 8000),
                self.log("database-controller", 4000),
                self.redact(&self.pg.log_tail(3000)),
            );
            if let Some(s3) = &self.s3 {
                eprintln!("---- s3s-fs log tail ----\n{}", s3.log_tail(3000));
            }
        }
    }
}

/// SIGKILL `controller`, if it runs, and wait (10 s at most) for its exit.
fn kill(controller: &mut Option<ControllerProcess>) {
    crate::controllers::end(controller.take(), "KILL", Duration::from_secs(10));
}

pub fn phase(b: &Backup) -> Option<BackupPhase> {
    b.status.as_ref().and_then(|s| s.phase)
}

/// The metadata.uid of the Database the Backup dumped, as its status says.
pub fn database_uid(b: &Backup) -> Option<&str> {
    b.status.as_ref().and_then(|s| s.database_uid.as_deref())
}

pub fn has(b: &Backup, want: Want<'_>) -> bool {
    b.status
        .as_ref()
        .is_some_and(|s| want.matches(&s.conditions))
}

/// Asserts [`has`]; the message shows the Backup.
pub fn assert_has(b: &Backup, want: Want<'_>) {
    assert!(has(b, want), "{:?}", crate::wait::ObjectView(b.clone()));
}

pub fn attempts(b: &Backup) -> i32 {
    b.status.as_ref().and_then(|s| s.attempts).unwrap_or(0)
}

/// `sha256sum` of a file, hex.
pub fn sha256_of(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `pg_restore --list` of an artifact: its table of contents.
pub fn pg_restore_list(path: &Path) -> String {
    let pg_restore = crate::paths::postgres_bin_dir().unwrap().join("pg_restore");
    let out = Command::new(pg_restore)
        .arg("--list")
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pg_restore --list {} failed: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Checks a Completed Backup against its files: size, checksum, manifest, and that
/// pg_restore reads the artifact. Returns the table of contents.
pub fn verify_artifact(s: &Setup, backup: &Backup) -> String {
    let status = backup.status.clone().unwrap();
    let (artifact, manifest) = s.artifact_paths(backup);
    assert!(artifact.is_file(), "{} is missing", artifact.display());
    let size = std::fs::metadata(&artifact).unwrap().len();
    assert_eq!(status.size_bytes, Some(i64::try_from(size).unwrap()));
    let sum = sha256_of(&artifact);
    assert_eq!(status.checksum.as_deref(), Some(sum.as_str()));
    assert_eq!(
        status.location.as_deref(),
        Some(format!("file://{}", artifact.display()).as_str())
    );
    assert!(
        status
            .server_version
            .as_deref()
            .is_some_and(|v| v.starts_with("15")),
        "serverVersion {:?}",
        status.server_version
    );
    assert!(status.completed_at.is_some());
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(m["checksum"], json!(sum));
    assert_eq!(m["checksumAlgorithm"], json!("sha256"));
    assert_eq!(m["sizeBytes"], json!(size));
    assert_eq!(m["backup"]["uid"], json!(backup.metadata.uid));
    assert_eq!(m["database"]["name"], json!(backup.spec.database_ref.name));
    assert!(
        m["serverVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("15"))
    );
    assert!(
        m["pgDumpVersion"]
            .as_str()
            .is_some_and(|v| v.contains("pg_dump")),
        "{m}"
    );
    assert!(
        m["startedAt"].is_string() && m["completedAt"].is_string(),
        "{m}"
    );
    pg_restore_list(&artifact)
}
