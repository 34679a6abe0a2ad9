#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The observability tests' world (`traces`, `metrics`): one namespace, PostgreSQL, a
//! `file://` store, and both controllers, optionally exporting their spans to a real Jaeger.

use std::time::Duration;

use dbops_api::{Backup, BackupPhase, Database};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;

use crate::controllers::ControllerProcess;
use crate::fixtures::create_admin_secret;
use crate::harness::bed::{Bed, bed};
use crate::harness::redact::redact;
use crate::jaeger::Jaeger;
use crate::postgres::PgServer;
use crate::postgres::redact_passwords;

pub use crate::harness::bed::ADMIN_SECRET;
/// Provisioning, a small dump, or a span export on a busy 2-core machine.
pub const SLOW: Duration = Duration::from_secs(120);
pub const DATABASE_CONTROLLER: &str = "dbops-database-controller";
pub const BACKUP_CONTROLLER: &str = "dbops-backup-controller";

/// One test's world. Dropped in field order: controllers first, then Jaeger, PostgreSQL,
/// the namespace.
pub struct World {
    pub database_controller: ControllerProcess,
    pub backup_controller: ControllerProcess,
    pub jaeger: Option<Jaeger>,
    pub pg: PgServer,
    pub b: Bed,
    _store: tempfile::TempDir,
    pub logs: tempfile::TempDir,
}

impl World {
    /// Namespace, PostgreSQL, admin Secret, store and both controllers; with `traced`, a
    /// Jaeger that both controllers export to.
    pub async fn new(prefix: &str, traced: bool) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        let store = crate::harness::bed::test_dir(prefix, "store");
        let logs = crate::harness::bed::test_dir(prefix, "logs");
        let jaeger = traced.then(|| Jaeger::start(logs.path()).unwrap());
        create_admin_secret(&b.client, b.ns.name(), ADMIN_SECRET, &pg)
            .await
            .unwrap();

        let mut common = crate::harness::bed::watch_args(b.ns.name(), "5s");
        common.push(format!("--backup-store=file://{}", store.path().display()));
        if let Some(jaeger) = &jaeger {
            common.push(format!("--otlp-endpoint={}", jaeger.otlp_endpoint()));
        }
        let bin = crate::paths::postgres_bin_dir().unwrap();
        let identities = crate::harness::bed::controller_identities(b.cp).await;
        let start = |name: &str, extra: String| {
            let kubeconfig = identities[name].clone();
            let mut args = common.clone();
            args.push(extra);
            ControllerProcess::start(name, &kubeconfig, logs.path(), &args).unwrap_or_else(|e| {
                panic!(
                    "starting the {name}: {}",
                    redact_passwords(&format!("{e:#}"))
                )
            })
        };
        let database_controller = start(
            "database-controller",
            format!("--pg-restore={}", bin.join("pg_restore").display()),
        );
        let backup_controller = start(
            "backup-controller",
            format!("--pg-dump={}", bin.join("pg_dump").display()),
        );
        Self {
            database_controller,
            backup_controller,
            jaeger,
            pg,
            b,
            _store: store,
            logs,
        }
    }

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    pub fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// The last bytes of a controller's log, passwords redacted.
    pub fn log(&self, controller: &str) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        redact(
            &crate::process::log_tail(&path, 6000),
            [("superuser", &self.pg)],
        )
    }

    /// A Database on this world's server with `deletionPolicy`, waited for until Ready.
    pub async fn create_ready_database(&self, name: &str, policy: &str) -> Database {
        crate::fixtures::create_provisioned_database(
            &self.b.client,
            self.ns(),
            name,
            ADMIN_SECRET,
            json!({"deletionPolicy": policy}),
            SLOW,
            || self.log("database-controller"),
        )
        .await
    }

    /// The password in the Database's connection Secret.
    pub async fn owner_password(&self, db: &str) -> String {
        let secret = Api::<Secret>::namespaced(self.b.client.clone(), self.ns())
            .get(&format!("{db}-connection"))
            .await
            .unwrap();
        let data = secret.data.unwrap_or_default();
        String::from_utf8(data.get("password").unwrap().0.clone()).unwrap()
    }

    /// Waits until Backup `name` is Completed.
    pub async fn wait_completed(&self, name: &str) -> Backup {
        let backups = self.backups();
        match crate::wait::wait_for(
            &format!("Backup {name} Completed"),
            SLOW,
            || async { Ok(backups.get_opt(name).await?) },
            |b| {
                b.as_ref()
                    .and_then(|b| b.status.as_ref())
                    .is_some_and(|s| s.phase == Some(BackupPhase::Completed))
            },
        )
        .await
        {
            Ok(b) => b.unwrap(),
            Err(e) => panic!(
                "{e:#}\n---- backup-controller log ----\n{}\n---- database-controller log ----\n{}",
                self.log("backup-controller"),
                self.log("database-controller")
            ),
        }
    }
}
