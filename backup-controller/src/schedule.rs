//! Scheduled Backups: the second controller of the backup-controller process (metrics
//! label and Event reporter `backup-scheduler`), reconciling Databases that have
//! `spec.backup`. Its reconcile, as a pipeline of named steps:
//!
//! 1. nothing for a Database without `spec.backup` or being deleted;
//! 2. `parse_schedule` (pure): a schedule that is not a cron expression is an invalid
//!    spec: one Warning Event per generation, then wait for a change;
//! 3. `scheduled_backups`: this Database's scheduled Backups, read from a reflector store
//!    (label `dbops.dev/schedule-of=<database>` and this Database's UID in the annotation
//!    `dbops.dev/database-uid`), never from the API;
//! 4. `plan` (pure): the slot to take, the slots skipped, the Backups retention prunes,
//!    the next slot;
//! 5. apply: create the slot's Backup (AlreadyExists is success), delete the pruned ones,
//!    and give the existing ones an owner reference to the Database exactly when
//!    `onDatabaseDeletion` is Delete; an Event for each create and delete;
//! 6. requeue at the next slot.
//!
//! The slot is the latest scheduled time (UTC) at or before now that is not before the
//! Database's creation. Its Backup is `<database>-<YYYYMMDDHHMM>`: two replicas, or a
//! crash right after the create, compute the same name and the API server refuses the
//! second create, so one slot never gets two Backups. Slots missed while no controller
//! ran are not taken, only the latest (one catch-up Backup), and an Event counts them. A
//! slot is only taken when it is newer than every scheduled Backup of the Database
//! (a pruned slot is never taken again, a replica whose clock lags creates nothing) and
//! while none is still unfinished (a Database that cannot be dumped gets one waiting
//! Backup, not one per slot).
//!
//! Retention (`keepLast: N`): the N newest Completed scheduled Backups stay; older
//! Completed ones are deleted, and so are Failed ones older than the newest Completed
//! one; Pending and Running ones never are. Without `retention` nothing is pruned.
//! Deleting a Backup runs its own finalizer: scheduled Backups are created with
//! `deletionPolicy: Delete`, so their artifacts leave the store with them.
//!
//! Scheduled Backups outlive their Database: they are not owned by it unless
//! `spec.backup.onDatabaseDeletion` is Delete (then garbage collection deletes them, and
//! their artifacts, with the Database). Retention prunes only while the Database exists
//! and is not being deleted; a Database created again under the same name has a new UID
//! and never prunes the Backups of the earlier one.
//!
//! A converged Database costs no API request: a reconcile reads only the stores.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use dbops_api::{
    Backup, BackupDeletionPolicy, BackupPhase, BackupSpec, Database, LocalObjectReference,
    ScheduledBackupsOnDeletion, marks,
};
use dbops_shared::controller::{self, Context, ErrorKind, ReconcileError};
use dbops_shared::events::Recorder;
use jiff::Timestamp;
use jiff::tz::TimeZone;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

/// Metrics label and Event reporter (`dbops-backup-scheduler`) of this controller.
pub const CONTROLLER: &str = "backup-scheduler";
/// The label naming the Database whose schedule created a Backup.
pub const SCHEDULE_OF: &str = "dbops.dev/schedule-of";
/// The annotation holding a scheduled Backup's slot, RFC 3339 in UTC.
pub const SCHEDULED_AT: &str = "dbops.dev/scheduled-at";
const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "dbops");
/// The longest Database name a schedule accepts: it is the value of the label
/// [`SCHEDULE_OF`], and label values have at most 63 characters.
pub const MAX_DATABASE_NAME: usize = 63;
/// The longest object name (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;
/// The longest wait before a Database is looked at again, whatever its schedule: a
/// wall clock that was stepped is noticed within this time.
const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How long a reconcile waits for the store of scheduled Backups to sync first.
const STORE_SYNC: Duration = Duration::from_secs(30);
/// Skipped slots are counted up to this many (the Event then says "at least").
const MAX_COUNTED: u32 = 10_000;

/// The scheduler's own state.
pub struct State {
    /// The Backups that carry the label [`SCHEDULE_OF`], from a reflector.
    pub backups: Store<Backup>,
    pub recorder: Recorder,
    /// The generation of each Database (by UID) whose invalid spec was already reported.
    warned: Mutex<HashMap<String, Option<i64>>>,
}

impl State {
    pub fn new(backups: Store<Backup>, recorder: Recorder) -> Self {
        Self {
            backups,
            recorder,
            warned: Mutex::new(HashMap::new()),
        }
    }

    /// Whether the invalid spec of this generation is reported for the first time.
    fn first_warning(&self, uid: &str, generation: Option<i64>) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        warned.insert(uid.to_string(), generation) != Some(generation)
    }

    fn valid_again(&self, uid: &str) {
        let mut warned = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        warned.remove(uid);
    }
}

/// Why a scheduler reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("spec.backup.schedule {schedule:?}: {reason}")]
    InvalidSchedule { schedule: String, reason: String },
    #[error(
        "Database name {name:?} is {len} characters long; scheduled backups need at most {MAX_DATABASE_NAME} (it is the value of the label {SCHEDULE_OF})"
    )]
    NameTooLong { name: String, len: usize },
    #[error("the store of scheduled Backups has not synced within {STORE_SYNC:?}")]
    StoreNotSynced,
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kube(_) | Error::StoreNotSynced => ErrorKind::Transient,
            Error::InvalidSchedule { .. } | Error::NameTooLong { .. } => ErrorKind::Permanent,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::InvalidSchedule { .. } => "InvalidSchedule",
            Error::NameTooLong { .. } => "NameTooLong",
            Error::StoreNotSynced => "StoreNotSynced",
        }
    }
}

/// A parsed five-field cron schedule, evaluated in UTC at minute precision.
#[derive(Debug, Clone)]
pub struct Schedule(Cron);

/// Parses `text`: five fields (minute hour day-of-month month day-of-week) or a macro
/// (@hourly, @daily, @midnight, @weekly, @monthly, @yearly, @annually). A schedule that
/// never fires is refused too.
pub fn parse_schedule(text: &str) -> Result<Schedule, String> {
    let text = text.trim();
    // croner knows every macro the API allows but @midnight, which is @daily.
    let text = if text.eq_ignore_ascii_case("@midnight") {
        "@daily"
    } else {
        text
    };
    let cron = CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(text)
        .map_err(|e| e.to_string())?;
    let schedule = Schedule(cron);
    if schedule.next_after(Timestamp::UNIX_EPOCH).is_none() {
        return Err("the expression never matches a date".to_string());
    }
    Ok(schedule)
}

impl Schedule {
    /// The latest scheduled time at or before `t`.
    pub fn latest_at_or_before(&self, t: Timestamp) -> Option<Timestamp> {
        let t = whole_second(t).to_zoned(TimeZone::UTC);
        self.0
            .find_previous_occurrence(&t, true)
            .ok()
            .map(|z| z.timestamp())
    }

    /// Seconds between the next two slots after `t` (what "on schedule" means for the
    /// alert on an old last success).
    pub fn interval_after(&self, t: Timestamp) -> Option<i64> {
        let first = self.next_after(t)?;
        let second = self.next_after(first)?;
        Some(second.as_second() - first.as_second())
    }

    /// The first scheduled time after `t`.
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        let t = whole_second(t).to_zoned(TimeZone::UTC);
        self.0
            .find_next_occurrence(&t, false)
            .ok()
            .map(|z| z.timestamp())
    }

    /// How many scheduled times lie strictly between `after` and `before`, counted up
    /// to [`MAX_COUNTED`].
    pub fn count_between(&self, after: Timestamp, before: Timestamp) -> u32 {
        let mut count = 0;
        let mut t = after;
        while count < MAX_COUNTED {
            match self.next_after(t) {
                Some(next) if next < before => {
                    count += 1;
                    t = next;
                }
                _ => break,
            }
        }
        count
    }
}

fn whole_second(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// The Backup name of `database`'s slot `at`: `<database>-<YYYYMMDDHHMM>` (UTC).
pub fn backup_name(database: &str, at: Timestamp) -> String {
    format!("{database}-{}", at.strftime("%Y%m%d%H%M"))
}

/// Whether `database` can name scheduled Backups: it is the value of the label
/// [`SCHEDULE_OF`], and `<database>-<YYYYMMDDHHMM>` must be an object name.
pub fn check_name(database: &str) -> Result<(), Error> {
    let len = database.len();
    if len > MAX_DATABASE_NAME || len + "-YYYYMMDDHHMM".len() > MAX_OBJECT_NAME {
        return Err(Error::NameTooLong {
            name: database.to_string(),
            len,
        });
    }
    Ok(())
}

/// A scheduled Backup as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    pub name: String,
    pub uid: String,
    /// Its slot ([`SCHEDULED_AT`]), or its creation time when the annotation is missing.
    pub slot: Timestamp,
    pub phase: Option<BackupPhase>,
    /// Its deletion has started.
    pub deleting: bool,
    /// It has an owner reference to the Database (garbage collected with it).
    pub owned_by_database: bool,
}

impl Scheduled {
    fn of(backup: &Backup, database_uid: Option<&str>) -> Self {
        let slot = backup
            .annotations()
            .get(SCHEDULED_AT)
            .and_then(|s| s.parse::<Timestamp>().ok())
            .or_else(|| backup.creation_timestamp().map(|t| t.0))
            .unwrap_or(Timestamp::UNIX_EPOCH);
        Self {
            name: backup.name_any(),
            uid: backup.uid().unwrap_or_default(),
            slot,
            phase: backup.status.as_ref().and_then(|s| s.phase),
            deleting: backup.metadata.deletion_timestamp.is_some(),
            owned_by_database: database_uid
                .is_some_and(|uid| backup.owner_references().iter().any(|o| o.uid == uid)),
        }
    }

    fn finished(&self) -> bool {
        matches!(
            self.phase,
            Some(BackupPhase::Completed | BackupPhase::Failed)
        )
    }
}

/// The Backup to create for a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Take {
    pub slot: Timestamp,
    pub name: String,
    /// Slots between the newest scheduled Backup (or the Database's creation) and this
    /// one that get no Backup.
    pub skipped: u32,
}

/// A Backup that retention deletes, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prune {
    pub name: String,
    pub uid: String,
    pub why: String,
}

/// What one reconcile does for a Database's schedule.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub take: Option<Take>,
    /// The slot is due but this scheduled Backup has not finished yet.
    pub waiting_for: Option<String>,
    pub prune: Vec<Prune>,
    /// The next slot after now.
    pub next: Option<Timestamp>,
}

/// Decides, from the clock and the Database's scheduled Backups, which slot to take and
/// which Backups to prune (see the module documentation). Pure.
pub fn plan(
    schedule: &Schedule,
    database: &str,
    created: Timestamp,
    now: Timestamp,
    existing: &[Scheduled],
    keep_last: Option<usize>,
) -> Plan {
    let newest = existing.iter().map(|b| b.slot).max();
    let due = schedule
        .latest_at_or_before(now)
        .filter(|slot| *slot >= created && newest.is_none_or(|newest| *slot > newest));
    let unfinished = existing
        .iter()
        .filter(|b| !b.finished() && !b.deleting)
        .max_by_key(|b| b.slot);
    let (take, waiting_for) = match (due, unfinished) {
        (Some(_), Some(busy)) => (None, Some(busy.name.clone())),
        (Some(slot), None) => {
            let skipped = match newest {
                Some(newest) => schedule.count_between(newest, slot),
                // Slots at the creation second count; the scan starts just before it.
                None => schedule.count_between(created - jiff::SignedDuration::from_secs(1), slot),
            };
            let take = Take {
                slot,
                name: backup_name(database, slot),
                skipped,
            };
            (Some(take), None)
        }
        (None, _) => (None, None),
    };
    Plan {
        take,
        waiting_for,
        prune: keep_last
            .map(|n| retention(existing, n))
            .unwrap_or_default(),
        next: schedule.next_after(now),
    }
}

/// The scheduled Backups that `keepLast: keep` deletes: Completed ones beyond the
/// `keep` newest, and Failed ones older than the newest Completed one. Pure.
pub fn retention(existing: &[Scheduled], keep: usize) -> Vec<Prune> {
    let mut live: Vec<&Scheduled> = existing.iter().filter(|b| !b.deleting).collect();
    // Newest first; the name breaks ties so that the order is total.
    live.sort_by(|a, b| b.slot.cmp(&a.slot).then_with(|| b.name.cmp(&a.name)));
    let completed: Vec<&Scheduled> = live
        .iter()
        .copied()
        .filter(|b| b.phase == Some(BackupPhase::Completed))
        .collect();
    let newest_completed = completed.first().map(|b| b.slot);
    let mut prune: Vec<Prune> = completed
        .iter()
        .skip(keep)
        .map(|b| Prune {
            name: b.name.clone(),
            uid: b.uid.clone(),
            why: format!("Completed and older than the {keep} newest completed scheduled Backups"),
        })
        .collect();
    if let Some(newest_completed) = newest_completed {
        prune.extend(
            live.iter()
                .filter(|b| b.phase == Some(BackupPhase::Failed) && b.slot < newest_completed)
                .map(|b| Prune {
                    name: b.name.clone(),
                    uid: b.uid.clone(),
                    why: "Failed and older than the newest completed scheduled Backup".to_string(),
                }),
        );
    }
    prune
}

/// The scheduled Backup of `db` for the slot `take`: labelled for retention, pinned to
/// the Database's UID, its artifact deleted with it; owned by the Database (garbage
/// collected with it) only when `onDatabaseDeletion` is Delete.
pub fn desired_backup(db: &Database, take: &Take) -> Backup {
    let database = db.name_any();
    let mut annotations = std::collections::BTreeMap::from([
        (SCHEDULED_AT.to_string(), take.slot.to_string()),
        (
            marks::DATABASE_UID.to_string(),
            db.uid().unwrap_or_default(),
        ),
    ]);
    annotations.extend(creator_trace_context());
    let mut backup = Backup::new(
        &take.name,
        BackupSpec {
            database_ref: LocalObjectReference {
                name: database.clone(),
            },
            deletion_policy: BackupDeletionPolicy::Delete,
            max_retries: 3,
        },
    );
    backup.metadata = ObjectMeta {
        name: Some(take.name.clone()),
        namespace: db.namespace(),
        labels: Some(std::collections::BTreeMap::from([
            (SCHEDULE_OF.to_string(), database),
            (MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string()),
        ])),
        annotations: Some(annotations),
        owner_references: deleted_with(db)
            .then(|| database_owner(db))
            .flatten()
            .map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    backup
}

/// Whether the Database's scheduled Backups go with it (`onDatabaseDeletion: Delete`).
fn deleted_with(db: &Database) -> bool {
    db.spec
        .backup
        .as_ref()
        .is_some_and(|b| b.on_database_deletion == ScheduledBackupsOnDeletion::Delete)
}

/// The owner reference that makes garbage collection delete a scheduled Backup with its
/// Database; like a CronJob's Jobs, a foreground deletion of the Database waits for them.
fn database_owner(db: &Database) -> Option<OwnerReference> {
    db.controller_owner_ref(&()).map(|o| OwnerReference {
        block_owner_deletion: Some(true),
        ..o
    })
}

/// The annotation that carries the creating reconcile's W3C trace context
/// (`dbops.dev/traceparent`) to the Backup, so that its dump continues the scheduler's
/// trace; none when tracing is off.
fn creator_trace_context() -> Option<(String, String)> {
    dbops_shared::telemetry::trace_annotation()
}

/// The scheduled Backups of `db` in the store: the label names it and the annotation
/// `dbops.dev/database-uid` (or an owner reference) carries its UID; a Backup of an
/// earlier Database of the same name is not this one's.
fn scheduled_backups(store: &Store<Backup>, db: &Database) -> Vec<Scheduled> {
    let namespace = db.namespace();
    let name = db.name_any();
    let uid = db.uid();
    store
        .state()
        .iter()
        .filter(|b| b.namespace() == namespace)
        .filter(|b| b.labels().get(SCHEDULE_OF) == Some(&name))
        .filter(|b| {
            b.annotations().get(marks::DATABASE_UID) == uid.as_ref()
                || b.owner_references()
                    .iter()
                    .any(|o| Some(&o.uid) == uid.as_ref())
        })
        .map(|b| Scheduled::of(b, uid.as_deref()))
        .collect()
}

pub async fn reconcile(db: Arc<Database>, ctx: Arc<Context<State>>) -> Result<Action, Error> {
    let namespace = db.namespace().unwrap_or_default();
    let forget = || {
        if let Some(metrics) = ctx.metrics.backup() {
            metrics.forget_schedule(&namespace, &db.name_any());
        }
    };
    let Some(spec) = db.spec.backup.as_ref() else {
        forget();
        return Ok(Action::await_change());
    };
    let uid = db.uid().unwrap_or_default();
    if db.metadata.deletion_timestamp.is_some() {
        forget();
        // Nothing new starts and nothing is pruned: the scheduled Backups stay (or go
        // with it by their owner references, with `onDatabaseDeletion: Delete`).
        ctx.state.valid_again(&uid);
        return Ok(Action::await_change());
    }
    let name = db.name_any();
    let schedule = match check_name(&name).and_then(|()| {
        parse_schedule(&spec.schedule).map_err(|reason| Error::InvalidSchedule {
            schedule: spec.schedule.clone(),
            reason,
        })
    }) {
        Ok(schedule) => schedule,
        Err(error) => {
            if ctx.state.first_warning(&uid, db.metadata.generation) {
                publish(&ctx, &db, false, error.reason(), &error.to_string()).await;
            }
            return Err(error);
        }
    };
    ctx.state.valid_again(&uid);

    tokio::time::timeout(STORE_SYNC, ctx.state.backups.wait_until_ready())
        .await
        .map_err(|_| Error::StoreNotSynced)?
        .map_err(|_| Error::StoreNotSynced)?;
    let existing = scheduled_backups(&ctx.state.backups, &db);
    let now = Timestamp::now();
    let created = db.creation_timestamp().map_or(now, |t| t.0);
    let keep_last = spec
        .retention
        .as_ref()
        .map(|r| usize::try_from(r.keep_last).unwrap_or(1).max(1));
    let plan = plan(&schedule, &name, created, now, &existing, keep_last);
    if let (Some(metrics), Some(interval)) = (ctx.metrics.backup(), schedule.interval_after(now)) {
        metrics.set_schedule_interval(&namespace, &name, interval);
    }

    let api: Api<Backup> = Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    if let Some(take) = &plan.take {
        create(&ctx, &db, &api, take).await?;
    }
    if let Some(busy) = &plan.waiting_for {
        tracing::info!(backup = %busy, "a slot is due; waiting for the unfinished scheduled Backup first");
    }
    for prune in &plan.prune {
        delete(&ctx, &db, &api, prune, keep_last.unwrap_or_default()).await?;
    }
    let pruned: Vec<&str> = plan.prune.iter().map(|p| p.uid.as_str()).collect();
    let want_owned = deleted_with(&db);
    for b in existing
        .iter()
        .filter(|b| !b.deleting && b.owned_by_database != want_owned)
        .filter(|b| !pruned.contains(&b.uid.as_str()))
    {
        set_owner(&ctx, &db, &api, b, want_owned).await?;
    }
    Ok(match plan.next {
        Some(next) => Action::requeue(until(now, next)),
        None => Action::await_change(),
    })
}

/// How long from `now` until `next`, at most [`MAX_WAIT`].
fn until(now: Timestamp, next: Timestamp) -> Duration {
    Duration::try_from(next.duration_since(now))
        .unwrap_or(Duration::ZERO)
        .min(MAX_WAIT)
}

/// Creates the slot's Backup; one that exists already (another replica, an earlier
/// reconcile that stopped before it saw its own write) is success.
async fn create(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    take: &Take,
) -> Result<(), Error> {
    match api
        .create(&PostParams::default(), &desired_backup(db, take))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {
            tracing::debug!(backup = %take.name, "the slot's Backup exists already");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    }
    tracing::info!(backup = %take.name, slot = %take.slot, skipped = take.skipped, "scheduled Backup created");
    if take.skipped > 0 {
        let counted = if take.skipped >= MAX_COUNTED {
            "at least "
        } else {
            ""
        };
        let plural = if take.skipped == 1 { "" } else { "s" };
        publish(
            ctx,
            db,
            true,
            "SlotsSkipped",
            &format!(
                "skipped {counted}{} slot{plural} that passed while no controller ran; one catch-up Backup {} for the latest slot {}",
                take.skipped, take.name, take.slot
            ),
        )
        .await;
    }
    publish(
        ctx,
        db,
        true,
        "BackupScheduled",
        &format!("created Backup {} for the slot {}", take.name, take.slot),
    )
    .await;
    Ok(())
}

/// Deletes a Backup retention prunes (its finalizer removes the artifact when its
/// policy is Delete); one already gone, or replaced by another of the same name, is
/// left alone.
async fn delete(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    prune: &Prune,
    keep: usize,
) -> Result<(), Error> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(prune.uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&prune.name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    tracing::info!(backup = %prune.name, keep, "pruned by retention");
    publish(
        ctx,
        db,
        true,
        "BackupPruned",
        &format!(
            "deleted Backup {} (retention keepLast {keep}): {}",
            prune.name, prune.why
        ),
    )
    .await;
    Ok(())
}

/// Gives a scheduled Backup an owner reference to its Database, or takes it away, after
/// `onDatabaseDeletion` changed. The Backup's other owner references stay.
async fn set_owner(
    ctx: &Context<State>,
    db: &Database,
    api: &Api<Backup>,
    backup: &Scheduled,
    owned: bool,
) -> Result<(), Error> {
    let Some(current) = ctx
        .state
        .backups
        .state()
        .into_iter()
        .find(|b| b.uid().as_deref() == Some(backup.uid.as_str()))
    else {
        return Ok(());
    };
    let uid = db.uid().unwrap_or_default();
    let mut owners: Vec<OwnerReference> = current
        .owner_references()
        .iter()
        .filter(|o| o.uid != uid)
        .cloned()
        .collect();
    if owned {
        owners.extend(database_owner(db));
    }
    // The resourceVersion makes a stale view fail (409) instead of dropping an owner.
    let patch = serde_json::json!({"metadata": {
        "resourceVersion": current.resource_version(),
        "ownerReferences": owners,
    }});
    match api
        .patch(&backup.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    tracing::info!(backup = %backup.name, owned, "owner reference to the Database changed");
    Ok(())
}

async fn publish(ctx: &Context<State>, db: &Database, normal: bool, reason: &str, note: &str) {
    dbops_shared::events::publish(&ctx.state.recorder, db, normal, "Schedule", reason, note).await;
}

/// The scheduled Backups (by label, into `store`'s reflector), each mapped to the
/// Database its label names: a Backup that finishes or goes brings retention and the next
/// slot back to its Database.
pub fn watches(
    c: Controller<Database>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    writer: reflector::store::Writer<Backup>,
) -> Controller<Database> {
    let backups: Api<Backup> = controller::scoped_api(ctx.client.clone(), namespace);
    let watch = watcher(backups, watcher::Config::default().labels(SCHEDULE_OF))
        .default_backoff()
        // The store keeps what the plan reads; managedFields is most of an object.
        .modify(|b| b.managed_fields_mut().clear());
    let stream = reflector::reflector(writer, watch).touched_objects();
    c.watches_stream(stream, |b: Backup| {
        let ns = b.namespace()?;
        let db = b.labels().get(SCHEDULE_OF)?;
        Some(reflector::ObjectRef::new(db).within(&ns))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn every_minute() -> Schedule {
        parse_schedule("* * * * *").unwrap()
    }

    fn scheduled(name: &str, slot: &str, phase: Option<BackupPhase>) -> Scheduled {
        Scheduled {
            name: name.to_string(),
            uid: format!("uid-{name}"),
            slot: at(slot),
            phase,
            deleting: false,
            owned_by_database: false,
        }
    }

    const COMPLETED: Option<BackupPhase> = Some(BackupPhase::Completed);
    const FAILED: Option<BackupPhase> = Some(BackupPhase::Failed);
    const RUNNING: Option<BackupPhase> = Some(BackupPhase::Running);

    #[test]
    fn five_fields_and_macros_parse_and_other_shapes_do_not() {
        for ok in [
            "* * * * *",
            "0 3 * * *",
            "*/15 * * * MON-FRI",
            "@daily",
            "@midnight",
            "@hourly",
            "@weekly",
            "@monthly",
            "@yearly",
            "@annually",
        ] {
            assert!(parse_schedule(ok).is_ok(), "{ok}");
        }
        for bad in [
            "* * * *",
            "0 * * * * *",
            "61 * * * *",
            "0 25 * * *",
            "@every-minute",
            "0 0 30 2 *",
            "",
        ] {
            assert!(parse_schedule(bad).is_err(), "{bad}");
        }
        let midnight = parse_schedule("@midnight").unwrap();
        assert_eq!(
            midnight.latest_at_or_before(at("2026-11-22T16:11:20Z")),
            Some(at("2026-11-22T00:00:00Z"))
        );
    }

    #[test]
    fn the_slot_is_the_latest_scheduled_time_at_or_before_now_in_utc() {
        let s = parse_schedule("0 3 * * *").unwrap();
        assert_eq!(
            s.latest_at_or_before(at("2026-11-22T16:11:20.5Z")),
            Some(at("2026-11-22T03:00:00Z"))
        );
        assert_eq!(
            s.latest_at_or_before(at("2026-11-22T03:00:00Z")),
            Some(at("2026-11-22T03:00:00Z"))
        );
        assert_eq!(
            s.latest_at_or_before(at("2026-11-22T02:59:59.9Z")),
            Some(at("2026-11-21T03:00:00Z"))
        );
        assert_eq!(
            s.next_after(at("2026-11-22T03:00:00Z")),
            Some(at("2026-11-23T03:00:00Z"))
        );
        let m = every_minute();
        assert_eq!(
            m.latest_at_or_before(at("2026-11-22T16:11:59.999Z")),
            Some(at("2026-11-22T16:11:00Z"))
        );
        assert_eq!(
            m.count_between(at("2026-11-22T16:00:00Z"), at("2026-11-22T16:03:00Z")),
            2
        );
        assert_eq!(
            m.count_between(at("2026-11-22T16:00:00Z"), at("2026-11-22T16:01:00Z")),
            0
        );
    }

    #[test]
    fn names_come_from_the_slot_and_long_database_names_are_refused() {
        assert_eq!(
            backup_name("orders", at("2026-11-22T03:07:00Z")),
            "orders-202611220307"
        );
        assert!(check_name(&"a".repeat(63)).is_ok());
        let error = check_name(&"a".repeat(64)).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert!(error.to_string().contains("64 characters"), "{error}");
    }

    #[test]
    fn the_first_slot_is_not_before_the_database_existed() {
        let created = at("2026-11-22T16:00:30Z");
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:00:50Z"),
            &[],
            None,
        );
        assert_eq!(p.take, None, "no backfill before the Database existed");
        assert_eq!(p.next, Some(at("2026-11-22T16:01:00Z")));
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:01:00.2Z"),
            &[],
            None,
        );
        let take = p.take.unwrap();
        assert_eq!(
            (take.name.as_str(), take.skipped),
            ("orders-202611221601", 0)
        );
        // A Database created exactly on a slot gets that slot.
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:00Z"),
            at("2026-11-22T16:00:10Z"),
            &[],
            None,
        );
        assert_eq!(p.take.unwrap().name, "orders-202611221600");
    }

    #[test]
    fn after_downtime_only_the_latest_slot_is_taken_and_the_others_are_counted() {
        let existing = [scheduled(
            "orders-202611221601",
            "2026-11-22T16:01:00Z",
            COMPLETED,
        )];
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:30Z"),
            at("2026-11-22T16:03:05Z"),
            &existing,
            None,
        );
        let take = p.take.unwrap();
        assert_eq!(take.name, "orders-202611221603");
        assert_eq!(take.slot, at("2026-11-22T16:03:00Z"));
        assert_eq!(take.skipped, 1, "16:02 was skipped");
        assert_eq!(p.next, Some(at("2026-11-22T16:04:00Z")));
    }

    #[test]
    fn a_slot_with_a_backup_or_older_than_the_newest_one_is_not_taken_again() {
        let created = at("2026-11-22T16:00:30Z");
        let existing = [scheduled(
            "orders-202611221603",
            "2026-11-22T16:03:00Z",
            COMPLETED,
        )];
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:03:40Z"),
            &existing,
            None,
        );
        assert_eq!(p.take, None);
        // A replica whose clock lags one minute behind.
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:02:59Z"),
            &existing,
            None,
        );
        assert_eq!(p.take, None);
        // A pruned (deleting) newer Backup still counts.
        let mut deleting = scheduled("orders-202611221604", "2026-11-22T16:04:00Z", COMPLETED);
        deleting.deleting = true;
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:04:30Z"),
            &[deleting],
            None,
        );
        assert_eq!(p.take, None);
    }

    #[test]
    fn an_unfinished_scheduled_backup_holds_the_next_slot_back() {
        let existing = [scheduled(
            "orders-202611221601",
            "2026-11-22T16:01:00Z",
            RUNNING,
        )];
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:30Z"),
            at("2026-11-22T16:02:05Z"),
            &existing,
            Some(1),
        );
        assert_eq!(p.take, None);
        assert_eq!(p.waiting_for.as_deref(), Some("orders-202611221601"));
        let mut no_status = existing[0].clone();
        no_status.phase = None;
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:30Z"),
            at("2026-11-22T16:02:05Z"),
            &[no_status],
            None,
        );
        assert_eq!(p.take, None);
    }

    #[test]
    fn retention_keeps_the_newest_completed_and_never_touches_unfinished_ones() {
        let existing = [
            scheduled("b1", "2026-11-22T16:01:00Z", COMPLETED),
            scheduled("b2", "2026-11-22T16:02:00Z", FAILED),
            scheduled("b3", "2026-11-22T16:03:00Z", COMPLETED),
            scheduled("b4", "2026-11-22T16:04:00Z", COMPLETED),
            scheduled("b5", "2026-11-22T16:05:00Z", FAILED),
            scheduled("b6", "2026-11-22T16:06:00Z", RUNNING),
            scheduled("b0", "2026-11-22T16:00:00Z", None),
        ];
        let names = |keep| {
            retention(&existing, keep)
                .into_iter()
                .map(|p| p.name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(1), ["b3", "b1", "b2"]);
        assert_eq!(names(2), ["b1", "b2"]);
        assert_eq!(
            names(3),
            ["b2"],
            "a Failed one older than the newest Completed goes"
        );
        assert_eq!(names(10), ["b2"]);
        let pruned = retention(&existing, 1);
        assert_eq!(pruned[0].uid, "uid-b3");
        // Already being deleted: not deleted again (no write on converged state).
        let mut deleting = existing.to_vec();
        for b in &mut deleting {
            b.deleting = b.name != "b4";
        }
        assert!(retention(&deleting, 1).is_empty());
        // Only Failed ones and no Completed one: nothing to compare with, all stay.
        let failed = [scheduled("f1", "2026-11-22T16:01:00Z", FAILED)];
        assert!(retention(&failed, 1).is_empty());
        // Without retention nothing is pruned.
        let p = plan(
            &every_minute(),
            "x",
            at("2026-11-22T15:00:00Z"),
            at("2026-11-22T16:06:30Z"),
            &existing,
            None,
        );
        assert!(p.prune.is_empty());
    }

    fn scheduled_database(on_deletion: Option<&str>) -> Database {
        let mut backup = serde_json::json!({"schedule": "* * * * *"});
        if let Some(policy) = on_deletion {
            backup["onDatabaseDeletion"] = policy.into();
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "ns", "uid": "db-uid"},
            "spec": {"serverRef": {"name": "pg"},
                     "backup": backup}
        }))
        .unwrap()
    }

    fn take() -> Take {
        Take {
            slot: at("2026-11-22T16:03:00Z"),
            name: "orders-202611221603".into(),
            skipped: 0,
        }
    }

    #[test]
    fn the_scheduled_backup_is_labelled_pinned_and_outlives_its_database() {
        let db = scheduled_database(None);
        let take = take();
        let b = desired_backup(&db, &take);
        assert_eq!(b.metadata.name.as_deref(), Some("orders-202611221603"));
        assert_eq!(b.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(b.spec.database_ref.name, "orders");
        assert_eq!(b.spec.deletion_policy, BackupDeletionPolicy::Delete);
        assert_eq!(
            b.labels().get(SCHEDULE_OF).map(String::as_str),
            Some("orders")
        );
        assert_eq!(
            b.labels()
                .get("app.kubernetes.io/managed-by")
                .map(String::as_str),
            Some("dbops")
        );
        assert_eq!(
            b.annotations().get(SCHEDULED_AT).map(String::as_str),
            Some("2026-11-22T16:03:00Z")
        );
        assert_eq!(
            b.annotations().get(marks::DATABASE_UID).map(String::as_str),
            Some("db-uid")
        );
        assert!(
            b.owner_references().is_empty(),
            "by default a scheduled Backup is not garbage collected with its Database"
        );
        // The plan reads the slot back from the annotation.
        let mut stored = b.clone();
        stored.metadata.uid = Some("b-uid".into());
        let seen = Scheduled::of(&stored, Some("db-uid"));
        assert_eq!(
            (seen.slot, seen.phase, seen.deleting, seen.owned_by_database),
            (take.slot, None, false, false)
        );
    }

    #[test]
    fn with_on_database_deletion_delete_the_scheduled_backup_is_owned() {
        let db = scheduled_database(Some("Delete"));
        let b = desired_backup(&db, &take());
        let owner = &b.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Database", "db-uid")
        );
        assert_eq!(
            (owner.controller, owner.block_owner_deletion),
            (Some(true), Some(true))
        );
        let mut stored = b.clone();
        stored.metadata.uid = Some("b-uid".into());
        assert!(Scheduled::of(&stored, Some("db-uid")).owned_by_database);
        assert!(!Scheduled::of(&stored, Some("other-uid")).owned_by_database);
    }

    #[test]
    fn the_requeue_waits_for_the_next_slot_and_at_most_an_hour() {
        assert_eq!(
            until(at("2026-11-22T16:03:40Z"), at("2026-11-22T16:04:00Z")),
            Duration::from_secs(20)
        );
        assert_eq!(
            until(at("2026-11-22T16:03:40Z"), at("2026-11-23T03:00:00Z")),
            MAX_WAIT
        );
        assert_eq!(
            until(at("2026-11-22T16:05:00Z"), at("2026-11-22T16:04:00Z")),
            Duration::ZERO
        );
    }

    #[tokio::test]
    async fn an_invalid_spec_is_reported_once_per_generation() {
        let (store, _writer) = reflector::store::<Backup>();
        let (service, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let client = kube::Client::new(service, "default");
        let reporter = dbops_shared::controller::reporter(CONTROLLER);
        let state = State::new(store, Recorder::new(client, reporter));
        assert!(state.first_warning("u", Some(1)));
        assert!(!state.first_warning("u", Some(1)));
        assert!(state.first_warning("u", Some(2)));
        state.valid_again("u");
        assert!(state.first_warning("u", Some(2)));
    }
}
