#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The backup-schedule tests' world: a namespace, PostgreSQL and its admin Secret, a
//! `file://` store, a database-controller and backup-controller replicas that create the
//! scheduled Backups; the Backups a schedule made, their slots, and the wall clock.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use dbops_api::{Backup, BackupPhase, Database};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;

use crate::controllers::ControllerProcess;
use crate::fixtures::create_admin_secret;
use crate::harness::bed::{Bed, bed};
use crate::harness::redact::redact;
use crate::postgres::PgServer;
use crate::wait::{Want, eventually};

pub use crate::harness::bed::ADMIN_SECRET;
pub const SCHEDULE_OF: &str = "dbops.dev/schedule-of";
pub const SCHEDULED_AT: &str = "dbops.dev/scheduled-at";
/// Provisioning, or a dump of an empty database, on a busy 2-core machine.
pub const READY: Duration = Duration::from_secs(90);
/// Until the first slot after a Database was created: up to a minute, and the dump.
pub const FIRST_SLOT: Duration = Duration::from_secs(150);
pub const MINUTE: SignedDuration = SignedDuration::from_secs(60);

/// One test's world: namespace, PostgreSQL, admin Secret, store, controllers.
pub struct World {
    // Dropped first: the controllers, then PostgreSQL, then the namespace.
    pub replicas: BTreeMap<String, ControllerProcess>,
    pub database_controller: Option<ControllerProcess>,
    pub pg: PgServer,
    pub b: Bed,
    pub store: tempfile::TempDir,
    pub logs: tempfile::TempDir,
}

impl World {
    pub async fn new(prefix: &str) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        let temp = |what: &str| crate::harness::bed::test_dir(prefix, what);
        let mut w = Self {
            replicas: BTreeMap::new(),
            database_controller: None,
            pg,
            b,
            store: temp("store"),
            logs: temp("logs"),
        };
        create_admin_secret(&w.b.client, w.ns(), ADMIN_SECRET, &w.pg)
            .await
            .unwrap();
        // The database-controller reads the store the backup-controllers write.
        let store = format!("--backup-store=file://{}", w.store.path().display());
        w.database_controller = Some(w.start(
            "database-controller",
            "dbops-database-controller",
            vec![store],
        ));
        w
    }

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    /// Starts `dbops-<binary>` as the API user `user`, logging into its own directory
    /// (`<logs>/<user>/<binary>.log`, appended to across restarts).
    pub fn start(&self, binary: &str, user: &str, extra: Vec<String>) -> ControllerProcess {
        let kubeconfig = self.b.cp.kubeconfig_for(user, &["system:masters"]).unwrap();
        let mut args = crate::harness::bed::watch_args(self.ns(), "5s");
        args.extend(extra);
        let dir = self.log_dir(user);
        std::fs::create_dir_all(&dir).unwrap();
        ControllerProcess::start(binary, &kubeconfig, &dir, &args).unwrap_or_else(|e| {
            panic!(
                "starting {binary} as {user}: {}",
                self.redact(&format!("{e:#}"))
            )
        })
    }

    pub fn log_dir(&self, user: &str) -> PathBuf {
        self.logs.path().join(user)
    }

    /// A backup-controller replica that calls the API as `user`.
    pub fn start_backup_controller(&mut self, user: &str) {
        let pg_dump = crate::paths::postgres_bin_dir().unwrap().join("pg_dump");
        let process = self.start(
            "backup-controller",
            user,
            vec![
                format!("--backup-store=file://{}", self.store.path().display()),
                format!("--pg-dump={}", pg_dump.display()),
            ],
        );
        self.replicas.insert(user.to_string(), process);
    }

    /// SIGKILL: the controller is down until it is started again.
    pub fn kill_backup_controller(&mut self, user: &str) {
        crate::controllers::end(self.replicas.remove(user), "KILL", Duration::from_secs(10));
    }

    pub fn log(&self, user: &str, binary: &str, max_bytes: u64) -> String {
        let path = self.log_dir(user).join(format!("{binary}.log"));
        self.redact(&crate::process::log_tail(&path, max_bytes))
    }

    pub fn redact(&self, text: &str) -> String {
        redact(text, [("superuser", &self.pg)])
    }

    pub fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// A Database backed up every minute, keeping `keep_last` completed Backups; Ready.
    pub async fn create_database(&self, name: &str, keep_last: i32) -> Database {
        self.create_database_with(name, "* * * * *", keep_last)
            .await;
        self.wait_provisioned(name).await
    }

    /// Waits ([`READY`] at most) until Database `name` is provisioned (Ready=True,
    /// Provisioned).
    pub async fn wait_provisioned(&self, name: &str) -> Database {
        crate::wait::expect_database_condition(
            &self.b.client,
            self.ns(),
            name,
            Want::provisioned(),
            READY,
        )
        .await
    }

    /// A Database with `schedule`, not waited for.
    pub async fn create_database_with(&self, name: &str, schedule: &str, keep_last: i32) {
        self.create_database_spec(
            name,
            json!({"backup": {"schedule": schedule, "retention": {"keepLast": keep_last}}}),
        )
        .await;
    }

    /// A Database on this test's server with `spec` merged into its spec, not waited for.
    pub async fn create_database_spec(&self, name: &str, spec: serde_json::Value) {
        crate::fixtures::create_database(&self.b.client, self.ns(), name, ADMIN_SECRET, spec)
            .await
            .unwrap();
    }

    /// The scheduled Backups of `db` (by label), oldest slot first.
    pub async fn scheduled(&self, db: &str) -> anyhow::Result<Vec<Scheduled>> {
        let list = self
            .backups()
            .list(&ListParams::default().labels(&format!("{SCHEDULE_OF}={db}")))
            .await?;
        let mut all: Vec<Scheduled> = list.items.into_iter().map(Scheduled).collect();
        all.sort_by_key(Scheduled::slot);
        Ok(all)
    }

    /// Waits until the scheduled Backups of `db` satisfy `done`; returns them.
    pub async fn wait_scheduled(
        &self,
        db: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Scheduled]) -> bool,
    ) -> Vec<Scheduled> {
        eventually(
            &format!("scheduled Backups of {db}: {what}"),
            timeout,
            || self.scheduled(db),
            |all| done(all),
        )
        .await
    }

    pub async fn wait_completed(&self, name: &str) -> Backup {
        let backups = self.backups();
        eventually(
            &format!("Backup {name} Completed"),
            READY,
            || async { Ok(backups.get_opt(name).await?.map(Scheduled)) },
            |b| {
                b.as_ref()
                    .is_some_and(|b| b.phase() == Some(BackupPhase::Completed))
            },
        )
        .await
        .unwrap()
        .0
    }

    pub async fn wait_gone(&self, backup: &Backup) {
        let name = backup.name_any();
        let uid = backup.uid().unwrap();
        let waited = crate::wait::deleted(self.backups(), &name, &uid, READY).await;
        assert!(waited.is_ok(), "Backup {name} still exists after {READY:?}");
    }

    /// The artifact and manifest of a Backup in the store directory.
    pub fn artifact_paths(&self, backup: &Backup) -> [PathBuf; 2] {
        let stem = format!("{}-{}", backup.name_any(), backup.uid().unwrap());
        let dir = self.store.path().join(self.ns());
        [
            dir.join(format!("{stem}.dump")),
            dir.join(format!("{stem}.manifest.json")),
        ]
    }

    /// The Events about Database `db` with `reason`: their types and notes.
    pub async fn events(&self, db: &str, reason: &str) -> anyhow::Result<Vec<(String, String)>> {
        let events: Api<Event> = Api::namespaced(self.b.client.clone(), self.ns());
        Ok(events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(db)
            })
            .map(|e| (e.type_.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect())
    }

    /// The notes of the Events about Database `db` with `reason`.
    pub async fn event_notes(&self, db: &str, reason: &str) -> anyhow::Result<Vec<String>> {
        let events = self.events(db, reason).await?;
        Ok(events.into_iter().map(|(_, note)| note).collect())
    }

    /// The writes `user` made in this namespace (the audit log).
    pub fn writes(&self, user: &str) -> Vec<String> {
        self.b
            .cp
            .audit_writes(user, Some(self.ns()))
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let users: Vec<String> = std::fs::read_dir(self.logs.path())
                .map(|d| {
                    d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            for user in users {
                for binary in ["backup-controller", "database-controller"] {
                    let log = self.log(&user, binary, 6000);
                    if !log.is_empty() {
                        eprintln!(
                            "---- {binary} ({user}) log tail ({}) ----\n{log}",
                            self.ns()
                        );
                    }
                }
            }
        }
    }
}

/// A scheduled Backup, shown by its slot, phase and deletion in failure messages.
pub struct Scheduled(pub Backup);

impl Scheduled {
    pub fn slot(&self) -> Timestamp {
        self.0
            .annotations()
            .get(SCHEDULED_AT)
            .unwrap_or_else(|| panic!("{} has no {SCHEDULED_AT}", self.0.name_any()))
            .parse()
            .unwrap()
    }

    pub fn phase(&self) -> Option<BackupPhase> {
        self.0.status.as_ref().and_then(|s| s.phase)
    }

    pub fn name(&self) -> String {
        self.0.name_any()
    }
}

impl std::fmt::Debug for Scheduled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (slot {:?}, {:?}{})",
            self.0.name_any(),
            self.0.annotations().get(SCHEDULED_AT),
            self.phase(),
            if self.0.metadata.deletion_timestamp.is_some() {
                ", deleting"
            } else {
                ""
            }
        )
    }
}

/// `<database>-<YYYYMMDDHHMM>` of the slot, in UTC.
pub fn name_for(db: &str, slot: Timestamp) -> String {
    format!("{db}-{}", slot.strftime("%Y%m%d%H%M"))
}

/// The start of the minute `t` is in.
pub fn minute_of(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second() - t.as_second().rem_euclid(60)).unwrap()
}

/// How long from now a check may hold: until 3 s before `slot` (none when that has
/// passed), `cap` at the most.
pub fn until_shortly_before(slot: Timestamp, cap: Duration) -> Duration {
    Duration::try_from(slot.duration_since(Timestamp::now()))
        .unwrap_or_default()
        .saturating_sub(Duration::from_secs(3))
        .min(cap)
}

/// Waits for the wall clock (not for any state) to reach `t`.
pub async fn wait_for_clock(t: Timestamp) {
    let timeout = Duration::try_from(t.duration_since(Timestamp::now())).unwrap_or_default()
        + Duration::from_secs(5);
    eventually(
        &format!("the wall clock to reach {t}"),
        timeout,
        || async { Ok(Timestamp::now()) },
        |now| *now >= t,
    )
    .await;
}

/// The sum of the backup-scheduler's series of `metric` (e.g. `dbops_reconciles_total`)
/// whose labels contain `label` (e.g. `outcome="success"`), from a replica's /metrics.
pub fn scheduler_metric(replica: &ControllerProcess, metric: &str, label: &str) -> f64 {
    replica.metric_sum(metric, &[r#"controller="backup-scheduler""#, label])
}
