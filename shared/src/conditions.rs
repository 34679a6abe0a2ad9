//! Upserting metav1 Conditions into a status.
//!
//! `lastTransitionTime` moves only when the status flips, and [`set_condition`] says whether
//! anything changed, so a reconcile on converged state can skip its status write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The `status` of a condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

impl From<bool> for ConditionStatus {
    fn from(value: bool) -> Self {
        if value { Self::True } else { Self::False }
    }
}

/// The desired state of one condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionSpec<'a> {
    /// For example `Ready`; see `dbops_api::condition`.
    pub type_: &'a str,
    pub status: ConditionStatus,
    /// CamelCase, for example `DatabaseCreated`.
    pub reason: &'a str,
    /// For humans; never a secret.
    pub message: String,
    /// The `metadata.generation` this condition was computed from.
    pub observed_generation: Option<i64>,
}

/// Inserts or updates the condition of `spec.type_`. Returns `true` if `conditions` changed.
///
/// An existing condition keeps its position and its `lastTransitionTime` unless its status
/// changes; a new one is appended with `lastTransitionTime = now`.
/// Now, as a condition's `lastTransitionTime` (and any status time) is written.
pub fn now() -> Time {
    Time(jiff::Timestamp::now())
}

pub fn set_condition(conditions: &mut Vec<Condition>, spec: ConditionSpec<'_>, now: Time) -> bool {
    debug_assert!(
        is_camel_case(spec.reason),
        "condition reason `{}` is not CamelCase",
        spec.reason
    );
    let status = spec.status.as_str();
    match conditions.iter_mut().find(|c| c.type_ == spec.type_) {
        Some(existing) => {
            let unchanged = existing.status == status
                && existing.reason == spec.reason
                && existing.message == spec.message
                && existing.observed_generation == spec.observed_generation;
            if unchanged {
                return false;
            }
            if existing.status != status {
                existing.status = status.to_owned();
                existing.last_transition_time = now;
            }
            existing.reason = spec.reason.to_owned();
            existing.message = spec.message;
            existing.observed_generation = spec.observed_generation;
            true
        }
        None => {
            conditions.push(Condition {
                type_: spec.type_.to_owned(),
                status: status.to_owned(),
                reason: spec.reason.to_owned(),
                message: spec.message,
                observed_generation: spec.observed_generation,
                last_transition_time: now,
            });
            true
        }
    }
}

/// The condition of type `type_`, if present.
pub fn get<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of type `type_` is present with status `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    get(conditions, type_).is_some_and(|c| c.status == ConditionStatus::True.as_str())
}

/// A reason as Kubernetes conventions want it: an upper-case ASCII letter followed by ASCII
/// letters and digits, for example `BackupCompleted`.
pub fn is_camel_case(reason: &str) -> bool {
    let mut chars = reason.chars();
    chars.next().is_some_and(|c| c.is_ascii_uppercase()) && chars.all(|c| c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Time {
        Time(jiff::Timestamp::from_second(seconds).unwrap())
    }

    fn ready(status: ConditionStatus, reason: &str, generation: i64) -> ConditionSpec<'_> {
        ConditionSpec {
            type_: "Ready",
            status,
            reason,
            message: format!("reason {reason}"),
            observed_generation: Some(generation),
        }
    }

    /// Conditions that hold only Ready (`status`, `reason`, generation 1), set at 10 s.
    fn ready_since_10(status: ConditionStatus, reason: &str) -> Vec<Condition> {
        let mut conditions = Vec::new();
        set_condition(&mut conditions, ready(status, reason, 1), at(10));
        conditions
    }

    #[test]
    fn a_new_condition_is_appended_with_the_transition_time_now() {
        let mut conditions = Vec::new();
        assert!(set_condition(
            &mut conditions,
            ready(ConditionStatus::True, "Available", 1),
            at(10)
        ));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].status, "True");
        assert_eq!(conditions[0].last_transition_time, at(10));
    }

    #[test]
    fn the_same_condition_again_changes_nothing() {
        let mut conditions = ready_since_10(ConditionStatus::True, "Available");
        let before = conditions.clone();
        assert!(!set_condition(
            &mut conditions,
            ready(ConditionStatus::True, "Available", 1),
            at(20)
        ));
        assert_eq!(conditions, before);
    }

    /// A new reason keeps the transition time; a status flip moves it.
    #[test]
    fn a_status_flip_moves_the_transition_time_and_a_new_reason_keeps_it() {
        use ConditionStatus::{False, True};
        // Ready=False Creating since 10 s, then at 20 s: (status, reason, generation,
        // the transition time after).
        for (status, reason, generation, since) in [
            (False, "WaitingForServer", 2, 10),
            (True, "Available", 1, 20),
        ] {
            let mut conditions = ready_since_10(False, "Creating");
            let now = ready(status, reason, generation);
            assert!(set_condition(&mut conditions, now, at(20)), "{reason}");
            assert_eq!(conditions[0].status, status.as_str(), "{reason}");
            assert_eq!(conditions[0].reason, reason);
            assert_eq!(conditions[0].observed_generation, Some(generation));
            assert_eq!(conditions[0].last_transition_time, at(since), "{reason}");
        }
    }

    #[test]
    fn other_conditions_keep_their_order() {
        let mut conditions = ready_since_10(ConditionStatus::False, "Creating");
        let progressing = ConditionSpec {
            type_: "Progressing",
            ..ready(ConditionStatus::True, "Creating", 1)
        };
        set_condition(&mut conditions, progressing, at(10));
        set_condition(
            &mut conditions,
            ready(ConditionStatus::True, "Available", 1),
            at(20),
        );
        let types: Vec<&str> = conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Ready", "Progressing"]);
    }

    #[test]
    fn helpers_find_conditions_by_type() {
        let conditions = ready_since_10(ConditionStatus::True, "Available");
        assert!(is_true(&conditions, "Ready"));
        assert!(!is_true(&conditions, "Degraded"));
        assert_eq!(
            get(&conditions, "Ready").map(|c| c.reason.as_str()),
            Some("Available")
        );
        assert!(get(&conditions, "Degraded").is_none());
    }

    #[test]
    fn reasons_must_be_camel_case() {
        assert!(is_camel_case("Available"));
        assert!(is_camel_case("PostgreSQL15Ready"));
        assert!(!is_camel_case(""));
        assert!(!is_camel_case("available"));
        assert!(!is_camel_case("Not Ready"));
        assert!(!is_camel_case("not_ready"));
        assert!(!is_camel_case("Not-Ready"));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "not CamelCase")]
    fn a_snake_case_reason_is_a_programming_error() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            ready(ConditionStatus::True, "not_ready", 1),
            at(10),
        );
    }
}
