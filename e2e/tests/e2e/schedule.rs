//! Scheduled Backups against the real test bed, in real time (`* * * * *`: every
//! minute): the first slot's Backup; a converged schedule that writes nothing; one
//! catch-up Backup after the backup-controller was down across two slots, none for the
//! skipped slot; retention deleting the older Completed Backup and its artifact; and two
//! backup-controller processes without leader election creating one Backup per slot.
//!
//! Each test has its own namespace, PostgreSQL server, store directory, database-
//! controller and backup-controller(s) (watching only that namespace, resync 5 s,
//! backoff 1 s..5 s). They wait for the wall clock to pass minute boundaries, so each
//! takes two to four minutes; they run in parallel with the rest of the suite.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use dbops_api::{Backup, BackupPhase, Database};
use dbops_e2e::fixtures::create_admin_secret;
use dbops_e2e::fixtures::merge_patch;
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::wait::{Want, eventually, holds_for};
use dbops_e2e::{ControllerProcess, PgServer};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;

use crate::{Bed, bed};

const ADMIN_SECRET: &str = "pg-admin";
const SCHEDULE_OF: &str = "dbops.dev/schedule-of";
const SCHEDULED_AT: &str = "dbops.dev/scheduled-at";
/// Provisioning, or a dump of an empty database, on a busy 2-core machine.
const READY: Duration = Duration::from_secs(90);
/// Until the first slot after a Database was created: up to a minute, and the dump.
const FIRST_SLOT: Duration = Duration::from_secs(150);
const MINUTE: SignedDuration = SignedDuration::from_secs(60);

/// One test's world: namespace, PostgreSQL, admin Secret, store, controllers.
struct World {
    // Dropped first: the controllers, then PostgreSQL, then the namespace.
    replicas: BTreeMap<String, ControllerProcess>,
    database_controller: Option<ControllerProcess>,
    pg: PgServer,
    b: Bed,
    store: tempfile::TempDir,
    logs: tempfile::TempDir,
}

impl World {
    async fn new(prefix: &str) -> Self {
        let b = bed(prefix).await;
        let pg = PgServer::start(prefix).await.unwrap();
        let temp = |what: &str| crate::test_dir(prefix, what);
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

    fn ns(&self) -> &str {
        self.b.ns.name()
    }

    /// Starts `dbops-<binary>` as the API user `user`, logging into its own directory
    /// (`<logs>/<user>/<binary>.log`, appended to across restarts).
    fn start(&self, binary: &str, user: &str, extra: Vec<String>) -> ControllerProcess {
        let kubeconfig = self.b.cp.kubeconfig_for(user, &["system:masters"]).unwrap();
        let mut args = crate::watch_args(self.ns(), "5s");
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

    fn log_dir(&self, user: &str) -> PathBuf {
        self.logs.path().join(user)
    }

    /// A backup-controller replica that calls the API as `user`.
    fn start_backup_controller(&mut self, user: &str) {
        let pg_dump = dbops_e2e::paths::postgres_bin_dir()
            .unwrap()
            .join("pg_dump");
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
    fn kill_backup_controller(&mut self, user: &str) {
        if let Some(mut c) = self.replicas.remove(user) {
            c.process.signal("KILL").unwrap();
            c.process.wait_exit(Duration::from_secs(10)).unwrap();
        }
    }

    fn log(&self, user: &str, binary: &str, max_bytes: u64) -> String {
        let path = self.log_dir(user).join(format!("{binary}.log"));
        self.redact(&dbops_e2e::process::log_tail(&path, max_bytes))
    }

    fn redact(&self, text: &str) -> String {
        redact_passwords(&text.replace(self.pg.superuser_password(), "<superuser-password>"))
    }

    fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// A Database backed up every minute, keeping `keep_last` completed Backups; Ready.
    async fn create_database(&self, name: &str, keep_last: i32) -> Database {
        self.create_database_with(name, "* * * * *", keep_last)
            .await;
        dbops_e2e::wait::expect_database_condition(
            &self.b.client,
            self.ns(),
            name,
            Want::new("Ready", "True", Some("Provisioned")),
            READY,
        )
        .await
    }

    /// A Database with `schedule`, not waited for.
    async fn create_database_with(&self, name: &str, schedule: &str, keep_last: i32) {
        self.create_database_spec(
            name,
            json!({"backup": {"schedule": schedule, "retention": {"keepLast": keep_last}}}),
        )
        .await;
    }

    /// A Database on this test's server with `spec` merged into its spec, not waited for.
    async fn create_database_spec(&self, name: &str, spec: serde_json::Value) {
        dbops_e2e::fixtures::create_database(&self.b.client, self.ns(), name, ADMIN_SECRET, spec)
            .await
            .unwrap();
    }

    /// The scheduled Backups of `db` (by label), oldest slot first.
    async fn scheduled(&self, db: &str) -> anyhow::Result<Vec<Scheduled>> {
        let list = self
            .backups()
            .list(&ListParams::default().labels(&format!("{SCHEDULE_OF}={db}")))
            .await?;
        let mut all: Vec<Scheduled> = list.items.into_iter().map(Scheduled).collect();
        all.sort_by_key(Scheduled::slot);
        Ok(all)
    }

    /// Waits until the scheduled Backups of `db` satisfy `done`; returns them.
    async fn wait_scheduled(
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

    async fn wait_completed(&self, name: &str) -> Backup {
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

    async fn wait_gone(&self, backup: &Backup) {
        let name = backup.name_any();
        let uid = backup.uid().unwrap();
        let waited = dbops_e2e::wait::deleted(self.backups(), &name, &uid, READY).await;
        assert!(waited.is_ok(), "Backup {name} still exists after {READY:?}");
    }

    /// The artifact and manifest of a Backup in the store directory.
    fn artifact_paths(&self, backup: &Backup) -> [PathBuf; 2] {
        let stem = format!("{}-{}", backup.name_any(), backup.uid().unwrap());
        let dir = self.store.path().join(self.ns());
        [
            dir.join(format!("{stem}.dump")),
            dir.join(format!("{stem}.manifest.json")),
        ]
    }

    /// The Events about Database `db` with `reason`: their types and notes.
    async fn events(&self, db: &str, reason: &str) -> anyhow::Result<Vec<(String, String)>> {
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
    async fn event_notes(&self, db: &str, reason: &str) -> anyhow::Result<Vec<String>> {
        let events = self.events(db, reason).await?;
        Ok(events.into_iter().map(|(_, note)| note).collect())
    }

    /// The writes `user` made in this namespace (the audit log).
    fn writes(&self, user: &str) -> Vec<String> {
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
struct Scheduled(Backup);

impl Scheduled {
    fn slot(&self) -> Timestamp {
        self.0
            .annotations()
            .get(SCHEDULED_AT)
            .unwrap_or_else(|| panic!("{} has no {SCHEDULED_AT}", self.0.name_any()))
            .parse()
            .unwrap()
    }

    fn phase(&self) -> Option<BackupPhase> {
        self.0.status.as_ref().and_then(|s| s.phase)
    }

    fn name(&self) -> String {
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
fn name_for(db: &str, slot: Timestamp) -> String {
    format!("{db}-{}", slot.strftime("%Y%m%d%H%M"))
}

/// The start of the minute `t` is in.
fn minute_of(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second() - t.as_second().rem_euclid(60)).unwrap()
}

/// Waits for the wall clock (not for any state) to reach `t`.
async fn wait_for_clock(t: Timestamp) {
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
fn scheduler_metric(replica: &ControllerProcess, metric: &str, label: &str) -> f64 {
    let (code, text) = replica.get("/metrics").unwrap();
    assert_eq!(code, 200, "{text}");
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter(|l| l.contains(r#"controller="backup-scheduler""#) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, v| sum + v)
}

// ---------------------------------------------------------------------------------------

/// The first slot gets its Backup, owned by the Database; a reconcile of the converged
/// schedule writes nothing; after the backup-controller was down across two slots, one
/// catch-up Backup is created for the latest slot and none for the skipped one (an
/// Event counts it); once the catch-up completes, retention (keepLast 1) deletes the
/// first Backup and its artifact.
#[tokio::test]
async fn after_downtime_one_catch_up_backup_then_retention_prunes_the_older_one() {
    const USER: &str = "dbops-backup-controller";
    let mut w = World::new("sched-catchup").await;
    w.start_backup_controller(USER);
    let db = w.create_database("orders", 1).await;
    let created = db.creation_timestamp().unwrap().0;

    // 1. The first slot after the Database was created.
    let all = w
        .wait_scheduled("orders", "a first Backup", FIRST_SLOT, |all| {
            !all.is_empty()
        })
        .await;
    let first = &all[0];
    assert!(
        first.slot() >= created,
        "{first:?} is for a slot before the Database existed ({created})"
    );
    assert_eq!(first.name(), name_for("orders", first.slot()));
    assert!(
        first.0.owner_references().is_empty(),
        "a scheduled Backup outlives its Database unless onDatabaseDeletion is Delete"
    );
    assert_eq!(
        first.0.annotations().get("dbops.dev/database-uid"),
        db.uid().as_ref(),
        "a scheduled Backup is pinned to its Database's UID"
    );
    assert_eq!(
        first
            .0
            .labels()
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("dbops")
    );
    assert_eq!(
        first.0.spec.deletion_policy,
        dbops_api::BackupDeletionPolicy::Delete
    );
    let first = w.wait_completed(&first.name()).await;
    let first_files = w.artifact_paths(&first);
    for f in &first_files {
        assert!(f.is_file(), "{} is missing", f.display());
    }

    // 2. Converged: a reconcile (forced by a spec change) makes no API write. (The
    //    Backup's own "Completed" Event, written just after its status, comes first.)
    let first_name = first.name_any();
    eventually(
        "the Completed Event of the first Backup",
        READY,
        || w.events(&first_name, "Completed"),
        |events| !events.is_empty(),
    )
    .await;
    let replica = &w.replicas[USER];
    let reconciled = scheduler_metric(replica, "dbops_reconciles_total", r#"outcome="success""#);
    let before = w.writes(USER);
    merge_patch(
        &w.databases(),
        "orders",
        json!({"spec": {"connectionLimit": 7}}),
    )
    .await
    .unwrap();
    eventually(
        "the scheduler to reconcile the changed Database",
        READY,
        || async {
            Ok(scheduler_metric(
                replica,
                "dbops_reconciles_total",
                r#"outcome="success""#,
            ))
        },
        |n| *n > reconciled,
    )
    .await;
    let after = w.writes(USER);
    eprintln!(
        "API writes of the backup-controller during a reconcile of the converged schedule: {}",
        after.len() - before.len()
    );
    let all = w.scheduled("orders").await.unwrap();
    if all.len() == 1 {
        // (A new slot may have begun meanwhile on a slow machine; then it wrote a Backup.)
        assert_eq!(after, before, "the converged schedule wrote to the API");
    }

    // 3. Down across two slots.
    w.kill_backup_controller(USER);
    let before: Vec<Scheduled> = w.scheduled("orders").await.unwrap();
    let last = before.iter().map(Scheduled::slot).max().unwrap();
    wait_for_clock(last + MINUTE * 2 + SignedDuration::from_secs(2)).await;
    let restarted_at = Timestamp::now();
    w.start_backup_controller(USER);

    // 4. One catch-up Backup, for the latest slot; none for the skipped one.
    let all = w
        .wait_scheduled("orders", "a catch-up Backup", READY, |all| {
            all.iter().any(|b| b.slot() > last)
        })
        .await;
    let new: Vec<&Scheduled> = all.iter().filter(|b| b.slot() > last).collect();
    assert_eq!(new.len(), 1, "one catch-up Backup only: {all:?}");
    let catch_up = new[0].name();
    let slot = new[0].slot();
    assert_eq!(
        slot,
        minute_of(restarted_at),
        "the catch-up is for the latest slot: {all:?}"
    );
    assert_eq!(catch_up, name_for("orders", slot));
    let skipped = name_for("orders", last + MINUTE);
    assert!(
        all.iter().all(|b| b.name() != skipped),
        "{skipped} was created: {all:?}"
    );
    // It stays the only one until shortly before the next slot.
    let next_slot = slot + MINUTE;
    let window = Duration::try_from(next_slot.duration_since(Timestamp::now()))
        .unwrap_or_default()
        .saturating_sub(Duration::from_secs(3))
        .min(Duration::from_secs(5));
    holds_for(
        "one catch-up Backup",
        window,
        || w.scheduled("orders"),
        |all| all.iter().filter(|b| b.slot() > last).count() == 1,
    )
    .await
    .unwrap();
    let slots_skipped = slot.duration_since(last).as_secs() / 60 - 1;
    let notes = eventually(
        "a SlotsSkipped Event on the Database",
        READY,
        || w.event_notes("orders", "SlotsSkipped"),
        |notes| !notes.is_empty(),
    )
    .await;
    let plural = if slots_skipped == 1 { "" } else { "s" };
    assert!(
        notes.iter().any(
            |n| n.contains(&format!("skipped {slots_skipped} slot{plural} "))
                && n.contains(&catch_up)
        ),
        "{notes:?}"
    );

    // 5. It completes; retention keeps it and deletes the first Backup and its artifact.
    let catch_up = w.wait_completed(&catch_up).await;
    w.wait_gone(&first).await;
    for f in &first_files {
        assert!(!f.exists(), "{} is still in the store", f.display());
    }
    for f in w.artifact_paths(&catch_up) {
        assert!(f.is_file(), "{} is missing", f.display());
    }
    let notes = w.event_notes("orders", "BackupPruned").await.unwrap();
    assert!(
        notes.iter().any(|n| n.contains(&first.name_any())),
        "{notes:?}"
    );
}

/// Two backup-controller processes without leader election, both running across two
/// slots: each slot gets exactly one Backup, created once (the other replica's create is
/// refused as AlreadyExists or not tried), and neither scheduler storms with errors.
#[tokio::test]
async fn two_replicas_create_one_backup_per_slot() {
    const USERS: [&str; 2] = ["dbops-backup-controller-a", "dbops-backup-controller-b"];
    let mut w = World::new("sched-replicas").await;
    for user in USERS {
        w.start_backup_controller(user);
    }
    w.create_database("orders", 2).await;
    // The CEL rule checks each field's range (minute 61 is refused by the API server now);
    // February 31st passes it and never comes: the scheduler's to refuse.
    w.create_database_with("bad", "0 0 31 2 *", 1).await;

    let all = w
        .wait_scheduled("orders", "a first Backup", FIRST_SLOT, |all| {
            !all.is_empty()
        })
        .await;
    let first = all[0].slot();
    let second = first + MINUTE;
    let all = w
        .wait_scheduled("orders", "the next slot's Backup", FIRST_SLOT, |all| {
            all.iter().any(|b| b.slot() == second)
        })
        .await;
    let slots: Vec<Timestamp> = all.iter().map(Scheduled::slot).collect();
    assert_eq!(slots, [first, second], "one Backup per slot: {all:?}");
    for b in &all {
        assert_eq!(b.name(), name_for("orders", b.slot()));
    }
    // Hold on until shortly before the slot after: still one Backup per slot.
    let window = Duration::try_from((second + MINUTE).duration_since(Timestamp::now()))
        .unwrap_or_default()
        .saturating_sub(Duration::from_secs(3))
        .min(Duration::from_secs(10));
    holds_for(
        "one Backup per slot",
        window,
        || w.scheduled("orders"),
        |all| {
            let distinct: BTreeSet<Timestamp> = all.iter().map(Scheduled::slot).collect();
            distinct.len() == all.len() && all.len() == 2
        },
    )
    .await
    .unwrap();

    // Both replicas also run the Backups (without leader election, which is what the
    // Lease is for): the slots' Backups still complete.
    for b in &all {
        w.wait_completed(&b.name()).await;
    }

    // Each Backup was created exactly once, by one replica or the other.
    let creates: Vec<String> = USERS
        .iter()
        .flat_map(|u| w.writes(u))
        .filter(|w| w.contains(" create backups "))
        .collect();
    let created: Vec<&String> = creates.iter().filter(|w| w.ends_with("-> 201")).collect();
    assert_eq!(
        created.len(),
        2,
        "successful creates of Backups: {creates:#?}"
    );
    eprintln!(
        "Backup creates: {} succeeded, {} refused (AlreadyExists)",
        created.len(),
        creates.iter().filter(|w| w.ends_with("-> 409")).count()
    );

    // The invalid schedule: a Warning Event, no Backup.
    let events = w.events("bad", "InvalidSchedule").await.unwrap();
    assert!(
        events
            .iter()
            .any(|(type_, note)| type_ == "Warning" && note.contains("0 0 31 2 *")),
        "{events:?}"
    );
    assert!(w.scheduled("bad").await.unwrap().is_empty());

    // No error storm, no hot loop in either scheduler.
    for user in USERS {
        let replica = &w.replicas[user];
        let errors = scheduler_metric(replica, "dbops_reconcile_errors_total", "");
        let invalid = scheduler_metric(
            replica,
            "dbops_reconcile_errors_total",
            r#"reason="InvalidSchedule""#,
        );
        let reconciles = scheduler_metric(replica, "dbops_reconciles_total", "");
        eprintln!(
            "{user}: backup-scheduler reconciles {reconciles}, errors {errors} ({invalid} InvalidSchedule)"
        );
        assert!(
            (1.0..=2.0).contains(&invalid),
            "{user}: the invalid schedule failed {invalid} reconciles, not once per generation"
        );
        assert!(errors - invalid <= 2.0, "{user}: {errors} scheduler errors");
        assert!(
            reconciles <= 40.0,
            "{user}: {reconciles} scheduler reconciles in ~2 minutes"
        );
    }
}

/// Issue 10, item 4: deleting a Database (any deletionPolicy; Delete here) leaves its
/// scheduled Backups and their artifacts, the copies a user needs most right after a
/// mistaken delete, and nothing prunes them once it is gone; `onDatabaseDeletion: Delete`
/// opts in to deleting them with it.
#[tokio::test]
async fn deleting_a_database_keeps_its_scheduled_backups_unless_asked() {
    let mut w = World::new("sch-outlive").await;
    w.start_backup_controller("dbops-backup-controller");
    for (name, on_deletion) in [("keep", None), ("drop", Some("Delete"))] {
        let mut backup = json!({"schedule": "* * * * *", "retention": {"keepLast": 1}});
        if let Some(policy) = on_deletion {
            backup["onDatabaseDeletion"] = policy.into();
        }
        w.create_database_spec(name, json!({"deletionPolicy": "Delete", "backup": backup}))
            .await;
    }
    let mut databases = Vec::new();
    let mut completed = Vec::new();
    for name in ["keep", "drop"] {
        databases.push(
            dbops_e2e::wait::expect_database_condition(
                &w.b.client,
                w.ns(),
                name,
                Want::new("Ready", "True", Some("Provisioned")),
                READY,
            )
            .await,
        );
        let first = w
            .wait_scheduled(name, "a first Backup", FIRST_SLOT, |all| !all.is_empty())
            .await;
        completed.push(w.wait_completed(&first[0].name()).await);
    }
    for db in &databases {
        w.databases()
            .delete(&db.name_any(), &Default::default())
            .await
            .unwrap();
    }
    for db in &databases {
        let gone =
            dbops_e2e::wait::deleted(w.databases(), &db.name_any(), &db.uid().unwrap(), READY)
                .await;
        assert!(gone.is_ok(), "Database {} still exists", db.name_any());
    }

    // Retain (the default): every scheduled Backup of "keep" stays Completed with its
    // artifact, over several resyncs and past the next slot, without a Database.
    let kept = &completed[0];
    let kept_count = w.scheduled("keep").await.unwrap().len();
    holds_for(
        "the scheduled Backups of the deleted Database keep stay, Completed",
        Duration::from_secs(15),
        || async {
            let all = w.scheduled("keep").await?;
            Ok(all
                .iter()
                .map(|b| (b.name(), b.phase()))
                .collect::<Vec<_>>())
        },
        |all| {
            all.len() == kept_count
                && all.iter().any(|(name, phase)| {
                    *name == kept.name_any() && *phase == Some(BackupPhase::Completed)
                })
        },
    )
    .await
    .unwrap();
    for path in w.artifact_paths(kept) {
        assert!(path.is_file(), "{} was removed", path.display());
    }

    // Delete: the scheduled Backups of "drop" went with it, and their artifacts too.
    let dropped = &completed[1];
    w.wait_gone(dropped).await;
    let [artifact, manifest] = w.artifact_paths(dropped);
    eventually(
        "the artifact of drop's scheduled Backup removed",
        READY,
        || async { Ok((artifact.exists(), manifest.exists())) },
        |exists| *exists == (false, false),
    )
    .await;
    w.wait_scheduled("drop", "none left", READY, |all| all.is_empty())
        .await;
}
