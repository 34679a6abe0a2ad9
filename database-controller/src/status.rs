//! The Database status: [`desired`] derives it from a reconcile's outcome (pure, as is
//! [`deleting`] for a deletion that cannot finish yet), with the Events the change from
//! the latest status implies; [`publish`] writes it through the shared status path
//! (`dbops_shared::status`: written only when it differs from the latest one, the uid a
//! precondition, the Events once written). What a reason does to the status is its
//! class (`dbops_api::reasons::DatabaseReason`).

use dbops_api::reasons::{DatabaseReason, ReasonClass};
use dbops_api::{Database, DatabasePhase, DatabaseStatus, condition};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, get, now, set_condition};
use dbops_shared::controller::Context;
use dbops_shared::status::{Desired, Guard, Note, Write};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::api::Api;

use crate::error::{Error, Result};
use crate::live::status_write_gone;
use crate::rotation;
use crate::state::{Provisioned, State};

/// The action the Database's Events name.
const ACTION: &str = "Reconcile";

/// Where the database was created, once it was.
pub fn provider_id(db: &Database) -> Option<&str> {
    db.status.as_ref()?.provider_id.as_deref()
}

/// The class of a reason stored in a condition (`None`: not a Database reason).
fn class_of(stored: &str) -> Option<ReasonClass> {
    DatabaseReason::parse(stored).map(DatabaseReason::class)
}

/// The message for a failure retried with backoff: the one already in status while the
/// reason stays the same (an outage's details vary from one attempt to the next, a
/// connection refused or reset, and the status is written once per outage, not per
/// retry); the new one otherwise.
fn sticky_message(old: &DatabaseStatus, reason: DatabaseReason, message: String) -> String {
    match get(&old.conditions, condition::READY) {
        Some(c)
            if reason.class() == ReasonClass::Retried
                && c.status == "False"
                && c.reason == reason =>
        {
            c.message.clone()
        }
        _ => message,
    }
}

/// The condition a Database has while its server sets `limits.databaseSize`: True above.
pub const SIZE_EXCEEDED: &str = "SizeExceeded";

/// The size to report: the one in status until the database has grown or shrunk by 5 %
/// or more, or crossed `limit` (a status write per resync for a few bytes more would cost
/// the API a write per Database per resync); the metric has the exact size.
pub fn reported_size(old: Option<i64>, now: i64, limit: Option<i64>) -> i64 {
    let Some(old) = old else {
        return now;
    };
    let crossed = limit.is_some_and(|l| (old > l) != (now > l));
    let moved = (now - old).unsigned_abs() * 20 >= old.unsigned_abs().max(1);
    if crossed || moved { now } else { old }
}

/// The conditions of one generation, all stamped `t`.
struct Conditions<'a> {
    list: &'a mut Vec<Condition>,
    generation: Option<i64>,
    t: Time,
}

impl Conditions<'_> {
    fn set(
        &mut self,
        type_: &str,
        status: ConditionStatus,
        reason: DatabaseReason,
        message: String,
    ) {
        set_condition(
            self.list,
            ConditionSpec {
                type_,
                status,
                reason: reason.as_str(),
                message,
                observed_generation: self.generation,
            },
            self.t.clone(),
        );
    }
}

/// The status a provisioning outcome asks for, built on `old` (the latest status) at time
/// `t`, and the Events the change implies. `migration` is the Migration of this Database
/// that has not ended.
pub fn desired(
    db: &Database,
    old: &DatabaseStatus,
    outcome: &Result<Provisioned>,
    migration: Option<&str>,
    t: Time,
) -> Desired<DatabaseStatus> {
    let mut new = old.clone();
    new.observed_generation = db.metadata.generation;
    new.database_name = Some(db.database_name());
    new.expires_at = db.expires_at().ok().flatten().map(Time);
    match outcome {
        Ok(p) => provisioned(db, old, &mut new, p, t.clone()),
        Err(e) => failed(old, &mut new, e, db.metadata.generation, t.clone()),
    }
    let mut conditions = Conditions {
        list: &mut new.conditions,
        generation: db.metadata.generation,
        t,
    };
    match migration {
        Some(m) => conditions.set(
            condition::MIGRATION_IN_PROGRESS,
            ConditionStatus::True,
            DatabaseReason::MigrationRunning,
            format!("Migration {m} is moving this database; its freeze is not drift"),
        ),
        None => conditions.set(
            condition::MIGRATION_IN_PROGRESS,
            ConditionStatus::False,
            DatabaseReason::NoMigration,
            "no Migration is running".into(),
        ),
    }
    with_events(old, new)
}

/// Ready: where the database is, its size and logins, and the conditions that say so.
fn provisioned(
    db: &Database,
    old: &DatabaseStatus,
    new: &mut DatabaseStatus,
    p: &Provisioned,
    t: Time,
) {
    new.phase = Some(DatabasePhase::Ready);
    new.server = Some(p.server.clone());
    new.provider_id = Some(p.provider_id.clone());
    new.endpoint = Some(p.endpoint.clone());
    new.connection_secret = Some(db.connection_secret_name());
    new.server_version = Some(p.server_version.clone());
    new.size_bytes = Some(reported_size(old.size_bytes, p.size_bytes, p.size_limit));
    new.login = Some(p.logins.login.clone());
    new.previous_login = p.logins.previous.as_ref().map(|(l, _)| l.clone());
    new.rotation = rotation::record(
        p.logins.previous.as_ref(),
        p.logins.last_rotation.clone(),
        p.logins.rotate_request.clone(),
    );
    let mut conditions = Conditions {
        list: &mut new.conditions,
        generation: db.metadata.generation,
        t,
    };
    size_condition(&mut conditions, p);
    let msg = format!(
        "database {} on DatabaseServer {} ({}) is ready; connect with Secret {}",
        db.database_name(),
        p.server,
        p.endpoint,
        db.connection_secret_name()
    );
    conditions.set(
        condition::READY,
        ConditionStatus::True,
        DatabaseReason::Provisioned,
        msg,
    );
    conditions.set(
        condition::PROGRESSING,
        ConditionStatus::False,
        DatabaseReason::Provisioned,
        "nothing left to do".into(),
    );
    conditions.set(
        condition::DEGRADED,
        ConditionStatus::False,
        DatabaseReason::AsExpected,
        "the database is as specified".into(),
    );
}

/// SizeExceeded while the server sets `limits.databaseSize` (True above it); none else.
fn size_condition(conditions: &mut Conditions<'_>, p: &Provisioned) {
    let Some(limit) = p.size_limit else {
        conditions.list.retain(|c| c.type_ != SIZE_EXCEEDED);
        return;
    };
    let over = p.size_bytes > limit;
    let message = format!(
        "the database takes {} bytes; DatabaseServer {}'s limits.databaseSize is {limit} bytes{}",
        p.size_bytes,
        p.server,
        if over {
            " (reported, not enforced)"
        } else {
            ""
        }
    );
    if over {
        conditions.set(
            SIZE_EXCEEDED,
            ConditionStatus::True,
            DatabaseReason::SizeExceeded,
            message,
        );
    } else {
        conditions.set(
            SIZE_EXCEEDED,
            ConditionStatus::False,
            DatabaseReason::WithinLimit,
            message,
        );
    }
}

/// Not Ready: the phase and conditions a failure's reason calls for. Its class: a
/// `Retried` reason is retried with backoff (`Progressing=True`, reason `Retrying`), a
/// `Progressing` one is a step on the way (a restore), any other waits for a change
/// (phase `Failed`); one that [`degrades`](DatabaseReason::degrades) a Database
/// provisioned before makes it `Degraded`.
fn failed(
    old: &DatabaseStatus,
    new: &mut DatabaseStatus,
    e: &Error,
    generation: Option<i64>,
    t: Time,
) {
    let reason = e.database_reason();
    let message = sticky_message(old, reason, e.to_string());
    let provisioned_before = old.provider_id.is_some();
    let degraded = provisioned_before && reason.degrades();
    new.phase = Some(match reason.class() {
        _ if degraded => DatabasePhase::Degraded,
        ReasonClass::Retried | ReasonClass::Progressing => DatabasePhase::Provisioning,
        _ => DatabasePhase::Failed,
    });
    let mut conditions = Conditions {
        list: &mut new.conditions,
        generation,
        t,
    };
    conditions.set(
        condition::READY,
        ConditionStatus::False,
        reason,
        message.clone(),
    );
    match reason.class() {
        ReasonClass::Progressing => conditions.set(
            condition::PROGRESSING,
            ConditionStatus::True,
            reason,
            message.clone(),
        ),
        ReasonClass::Retried => conditions.set(
            condition::PROGRESSING,
            ConditionStatus::True,
            DatabaseReason::Retrying,
            format!("retrying with backoff: {message}"),
        ),
        _ => conditions.set(
            condition::PROGRESSING,
            ConditionStatus::False,
            reason,
            "waiting for the spec, its Secret or the server to change".into(),
        ),
    }
    if degraded {
        conditions.set(condition::DEGRADED, ConditionStatus::True, reason, message);
    } else {
        conditions.set(
            condition::DEGRADED,
            ConditionStatus::False,
            DatabaseReason::AsExpected,
            "no provisioned database is affected".into(),
        );
    }
}

/// The status of a deletion that cannot finish yet (`e` says why), built on `old`, and
/// the Events the change implies.
pub fn deleting(
    db: &Database,
    old: &DatabaseStatus,
    e: &Error,
    t: Time,
) -> Desired<DatabaseStatus> {
    let mut new = old.clone();
    new.phase = Some(DatabasePhase::Deleting);
    new.observed_generation = db.metadata.generation;
    // Every condition speaks of the generation the deletion bumped to.
    for c in &mut new.conditions {
        c.observed_generation = db.metadata.generation;
    }
    let mut conditions = Conditions {
        list: &mut new.conditions,
        generation: db.metadata.generation,
        t,
    };
    conditions.set(
        condition::READY,
        ConditionStatus::False,
        DatabaseReason::Deleting,
        "the Database is being deleted".into(),
    );
    conditions.set(
        condition::PROGRESSING,
        ConditionStatus::True,
        e.database_reason(),
        format!("deleting: {e}"),
    );
    with_events(old, new)
}

/// `new` with the Events the change from `old` implies: Ready's status or reason changed
/// (Normal when True or a step on the way); SizeExceeded turned True (a Warning); while
/// deleting, Progressing's reason changed (waiting for the final Backup is the expected
/// path, a Normal Event; anything else a Warning).
fn with_events(old: &DatabaseStatus, new: DatabaseStatus) -> Desired<DatabaseStatus> {
    let mut notes = Vec::new();
    let note = |normal: bool, c: &Condition| {
        let (reason, message) = (c.reason.clone(), c.message.clone());
        if normal {
            Note::normal(ACTION, reason, message)
        } else {
            Note::warning(ACTION, reason, message)
        }
    };
    let before =
        get(&old.conditions, condition::READY).map(|c| (c.status.clone(), c.reason.clone()));
    if let Some(after) = get(&new.conditions, condition::READY)
        && before.as_ref() != Some(&(after.status.clone(), after.reason.clone()))
    {
        let on_the_way = class_of(&after.reason) == Some(ReasonClass::Progressing);
        notes.push(note(after.status == "True" || on_the_way, after));
    }
    if let Some(size) = get(&new.conditions, SIZE_EXCEEDED)
        && size.status == "True"
        && get(&old.conditions, SIZE_EXCEEDED).is_none_or(|c| c.status != "True")
    {
        notes.push(note(false, size));
    }
    if let Some(progress) = get(&new.conditions, condition::PROGRESSING)
        && new.phase == Some(DatabasePhase::Deleting)
        && get(&old.conditions, condition::PROGRESSING).map(|c| &c.reason) != Some(&progress.reason)
    {
        let expected = class_of(&progress.reason) == Some(ReasonClass::Progressing);
        notes.push(note(expected, progress));
    }
    Desired { status: new, notes }
}

/// Writes the status for a provisioning outcome (nothing for Kubernetes API errors, nor
/// for a reconcile that was abandoned).
pub async fn publish(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    outcome: &Result<Provisioned>,
    migration: Option<&str>,
) -> Result<()> {
    if matches!(outcome, Err(Error::Kube(_) | Error::Superseded(_))) {
        return Ok(());
    }
    let old = ctx.state.statuses.latest(db);
    write(db, ctx, api, desired(db, &old, outcome, migration, now())).await
}

/// Writes the status of a clone under way (`outcome`, its `Cloning` step) with its
/// `status.clone`.
pub async fn publish_clone(
    db: &Database,
    ctx: &Context<State>,
    outcome: &Result<Provisioned>,
    clone: dbops_api::CloneStatus,
) -> Result<()> {
    let api: Api<Database> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    let old = ctx.state.statuses.latest(db);
    let mut desired = desired(db, &old, outcome, None, now());
    desired.status.clone_status = Some(clone);
    write(db, ctx, &api, desired).await
}

/// Writes the status of a deletion that cannot finish yet (`e` says why).
pub async fn publish_deleting(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    e: &Error,
) -> Result<()> {
    let old = ctx.state.statuses.latest(db);
    write(db, ctx, api, deleting(db, &old, e, now())).await
}

/// The shared write, guarded by the uid only: a Database's status is recomputed from
/// PostgreSQL and its Secret each reconcile, so the last write wins. A Database gone or
/// replaced since the reconcile read it abandons the reconcile ([`Error::Superseded`]).
async fn write(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    desired: Desired<DatabaseStatus>,
) -> Result<()> {
    let state = &ctx.state;
    let cache = state.databases.get();
    match state
        .statuses
        .write(api, db, desired, Guard::Uid, &state.recorder, cache)
        .await?
    {
        Write::Unchanged | Write::Written(_) | Write::Conflict => Ok(()),
        Write::Gone => status_write_gone(&ctx.client, db, DatabaseReason::KubernetesApiError).await,
    }
}

/// Publishes an Event about the Database that no status write carries (it is going, or
/// the outcome is not kept in its status), through `dbops_shared::status::announce`;
/// failures are logged, never fatal.
pub async fn event(ctx: &Context<State>, db: &Database, normal: bool, reason: &str, note: &str) {
    let note = Note::of(normal, ACTION, reason, note);
    dbops_shared::status::announce(&ctx.state.recorder, db, &note).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_is_reported_when_it_moves_5_percent_or_crosses_the_limit() {
        assert_eq!(reported_size(None, 1000, None), 1000);
        assert_eq!(reported_size(Some(1000), 1040, None), 1000);
        assert_eq!(reported_size(Some(1000), 1050, None), 1050);
        assert_eq!(reported_size(Some(1000), 940, None), 940);
        assert_eq!(reported_size(Some(1000), 1001, Some(1000)), 1001);
        assert_eq!(reported_size(Some(1001), 1002, Some(1000)), 1001);
    }
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn with_ready(status: &str, reason: &str, message: &str) -> DatabaseStatus {
        DatabaseStatus {
            conditions: vec![Condition {
                type_: condition::READY.into(),
                status: status.into(),
                reason: reason.into(),
                message: message.into(),
                last_transition_time: now(),
                observed_generation: Some(1),
            }],
            ..DatabaseStatus::default()
        }
    }

    #[test]
    fn an_outage_keeps_its_first_message_until_the_reason_changes() {
        let old = with_ready(
            "False",
            "ServerUnreachable",
            "server h:1 is unreachable: refused",
        );
        // The next attempt's detail differs: the status keeps the first.
        assert_eq!(
            sticky_message(
                &old,
                DatabaseReason::ServerUnreachable,
                "server h:1 is unreachable: reset".into()
            ),
            "server h:1 is unreachable: refused"
        );
        // Another reason, or a reason that waits for a change, takes the new message.
        assert_eq!(
            sticky_message(&old, DatabaseReason::AuthenticationFailed, "denied".into()),
            "denied"
        );
        let blocked = with_ready("False", "NameConflict", "old");
        assert_eq!(
            sticky_message(&blocked, DatabaseReason::NameConflict, "new".into()),
            "new"
        );
        // After Ready, a new outage gets its own message.
        let ready = with_ready("True", "Provisioned", "ready");
        assert_eq!(
            sticky_message(&ready, DatabaseReason::ServerUnreachable, "refused".into()),
            "refused"
        );
    }

    fn database() -> Database {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u-1", "generation": 2},
            "spec": {"serverRef": {"name": "pg-main"}}
        }))
        .unwrap()
    }

    fn ready_on(size_bytes: i64, size_limit: Option<i64>) -> Provisioned {
        Provisioned {
            provider_id: "pg.example:5432/16384".into(),
            server_version: "17.2".into(),
            server: "pg-main".into(),
            endpoint: "pg.example:5432".into(),
            size_bytes,
            size_limit,
            logins: crate::owner_logins::Logins {
                login: "orders_owner".into(),
                ..Default::default()
            },
        }
    }

    /// The status after a provisioning that worked (`size_bytes` of `size_limit`), from `old`.
    fn ready_from(
        db: &Database,
        old: &DatabaseStatus,
        size_bytes: i64,
        size_limit: Option<i64>,
    ) -> Desired<DatabaseStatus> {
        desired(db, old, &Ok(ready_on(size_bytes, size_limit)), None, now())
    }

    fn condition_of<'a>(s: &'a DatabaseStatus, type_: &str) -> (&'a str, &'a str) {
        let c = get(&s.conditions, type_).unwrap_or_else(|| panic!("no {type_}"));
        (c.status.as_str(), c.reason.as_str())
    }

    /// Each condition's (status, reason), named by its type when it differs.
    fn assert_conditions<const N: usize>(s: &DatabaseStatus, want: [(&str, (&str, &str)); N]) {
        for (type_, want) in want {
            assert_eq!(condition_of(s, type_), want, "{type_}");
        }
    }

    fn reasons(d: &Desired<DatabaseStatus>) -> Vec<(bool, &str)> {
        d.notes
            .iter()
            .map(|n| (n.normal, n.reason.as_str()))
            .collect()
    }

    #[test]
    fn a_provisioned_database_is_ready_with_one_normal_event_and_none_when_nothing_changes() {
        let db = database();
        let old = DatabaseStatus::default();
        let new = ready_from(&db, &old, 1000, None);
        let s = &new.status;
        assert_eq!(s.phase, Some(DatabasePhase::Ready));
        assert_eq!(s.observed_generation, Some(2));
        assert_eq!(s.provider_id.as_deref(), Some("pg.example:5432/16384"));
        assert_eq!(s.connection_secret.as_deref(), Some("orders-connection"));
        assert_eq!(s.login.as_deref(), Some("orders_owner"));
        assert_conditions(
            s,
            [
                (condition::READY, ("True", "Provisioned")),
                (condition::PROGRESSING, ("False", "Provisioned")),
                (condition::DEGRADED, ("False", "AsExpected")),
                (condition::MIGRATION_IN_PROGRESS, ("False", "NoMigration")),
            ],
        );
        assert!(get(&new.status.conditions, SIZE_EXCEEDED).is_none());
        assert_eq!(reasons(&new), [(true, "Provisioned")]);
        // The next reconcile finds the same: the same status, no Event.
        let again = ready_from(&db, &new.status, 1001, None);
        assert_eq!(again.status, new.status);
        assert!(again.notes.is_empty());
    }

    #[test]
    fn a_database_over_its_size_limit_is_reported_once_with_a_warning() {
        let db = database();
        let within = ready_from(&db, &DatabaseStatus::default(), 900, Some(1000));
        assert_eq!(
            condition_of(&within.status, SIZE_EXCEEDED),
            ("False", "WithinLimit")
        );
        let over = ready_from(&db, &within.status, 1100, Some(1000));
        assert_eq!(
            condition_of(&over.status, SIZE_EXCEEDED),
            ("True", "SizeExceeded")
        );
        assert_eq!(over.status.size_bytes, Some(1100));
        assert_eq!(reasons(&over), [(false, "SizeExceeded")]);
        // The limit lifted: the condition goes.
        let lifted = ready_from(&db, &over.status, 1100, None);
        assert!(get(&lifted.status.conditions, SIZE_EXCEEDED).is_none());
    }

    #[test]
    fn a_failure_is_degraded_retrying_on_the_way_or_failed_by_its_reason() {
        let db = database();
        let ready = desired(
            &db,
            &DatabaseStatus::default(),
            &Ok(ready_on(1, None)),
            Some("orders-move"),
            now(),
        );
        assert_eq!(
            condition_of(&ready.status, condition::MIGRATION_IN_PROGRESS),
            ("True", "MigrationRunning")
        );
        let unreachable = Err(Error::reported(
            DatabaseReason::ServerUnreachable,
            "server pg.example:5432 is unreachable",
        ));
        // Provisioned before: it worked and is broken now.
        let degraded = desired(&db, &ready.status, &unreachable, None, now());
        assert_eq!(degraded.status.phase, Some(DatabasePhase::Degraded));
        assert_conditions(
            &degraded.status,
            [
                (condition::DEGRADED, ("True", "ServerUnreachable")),
                (condition::PROGRESSING, ("True", "Retrying")),
            ],
        );
        assert_eq!(reasons(&degraded), [(false, "ServerUnreachable")]);
        // Never provisioned: on its way (retried), not degraded.
        let fresh = DatabaseStatus::default();
        let retrying = desired(&db, &fresh, &unreachable, None, now());
        assert_eq!(retrying.status.phase, Some(DatabasePhase::Provisioning));
        assert_eq!(
            condition_of(&retrying.status, condition::DEGRADED),
            ("False", "AsExpected")
        );
        // (reason, message, phase, Progressing, whether its Event is Normal)
        let blocked = [
            // A restore's wait is a step on the way: Progressing, a Normal Event.
            (
                "WaitingForBackup",
                "waiting for Backup shop/nightly to complete before restoring",
                DatabasePhase::Provisioning,
                "True",
                true,
            ),
            // Blocked until something changes: Failed, not progressing.
            (
                "NameConflict",
                "role \"orders_owner\" already exists",
                DatabasePhase::Failed,
                "False",
                false,
            ),
        ];
        for (reason, message, phase, progressing, normal) in blocked {
            let typed = DatabaseReason::parse(reason).expect("a Database reason");
            let outcome = Err(Error::reported(typed, message));
            let d = desired(&db, &fresh, &outcome, None, now());
            assert_eq!(d.status.phase, Some(phase), "{reason}");
            assert_eq!(
                condition_of(&d.status, condition::PROGRESSING),
                (progressing, reason)
            );
            assert_eq!(reasons(&d), [(normal, reason)]);
        }
    }

    #[test]
    fn a_deletion_that_waits_says_why_once_per_reason() {
        let db = database();
        let ready = ready_from(&db, &DatabaseStatus::default(), 1, None);
        let waiting = Error::reported(
            DatabaseReason::WaitingForFinalBackup,
            "waiting for the final Backup orders-final-u1 to be Ready",
        );
        let deleting_ = deleting(&db, &ready.status, &waiting, now());
        assert_eq!(deleting_.status.phase, Some(DatabasePhase::Deleting));
        assert_conditions(
            &deleting_.status,
            [
                (condition::READY, ("False", "Deleting")),
                (condition::PROGRESSING, ("True", "WaitingForFinalBackup")),
            ],
        );
        assert!(
            deleting_
                .status
                .conditions
                .iter()
                .all(|c| c.observed_generation == Some(2))
        );
        assert_eq!(
            reasons(&deleting_),
            [(true, "Deleting"), (true, "WaitingForFinalBackup")]
        );
        let conflict = Error::reported(
            DatabaseReason::FinalSnapshotConflict,
            "Backup orders-final-u1 was not made as the final snapshot",
        );
        let blocked = deleting(&db, &deleting_.status, &conflict, now());
        assert_eq!(reasons(&blocked), [(false, "FinalSnapshotConflict")]);
    }

    /// What the status says and what the controller does agree: `Progressing=True` with
    /// reason `Retrying` exactly when the error policy retries with backoff. An API error
    /// and an internal one were retried while the status said the Database waited for a
    /// change (phase `Failed`).
    #[test]
    fn the_status_says_retrying_exactly_when_the_controller_retries() {
        use dbops_shared::controller::{ErrorKind, ReconcileError};
        let db = database();
        let fresh = DatabaseStatus::default();
        let api = || {
            let e = serde_json::from_str::<u8>("x").unwrap_err();
            Error::Kube(kube::Error::SerdeError(e))
        };
        let mut cases = vec![api(), Error::Internal("unexpected".into())];
        // Every reason a failure can carry (not the calm ones, nor `Ready`'s).
        cases.extend(
            DatabaseReason::ALL
                .iter()
                .filter(|r| !matches!(r.class(), ReasonClass::Ready | ReasonClass::Nominal))
                .map(|r| Error::reported(*r, "m")),
        );
        for e in cases {
            let retried = e.kind() == ErrorKind::Transient;
            let d = desired(&db, &fresh, &Err(e), None, now());
            let says = condition_of(&d.status, condition::PROGRESSING) == ("True", "Retrying");
            assert_eq!(says, retried, "{:?}", d.status.conditions);
        }
    }
}
