//! The DatabaseUser's status from a reconcile's outcome: [`desired`] decides it and the
//! Events its change implies (pure), [`publish`] writes it when it differs from the
//! latest, then publishes those Events.

use dbops_api::reasons::DatabaseUserReason;
use dbops_api::{DatabaseUser, DatabaseUserStatus, condition};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, get, now, set_condition};
use dbops_shared::controller::Context;
use dbops_shared::status::{Desired, Guard, Note, Write};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Api;

use super::provision::Done;
use super::state::State;
use crate::error::Result;
use crate::live::status_write_gone;
use crate::rotation;

/// The action the user controller's Events name.
const ACTION: &str = "Reconcile";

/// The `Ready` condition of an outcome: status, reason, message.
fn ready(outcome: &Result<Done>) -> (ConditionStatus, &'static str, String) {
    let done = match outcome {
        Ok(done) => done,
        Err(e) => {
            return (
                ConditionStatus::False,
                e.user_reason().as_str(),
                e.to_string(),
            );
        }
    };
    if !done.missing_schemas.is_empty() {
        (
            ConditionStatus::False,
            DatabaseUserReason::SchemaNotFound.as_str(),
            format!(
                "{}; schemas {} do not exist yet (granted once they do, at the next resync)",
                done.message,
                done.missing_schemas.join(", ")
            ),
        )
    } else if let Some(former) = &done.former_server {
        (
            ConditionStatus::True,
            DatabaseUserReason::UserReady.as_str(),
            format!(
                "{}; its roles on former DatabaseServer {former} are not dropped yet",
                done.message
            ),
        )
    } else {
        (
            ConditionStatus::True,
            DatabaseUserReason::UserReady.as_str(),
            done.message.clone(),
        )
    }
}

/// The status `outcome` gives the user, from `old` (the latest), and the Events its
/// change implies: `Ready` changing, and a rotation (`PasswordRotated`).
pub fn desired(
    user: &DatabaseUser,
    old: &DatabaseUserStatus,
    outcome: &Result<Done>,
    at: Time,
) -> Desired<DatabaseUserStatus> {
    let mut new = old.clone();
    let generation = user.metadata.generation;
    new.observed_generation = generation;
    if let Ok(done) = outcome {
        new.server = Some(done.server.clone());
        new.group_role = Some(done.group.clone());
        new.role = Some(done.role.clone());
        new.previous_role = done.previous.as_ref().map(|(r, _)| r.clone());
        new.rotation = rotation::record(
            done.previous.as_ref(),
            done.last_rotation.clone(),
            done.rotate_request.clone(),
        );
        new.connection_secret = Some(user.connection_secret_name());
        new.former_server = done.former_server.clone();
    }
    let (status, reason, message) = ready(outcome);
    let spec = ConditionSpec {
        type_: condition::READY,
        status,
        reason,
        message: message.clone(),
        observed_generation: generation,
    };
    set_condition(&mut new.conditions, spec, at);
    let mut notes = Vec::new();
    let before =
        get(&old.conditions, condition::READY).map(|c| (c.status.clone(), c.reason.clone()));
    if before != Some((status.as_str().to_string(), reason.to_string())) {
        let normal = status == ConditionStatus::True;
        notes.push(Note {
            normal,
            action: ACTION,
            reason: reason.to_string(),
            message,
        });
    }
    if new.rotation.last_rotation != old.rotation.last_rotation
        && old.rotation.last_rotation.is_some()
    {
        notes.push(Note::normal(ACTION, "PasswordRotated", rotated(&new)));
    }
    Desired { status: new, notes }
}

/// The note of a `PasswordRotated` Event.
fn rotated(new: &DatabaseUserStatus) -> String {
    format!(
        "the connection Secret now names login {}; {} keeps working until {}",
        new.role.clone().unwrap_or_default(),
        new.previous_role
            .clone()
            .unwrap_or_else(|| "no previous login".into()),
        new.rotation
            .previous_valid_until
            .as_ref()
            .map_or_else(String::new, |t| t.0.to_string())
    )
}

/// Writes the status `outcome` gives the user through the shared path
/// (`dbops_shared::status`, guarded by the UID: it is recomputed from the world each
/// reconcile), then the Events of [`desired`]. A user gone or created again meanwhile
/// abandons the reconcile (`Superseded`).
pub async fn publish(
    user: &DatabaseUser,
    ctx: &Context<State>,
    api: &Api<DatabaseUser>,
    outcome: &Result<Done>,
) -> Result<()> {
    let old = ctx.state.latest(user);
    let desired = desired(user, &old, outcome, now());
    let state = &ctx.state;
    match state
        .written
        .write(api, user, desired, Guard::Uid, &state.recorder, None)
        .await?
    {
        Write::Gone => {
            status_write_gone(&ctx.client, user, DatabaseUserReason::KubernetesApiError).await
        }
        Write::Unchanged | Write::Written(_) | Write::Conflict => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use serde_json::json;

    fn user() -> DatabaseUser {
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseUser",
            "metadata": {"name": "ro", "namespace": "ns", "uid": "u1", "generation": 2},
            "spec": {"databaseRef": {"name": "orders"}, "access": "ReadOnly"},
        }))
        .unwrap()
    }

    fn done() -> Done {
        Done {
            server: "pg".into(),
            group: "orders_ro".into(),
            role: "orders_ro_1".into(),
            message: "login orders_ro_1".into(),
            ..Done::default()
        }
    }

    fn at(second: i64) -> Time {
        Time(jiff::Timestamp::from_second(second).unwrap())
    }

    #[test]
    fn ready_is_told_once_and_a_rotation_after_the_first_password() {
        let u = user();
        let first = desired(&u, &DatabaseUserStatus::default(), &Ok(done()), at(10));
        let s = &first.status;
        assert_eq!(s.role.as_deref(), Some("orders_ro_1"));
        assert_eq!(s.connection_secret.as_deref(), Some("ro-connection"));
        assert_eq!(s.observed_generation, Some(2));
        let reasons: Vec<&str> = first.notes.iter().map(|n| n.reason.as_str()).collect();
        assert_eq!(reasons, ["UserReady"]);
        // The same outcome again: the same status, nothing to tell.
        let again = desired(&u, s, &Ok(done()), at(20));
        assert_eq!(&again.status, s);
        assert!(again.notes.is_empty());
        // A rotation: the new login, the previous one until its expiry.
        let mut old = s.clone();
        old.rotation.last_rotation = Some(at(1));
        let rotated = Done {
            role: "orders_ro_2".into(),
            previous: Some(("orders_ro_1".into(), 100.0)),
            last_rotation: Some(at(30)),
            ..done()
        };
        let d = desired(&u, &old, &Ok(rotated), at(30));
        assert_eq!(d.status.previous_role.as_deref(), Some("orders_ro_1"));
        assert_eq!(d.status.rotation.previous_valid_until, Some(at(100)));
        assert_eq!(d.notes.len(), 1);
        assert_eq!(d.notes[0].reason, "PasswordRotated");
        assert!(
            d.notes[0].message.contains("orders_ro_2"),
            "{}",
            d.notes[0].message
        );
    }

    #[test]
    fn a_failure_keeps_the_last_good_fields_and_says_why() {
        let u = user();
        let ready = desired(&u, &DatabaseUserStatus::default(), &Ok(done()), at(10)).status;
        let failed: Result<Done> = Err(Error::reported(
            DatabaseUserReason::DatabaseNotReady,
            "not yet",
        ));
        let d = desired(&u, &ready, &failed, at(20));
        assert_eq!(d.status.role.as_deref(), Some("orders_ro_1"));
        let c = get(&d.status.conditions, condition::READY).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "DatabaseNotReady")
        );
        assert_eq!(d.notes.len(), 1);
        assert!(!d.notes[0].normal);
        // Missing schemas: not Ready, the rest granted.
        let partly = Done {
            missing_schemas: vec!["audit".into()],
            ..done()
        };
        let d = desired(&u, &ready, &Ok(partly), at(30));
        let c = get(&d.status.conditions, condition::READY).unwrap();
        assert_eq!(c.reason, "SchemaNotFound");
    }
}
