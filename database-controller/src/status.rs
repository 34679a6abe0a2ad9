//! The Database status derived from a reconcile's outcome: written only when it differs
//! from what is stored, with an Event for every change of the Ready condition.

use dbops_api::{Database, DatabasePhase, DatabaseStatus, condition};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, get, now, set_condition};
use dbops_shared::controller::{Context, ReconcileError};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::error::{Error, Result};
use crate::reconcile::{Provisioned, State};

/// Where the database was created, once it was.
pub fn provider_id(db: &Database) -> Option<&str> {
    db.status.as_ref()?.provider_id.as_deref()
}

/// Reasons that mean "it worked before and is broken now".
fn degrades(reason: &str) -> bool {
    matches!(
        reason,
        "ServerUnreachable"
            | "DatabaseMissing"
            | "SqlError"
            | "AuthenticationFailed"
            | "CertificateNotTrusted"
            | "HostnameMismatch"
            | "ServerWithoutTLS"
    )
}

/// Reasons retried by backoff rather than waiting for a change.
fn retrying(reason: &str) -> bool {
    matches!(
        reason,
        "ServerUnreachable"
            | "CacheNotSynced"
            | "LockTimeout"
            | "StatementTimeout"
            | "SqlError"
            | "RestoreFailed"
            | "StoreUnavailable"
            | "CertificateNotTrusted"
            | "HostnameMismatch"
            | "ServerWithoutTLS"
    )
}

/// The message for a failure retried with backoff: the one already in status while the
/// reason stays the same (an outage's details vary from one attempt to the next, a
/// connection refused or reset, and the status is written once per outage, not per
/// retry); the new one otherwise.
fn sticky_message(old: &DatabaseStatus, reason: &str, message: String) -> String {
    match get(&old.conditions, condition::READY) {
        Some(c) if retrying(reason) && c.status == "False" && c.reason == reason => {
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

/// Reasons that are steps on the expected way to Ready (a restore).
pub fn on_the_way(reason: &str) -> bool {
    matches!(reason, "WaitingForBackup" | "Restoring")
}

/// Writes the status for a provisioning outcome (nothing for Kubernetes API errors).
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
    let old = ctx.state.written.latest(db);
    let mut new = old.clone();
    let generation = db.metadata.generation;
    let t = now();
    let cond = |type_, status: ConditionStatus, reason, message: String| ConditionSpec {
        type_,
        status,
        reason,
        message,
        observed_generation: generation,
    };
    new.observed_generation = generation;
    new.database_name = Some(db.database_name());
    match outcome {
        Ok(p) => {
            new.phase = Some(DatabasePhase::Ready);
            new.server = Some(p.server.clone());
            new.provider_id = Some(p.provider_id.clone());
            new.endpoint = Some(p.endpoint.clone());
            new.connection_secret = Some(db.connection_secret_name());
            new.server_version = Some(p.server_version.clone());
            new.size_bytes = Some(reported_size(old.size_bytes, p.size_bytes, p.size_limit));
            new.login = Some(p.logins.login.clone());
            new.previous_login = p.logins.previous.as_ref().map(|(l, _)| l.clone());
            new.previous_valid_until = p.logins.previous.as_ref().and_then(|(_, until)| {
                jiff::Timestamp::from_second(*until as i64)
                    .ok()
                    .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time)
            });
            new.last_rotation = p.logins.last_rotation.clone();
            new.rotate_request = p.logins.rotate_request.clone();
            match p.size_limit {
                Some(limit) => {
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
                    set_condition(
                        &mut new.conditions,
                        if over {
                            cond(
                                SIZE_EXCEEDED,
                                ConditionStatus::True,
                                "SizeExceeded",
                                message,
                            )
                        } else {
                            cond(
                                SIZE_EXCEEDED,
                                ConditionStatus::False,
                                "WithinLimit",
                                message,
                            )
                        },
                        t.clone(),
                    );
                }
                None => new.conditions.retain(|c| c.type_ != SIZE_EXCEEDED),
            }
            let msg = format!(
                "database {} on DatabaseServer {} ({}) is ready; connect with Secret {}",
                db.database_name(),
                p.server,
                p.endpoint,
                db.connection_secret_name()
            );
            set_condition(
                &mut new.conditions,
                cond(condition::READY, ConditionStatus::True, "Provisioned", msg),
                t.clone(),
            );
            set_condition(
                &mut new.conditions,
                cond(
                    condition::PROGRESSING,
                    ConditionStatus::False,
                    "Provisioned",
                    "nothing left to do".into(),
                ),
                t.clone(),
            );
            set_condition(
                &mut new.conditions,
                cond(
                    condition::DEGRADED,
                    ConditionStatus::False,
                    "AsExpected",
                    "the database is as specified".into(),
                ),
                t.clone(),
            );
        }
        Err(e) => {
            let reason = e.reason();
            let message = sticky_message(&old, reason, e.to_string());
            let provisioned_before = old.provider_id.is_some();
            let degraded = provisioned_before && degrades(reason);
            new.phase = Some(if degraded {
                DatabasePhase::Degraded
            } else if retrying(reason) || on_the_way(reason) {
                DatabasePhase::Provisioning
            } else {
                DatabasePhase::Failed
            });
            set_condition(
                &mut new.conditions,
                cond(
                    condition::READY,
                    ConditionStatus::False,
                    reason,
                    message.clone(),
                ),
                t.clone(),
            );
            set_condition(
                &mut new.conditions,
                if on_the_way(reason) {
                    cond(
                        condition::PROGRESSING,
                        ConditionStatus::True,
                        reason,
                        message.clone(),
                    )
                } else if retrying(reason) {
                    cond(
                        condition::PROGRESSING,
                        ConditionStatus::True,
                        "Retrying",
                        format!("retrying with backoff: {message}"),
                    )
                } else {
                    cond(
                        condition::PROGRESSING,
                        ConditionStatus::False,
                        reason,
                        "waiting for the spec, its Secret or the server to change".into(),
                    )
                },
                t.clone(),
            );
            set_condition(
                &mut new.conditions,
                if degraded {
                    cond(condition::DEGRADED, ConditionStatus::True, reason, message)
                } else {
                    cond(
                        condition::DEGRADED,
                        ConditionStatus::False,
                        "AsExpected",
                        "no provisioned database is affected".into(),
                    )
                },
                t.clone(),
            );
        }
    }
    set_condition(
        &mut new.conditions,
        match migration {
            Some(m) => cond(
                condition::MIGRATION_IN_PROGRESS,
                ConditionStatus::True,
                "MigrationRunning",
                format!("Migration {m} is moving this database; its freeze is not drift"),
            ),
            None => cond(
                condition::MIGRATION_IN_PROGRESS,
                ConditionStatus::False,
                "NoMigration",
                "no Migration is running".into(),
            ),
        },
        t,
    );
    write(db, ctx, api, &old, new).await
}

/// Writes the status of a deletion that cannot finish yet.
pub async fn publish_deleting(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    outcome: &Result<()>,
) -> Result<()> {
    let Err(e) = outcome else { return Ok(()) };
    let old = ctx.state.written.latest(db);
    let mut new = old.clone();
    new.phase = Some(DatabasePhase::Deleting);
    new.observed_generation = db.metadata.generation;
    let t = now();
    // Every condition speaks of the generation the deletion bumped to.
    for c in &mut new.conditions {
        c.observed_generation = db.metadata.generation;
    }
    set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::READY,
            status: ConditionStatus::False,
            reason: "Deleting",
            message: "the Database is being deleted".into(),
            observed_generation: db.metadata.generation,
        },
        t.clone(),
    );
    set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::PROGRESSING,
            status: ConditionStatus::True,
            reason: e.reason(),
            message: format!("deleting: {e}"),
            observed_generation: db.metadata.generation,
        },
        t,
    );
    write(db, ctx, api, &old, new).await
}

async fn write(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    old: &DatabaseStatus,
    new: DatabaseStatus,
) -> Result<()> {
    if &new == old || ctx.state.written.is_current(db, &new) {
        return Ok(());
    }
    // The UID is a precondition: a Database deleted and created again with the same name
    // since the reconcile read it never gets this one's status. (A merge patch's
    // `metadata.uid` is not one on the status subresource: the apiserver takes the
    // metadata from the stored object there; a JSON patch's test is checked against it.)
    let patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": db.uid().unwrap_or_default()},
        {"op": "add", "path": "/status", "value": new},
    ]))
    .map_err(|e| Error::Internal(format!("building the status patch: {e}")))?;
    let written = api
        .patch_status(
            &db.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await;
    match written {
        Ok(_) => {}
        // Gone (404), or the test failed (422): is it still the live one?
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 422 => {
            crate::reconcile::confirm_live(ctx, db).await?;
            return Err(kube::Error::Api(e).into());
        }
        Err(e) => return Err(e.into()),
    }
    ctx.state
        .written
        .record(db, &new, ctx.state.databases.get());
    let before =
        get(&old.conditions, condition::READY).map(|c| (c.status.clone(), c.reason.clone()));
    if let Some(after) = get(&new.conditions, condition::READY)
        && before.as_ref() != Some(&(after.status.clone(), after.reason.clone()))
    {
        let normal =
            after.status == "True" || after.reason == "Deleting" || on_the_way(&after.reason);
        event(ctx, db, normal, &after.reason, &after.message).await;
    }
    if let Some(size) = get(&new.conditions, SIZE_EXCEEDED)
        && size.status == "True"
        && get(&old.conditions, SIZE_EXCEEDED).is_none_or(|c| c.status != "True")
    {
        event(ctx, db, false, "SizeExceeded", &size.message).await;
    }
    if let Some(progress) = get(&new.conditions, condition::PROGRESSING)
        && new.phase == Some(DatabasePhase::Deleting)
        && get(&old.conditions, condition::PROGRESSING).map(|c| &c.reason) != Some(&progress.reason)
    {
        // Waiting for the final Backup is the expected path, not a warning.
        let expected = progress.reason == "WaitingForFinalBackup";
        event(ctx, db, expected, &progress.reason, &progress.message).await;
    }
    Ok(())
}

/// Publishes an Event about the Database; failures are logged, never fatal.
pub async fn event(ctx: &Context<State>, db: &Database, normal: bool, reason: &str, note: &str) {
    dbops_shared::events::publish(&ctx.state.recorder, db, normal, "Reconcile", reason, note).await;
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
                "ServerUnreachable",
                "server h:1 is unreachable: reset".into()
            ),
            "server h:1 is unreachable: refused"
        );
        // Another reason, or a reason that waits for a change, takes the new message.
        assert_eq!(
            sticky_message(&old, "AuthenticationFailed", "denied".into()),
            "denied"
        );
        let blocked = with_ready("False", "NameConflict", "old");
        assert_eq!(
            sticky_message(&blocked, "NameConflict", "new".into()),
            "new"
        );
        // After Ready, a new outage gets its own message.
        let ready = with_ready("True", "Provisioned", "ready");
        assert_eq!(
            sticky_message(&ready, "ServerUnreachable", "refused".into()),
            "refused"
        );
    }
}
