//! Per-object exponential backoff with jitter for transient reconcile errors.
//!
//! kube-runtime requeues after whatever the error policy returns and keeps no per-object
//! attempt count, so the count lives here: the delay is `base * 2^attempt`, capped at `max`,
//! then "equal jitter" picks it uniformly from `[d/2, d]`. A success resets the object and a
//! deletion forgets it; both remove the entry, so memory grows only with the number of
//! objects that are failing right now.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use kube::{Resource, ResourceExt, runtime::reflector::ObjectRef};

/// The delay curve: `base * 2^attempt`, never above `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The capped delay for an attempt, before jitter. Attempt 0 is the first retry.
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 2u32.checked_pow(attempt).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The delay for an attempt with equal jitter: uniform in `[d/2, d]`.
    pub fn jittered_delay(&self, attempt: u32) -> Duration {
        let delay = self.delay(attempt);
        let half = delay / 2;
        let jitter_nanos = u64::try_from((delay - half).as_nanos()).unwrap_or(u64::MAX);
        half + Duration::from_nanos(rand::random_range(0..=jitter_nanos))
    }
}

/// Identifies one object across its lifetime: `namespace/name/uid`, so that an object
/// deleted and created again under the same name starts without a backoff.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackoffKey(String);

impl BackoffKey {
    pub fn new(namespace: Option<&str>, name: &str, uid: Option<&str>) -> Self {
        Self(format!(
            "{}/{}/{}",
            namespace.unwrap_or_default(),
            name,
            uid.unwrap_or_default()
        ))
    }

    pub fn for_object<K: Resource>(obj: &K) -> Self {
        Self::new(
            obj.namespace().as_deref(),
            &obj.name_any(),
            obj.uid().as_deref(),
        )
    }

    pub fn for_object_ref<K: kube::runtime::reflector::Lookup + ?Sized>(
        obj_ref: &ObjectRef<K>,
    ) -> Self {
        Self::new(
            obj_ref.namespace.as_deref(),
            &obj_ref.name,
            obj_ref.extra.uid.as_deref(),
        )
    }
}

/// Attempt counts of the objects whose last reconcile failed transiently.
#[derive(Debug)]
pub struct BackoffTracker {
    backoff: Backoff,
    attempts: Mutex<HashMap<BackoffKey, u32>>,
}

impl BackoffTracker {
    pub fn new(backoff: Backoff) -> Self {
        Self {
            backoff,
            attempts: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one more failure of `key` and returns how long to wait before retrying it.
    pub fn next_delay(&self, key: &BackoffKey) -> Duration {
        let mut attempts = self.attempts.lock().unwrap_or_else(PoisonError::into_inner);
        let attempt = attempts.entry(key.clone()).or_insert(0);
        let delay = self.backoff.jittered_delay(*attempt);
        *attempt = attempt.saturating_add(1);
        delay
    }

    /// The object reconciled successfully: its next failure starts again at `base`.
    pub fn reset(&self, key: &BackoffKey) {
        self.remove(key);
    }

    /// The object is gone: drop what is known about it.
    pub fn forget(&self, key: &BackoffKey) {
        self.remove(key);
    }

    /// How many objects are currently backing off.
    pub fn len(&self) -> usize {
        self.attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn remove(&self, key: &BackoffKey) {
        self.attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Backoff = Backoff {
        base: Duration::from_secs(5),
        max: Duration::from_secs(300),
    };

    fn key(name: &str) -> BackoffKey {
        BackoffKey::new(Some("default"), name, Some("uid-1"))
    }

    #[test]
    fn delay_doubles_per_attempt() {
        let delays: Vec<u64> = (0..6).map(|n| SPEC.delay(n).as_secs()).collect();
        assert_eq!(delays, [5, 10, 20, 40, 80, 160]);
    }

    #[test]
    fn delay_is_capped_at_max_even_for_huge_attempts() {
        assert_eq!(SPEC.delay(6), Duration::from_secs(300));
        assert_eq!(SPEC.delay(40), Duration::from_secs(300));
        assert_eq!(SPEC.delay(u32::MAX), Duration::from_secs(300));
    }

    #[test]
    fn jittered_delay_stays_between_half_and_full_delay() {
        for attempt in 0..10 {
            let full = SPEC.delay(attempt);
            for _ in 0..200 {
                let delay = SPEC.jittered_delay(attempt);
                assert!(
                    delay >= full / 2 && delay <= full,
                    "{delay:?} outside [{full:?}/2, {full:?}]"
                );
            }
        }
    }

    #[test]
    fn tracker_grows_per_object_and_resets_on_success() {
        let tracker = BackoffTracker::new(SPEC);
        let failing = key("failing");
        let other = key("other");

        let first = tracker.next_delay(&failing);
        let second = tracker.next_delay(&failing);
        let third = tracker.next_delay(&failing);
        assert!(first <= Duration::from_secs(5));
        assert!(second >= Duration::from_secs(5) && second <= Duration::from_secs(10));
        assert!(third >= Duration::from_secs(10) && third <= Duration::from_secs(20));

        // Another object has its own count.
        assert!(tracker.next_delay(&other) <= Duration::from_secs(5));
        assert_eq!(tracker.len(), 2);

        tracker.reset(&failing);
        assert!(tracker.next_delay(&failing) <= Duration::from_secs(5));
    }

    #[test]
    fn reset_and_forget_free_the_entry() {
        let tracker = BackoffTracker::new(SPEC);
        tracker.next_delay(&key("a"));
        tracker.next_delay(&key("b"));
        tracker.reset(&key("a"));
        tracker.forget(&key("b"));
        assert!(tracker.is_empty());
    }

    #[test]
    fn recreated_object_has_a_different_key() {
        assert_ne!(
            BackoffKey::new(Some("ns"), "orders", Some("uid-1")),
            BackoffKey::new(Some("ns"), "orders", Some("uid-2"))
        );
    }
}
