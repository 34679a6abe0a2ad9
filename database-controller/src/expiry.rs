//! `spec.expireAfter` / `spec.expiresAt`: a Database deleted when it expires, with its
//! own `deletionPolicy` (the deletion then runs as any other, behind the finalizer).
//!
//! - The instant is [`Database::expires_at`]: pure, from the spec and the creation time,
//!   so a changed spec extends or shortens the life at the next reconcile; the status
//!   shows it (`status.expiresAt`, the column `Expires`).
//! - A tenth of its life before (at most an hour, at least a minute), one Warning Event
//!   `ExpiresSoon` says when and with which policy; per expiry instant, once per process.
//! - Once the instant has passed, a Normal Event `Expired` and a DELETE of the Database,
//!   conditioned on its UID (a Database created again under the name is not touched).
//!   Not while a Migration moves it: the deletion waits for the Migration's end.

use std::time::Duration;

use dbops_api::Database;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Preconditions};

use crate::error::Result;
use crate::state::State;
use crate::status;
use dbops_shared::controller::Context;

/// What the expiry of a Database asks for now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expiry {
    /// No expiry, or a spec whose expiry cannot be read (the status says nothing of it).
    None,
    /// Not yet: look again within this long (the warning, or the expiry).
    Later { at: Timestamp, within: Duration },
    /// The warning is due (and the expiry after `within`).
    Warn { at: Timestamp, within: Duration },
    /// Expired: delete it.
    Now { at: Timestamp },
}

/// How long before the expiry the warning comes: a tenth of the life, between a minute
/// and an hour (never before the life began).
pub fn warning_lead(created: Timestamp, at: Timestamp) -> Duration {
    let life = Duration::try_from(at.duration_since(created)).unwrap_or_default();
    (life / 10)
        .clamp(Duration::from_secs(60), Duration::from_secs(3600))
        .min(life)
}

/// What `db`'s expiry asks for at `now`.
pub fn expiry(db: &Database, now: Timestamp) -> Expiry {
    let Ok(Some(at)) = db.expires_at() else {
        return Expiry::None;
    };
    let created = db.metadata.creation_timestamp.as_ref().map_or(now, |t| t.0);
    let left = Duration::try_from(at.duration_since(now)).unwrap_or_default();
    if left.is_zero() {
        return Expiry::Now { at };
    }
    let lead = warning_lead(created, at);
    if left <= lead {
        Expiry::Warn { at, within: left }
    } else {
        Expiry::Later {
            at,
            within: left - lead,
        }
    }
}

/// Acts on `db`'s expiry: the warning when due, the deletion once expired (not while the
/// Migration `migration` runs). Whether the deletion was asked for (the reconcile ends
/// there), and how soon the expiry wants a look (`None`: never).
pub async fn act(
    db: &Database,
    ctx: &Context<State>,
    api: &Api<Database>,
    migration: Option<&str>,
) -> Result<(bool, Option<Duration>)> {
    let uid = db.uid().unwrap_or_default();
    let policy = format!("{:?}", db.spec.deletion_policy);
    match expiry(db, Timestamp::now()) {
        Expiry::None => Ok((false, None)),
        Expiry::Later { within, .. } => Ok((false, Some(within))),
        Expiry::Warn { at, within } => {
            if ctx.state.expiry_warned.first(&uid, at) {
                let note = format!(
                    "expires at {at} ({}); it will then be deleted with deletionPolicy {policy}: change spec.expireAfter or spec.expiresAt to keep it longer",
                    how(db)
                );
                status::event(ctx, db, false, "ExpiresSoon", &note).await;
            }
            Ok((false, Some(within)))
        }
        Expiry::Now { at } => {
            if let Some(m) = migration {
                tracing::info!(
                    migration = m,
                    "expired, but Migration {m} moves it: deleting once it ends"
                );
                return Ok((false, Some(Duration::from_secs(30))));
            }
            let note = format!(
                "expired at {at} ({}): deleting it with deletionPolicy {policy}",
                how(db)
            );
            status::event(ctx, db, true, "Expired", &note).await;
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&db.name_any(), &params).await {
                Ok(_) => {}
                // Gone, or another object under the name: nothing of ours to delete.
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
            tracing::info!(%at, policy, "expired: the Database is deleted");
            Ok((true, None))
        }
    }
}

/// What set the expiry, in words.
fn how(db: &Database) -> String {
    match (&db.spec.expire_after, &db.spec.expires_at) {
        (Some(after), _) => format!("spec.expireAfter {after} after its creation"),
        _ => "spec.expiresAt".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn db(created: i64, spec: serde_json::Value) -> Database {
        let mut full = json!({"serverRef": {"name": "pg"}});
        if let (Some(f), Some(extra)) = (full.as_object_mut(), spec.as_object()) {
            f.extend(extra.clone());
        }
        let mut d = Database::new("d", serde_json::from_value(full).expect("spec"));
        d.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::from_second(created).expect("time"),
        ));
        d
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("time")
    }

    #[test]
    fn a_database_expires_after_its_life_with_a_warning_a_tenth_before() {
        // 72h of life: the warning an hour before (a tenth would be 7.2 h: capped).
        let d = db(0, json!({"expireAfter": "72h"}));
        let at = t(72 * 3600);
        assert_eq!(
            expiry(&d, t(0)),
            Expiry::Later {
                at,
                within: Duration::from_secs(71 * 3600)
            }
        );
        assert_eq!(
            expiry(&d, t(71 * 3600 + 1800)),
            Expiry::Warn {
                at,
                within: Duration::from_secs(1800)
            }
        );
        assert_eq!(expiry(&d, at), Expiry::Now { at });
        // 20 minutes: two minutes before. 30 seconds: a minute is more than the life.
        assert_eq!(warning_lead(t(0), t(1200)), Duration::from_secs(120));
        assert_eq!(warning_lead(t(0), t(30)), Duration::from_secs(30));
        // No expiry; an absolute one.
        assert_eq!(expiry(&db(0, json!({})), t(1)), Expiry::None);
        let abs = db(0, json!({"expiresAt": "1970-01-01T00:10:00Z"}));
        assert_eq!(expiry(&abs, t(600)), Expiry::Now { at: t(600) });
    }

    #[test]
    fn a_warning_is_given_once_per_expiry_instant() {
        let w = crate::state::ExpiryWarnings::default();
        assert!(w.first("u", t(10)));
        assert!(!w.first("u", t(10)));
        // Extended: a new instant, a new warning.
        assert!(w.first("u", t(20)));
        w.forget("u");
        assert!(w.first("u", t(20)));
    }
}
