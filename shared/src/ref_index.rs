//! A reverse index of references within a namespace: which objects (referrers) name which
//! object (target), e.g. Databases → their admin Secret, Backups → their Database,
//! Migrations → their Database. Updated by each reconcile of a referrer, read by the map
//! function of a watch on targets, so a target's event finds its referrers without a
//! scan. A referrer names one target at a time; recording it again moves it.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

type Key = (String, String);

#[derive(Default)]
pub struct RefIndex {
    inner: Mutex<Maps>,
}

#[derive(Default)]
struct Maps {
    by_target: HashMap<Key, HashSet<String>>,
    by_referrer: HashMap<Key, String>,
}

impl RefIndex {
    fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `namespace/referrer` names `namespace/target` (and no longer what it named before).
    pub fn record(&self, namespace: &str, referrer: &str, target: &str) {
        let mut maps = self.maps();
        let key = (namespace.to_string(), referrer.to_string());
        if let Some(old) = maps.by_referrer.insert(key, target.to_string()) {
            if old == target {
                return;
            }
            remove(&mut maps.by_target, (namespace.to_string(), old), referrer);
        }
        maps.by_target
            .entry((namespace.to_string(), target.to_string()))
            .or_default()
            .insert(referrer.to_string());
    }

    /// `namespace/referrer` is gone or no longer needs its target's events.
    pub fn forget(&self, namespace: &str, referrer: &str) {
        let mut maps = self.maps();
        if let Some(target) = maps
            .by_referrer
            .remove(&(namespace.to_string(), referrer.to_string()))
        {
            remove(
                &mut maps.by_target,
                (namespace.to_string(), target),
                referrer,
            );
        }
    }

    /// Keeps only the referrers for which `keep(namespace, referrer)` holds.
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let gone: Vec<Key> = self
            .maps()
            .by_referrer
            .keys()
            .filter(|(ns, r)| !keep(ns, r))
            .cloned()
            .collect();
        for (ns, r) in gone {
            self.forget(&ns, &r);
        }
    }

    /// The referrers of `namespace/target`.
    pub fn referrers_of(&self, namespace: &str, target: &str) -> Vec<String> {
        self.maps()
            .by_target
            .get(&(namespace.to_string(), target.to_string()))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

fn remove(by_target: &mut HashMap<Key, HashSet<String>>, key: Key, referrer: &str) {
    if let Some(set) = by_target.get_mut(&key) {
        set.remove(referrer);
        if set.is_empty() {
            by_target.remove(&key);
        }
    }
}
