//! What password rotation decides the same way for a Database's owner (`owner_logins`)
//! and for a DatabaseUser (`user`): whether a rotation is due, how long the previous login
//! keeps working, and when the next reconcile is due for rotation's sake; and the turn of
//! their two logins itself ([`turn`]).

pub mod turn;

use std::collections::BTreeMap;
use std::time::Duration;

use dbops_api::names::annotation::ROTATE;
use dbops_api::{PasswordRotation, RotationStatus, access::parse_duration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// Now, in seconds since the epoch.
pub fn secs_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A status time in seconds since the epoch.
pub fn epoch(t: &Time) -> f64 {
    t.0.as_millisecond() as f64 / 1000.0
}

/// What a turn of the logins leaves in the status (a Database's or a DatabaseUser's): the
/// previous login's expiry (seconds since the epoch), the last rotation and the last
/// `dbops.dev/rotate` acted on.
pub fn record(
    previous: Option<&(String, f64)>,
    last_rotation: Option<Time>,
    rotate_request: Option<String>,
) -> RotationStatus {
    RotationStatus {
        previous_valid_until: previous
            .and_then(|(_, until)| jiff::Timestamp::from_second(*until as i64).ok().map(Time)),
        last_rotation,
        rotate_request,
    }
}

/// `epoch` as RFC 3339, for `VALID UNTIL`.
pub fn rfc3339(epoch: f64) -> String {
    jiff::Timestamp::from_millisecond((epoch * 1000.0) as i64)
        .map_or_else(|_| "infinity".to_string(), |t| t.to_string())
}

fn every(rotation: Option<&PasswordRotation>) -> Option<Duration> {
    rotation
        .and_then(|r| r.every.as_deref())
        .and_then(parse_duration)
}

/// Whether a rotation is due now, and why: the annotation `dbops.dev/rotate` has a value
/// not acted on yet (`rotate_request`, from the latest status written: the cached object
/// may not show it yet, and deciding on it would rotate twice), or `every` has passed
/// since `last_rotation`.
pub fn due(
    annotations: &BTreeMap<String, String>,
    rotation: Option<&PasswordRotation>,
    rotate_request: Option<&String>,
    last_rotation: Option<&Time>,
    now: f64,
) -> Option<String> {
    if let Some(asked) = annotations.get(ROTATE)
        && rotate_request != Some(asked)
    {
        return Some(format!("asked for by {ROTATE}={asked:?}"));
    }
    let every = every(rotation)?;
    let last = epoch(last_rotation?);
    (now >= last + every.as_secs_f64()).then(|| "due by passwordRotation.every".to_string())
}

/// How long the previous login keeps working after a rotation (`keepPrevious`, 1 h by
/// default).
pub fn keep_previous(rotation: Option<&PasswordRotation>) -> Duration {
    rotation
        .and_then(|r| parse_duration(&r.keep_previous))
        .unwrap_or(Duration::from_secs(3600))
}

/// When a reconcile is next due for rotation's sake: just after the previous login's
/// expiry (`previous_until`), or when `every` has passed since `last_rotation`, whichever
/// comes first.
pub fn next_due(
    previous_until: Option<f64>,
    rotation: Option<&PasswordRotation>,
    last_rotation: Option<&Time>,
    now: f64,
) -> Option<Duration> {
    let after = |at: f64| Duration::from_secs_f64((at - now).max(0.0) + 1.0);
    let expiry = previous_until.map(after);
    let rotation =
        every(rotation).map(|every| after(last_rotation.map_or(now, epoch) + every.as_secs_f64()));
    match (expiry, rotation) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotation(every: Option<&str>) -> PasswordRotation {
        PasswordRotation {
            every: every.map(str::to_string),
            keep_previous: "10s".into(),
        }
    }

    #[test]
    fn a_rotation_is_due_for_a_new_annotation_value_or_after_every() {
        let now = 1_000_000.0;
        let last = Time(jiff::Timestamp::from_second(1_000_000 - 3600).unwrap());
        let asked: BTreeMap<String, String> = [(ROTATE.to_string(), "1".to_string())].into();
        let r = rotation(Some("1h"));
        assert!(due(&asked, Some(&r), None, Some(&last), now).is_some());
        assert!(
            due(
                &asked,
                Some(&r),
                Some(&"1".to_string()),
                Some(&last),
                now - 1.0
            )
            .is_none()
        );
        assert!(due(&BTreeMap::new(), Some(&r), None, Some(&last), now).is_some());
        assert!(due(&BTreeMap::new(), None, None, Some(&last), now).is_none());
        assert_eq!(keep_previous(Some(&r)), Duration::from_secs(10));
        assert_eq!(keep_previous(None), Duration::from_secs(3600));
        assert_eq!(
            next_due(Some(now + 5.0), Some(&r), Some(&last), now),
            Some(Duration::from_secs(1)),
            "every has passed: due at once (plus a second)"
        );
        assert_eq!(
            next_due(Some(now + 5.0), None, None, now),
            Some(Duration::from_secs(6))
        );
        assert_eq!(next_due(None, None, None, now), None);
    }
}
