//! What every Database, Backup and Migration was, as watches saw it: the checks need to
//! know, for an object that is gone, what it was (a deleted `Retain` Database may leave
//! its database; a deleted `Delete` Backup may not leave its artifact).

use std::collections::BTreeMap;
use std::sync::Mutex;

use k8s_openapi::jiff::Timestamp;

/// One object as last seen.
#[derive(Clone, Debug, Default)]
pub(crate) struct Seen {
    pub kind: &'static str,
    pub name: String,
    /// deletionPolicy (Database, Backup); the target server (Migration).
    pub policy: String,
    /// The Database's server (spec.serverRef), the Backup's or Migration's Database.
    pub server: String,
    /// Backup and Migration phase, Database Ready reason.
    pub phase: String,
    /// When the watch saw it gone.
    pub gone_at: Option<Timestamp>,
    /// Its deletionTimestamp (the apiserver's clock), once seen.
    pub deleting_since: Option<Timestamp>,
    /// metadata.generation and status.observedGeneration (Databases).
    pub generation: i64,
    pub observed: i64,
    /// A generation not observed yet, and since when (Databases).
    pub unobserved: Option<(i64, Timestamp)>,
    /// metadata.resourceVersion, to ignore a stale copy seen after a newer one.
    pub rv: u64,
}

impl Seen {
    /// What a violation says of an object that is gone: `Database orders (deletionPolicy
    /// Delete), gone since <time>` (`?` when the watch did not see it go).
    pub fn gone(&self) -> String {
        format!(
            "{} {} (deletionPolicy {}), gone since {}",
            self.kind,
            self.name,
            self.policy,
            self.gone_at
                .map(|t| t.to_string())
                .unwrap_or_else(|| "?".into())
        )
    }
}

/// How long the controllers took for something the user asked.
#[derive(Clone, Debug)]
pub(crate) struct Latency {
    pub kind: &'static str,
    pub name: String,
    pub secs: f64,
    pub what: String,
    pub since: Timestamp,
    /// Still waiting at the end.
    pub pending: bool,
}

/// By UID.
#[derive(Default)]
pub(crate) struct History {
    seen: Mutex<BTreeMap<String, Seen>>,
    latencies: Mutex<Vec<Latency>>,
}

impl History {
    pub fn get(&self, uid: &str) -> Option<Seen> {
        self.seen.lock().ok().and_then(|s| s.get(uid).cloned())
    }

    pub fn all(&self) -> Vec<(String, Seen)> {
        self.seen
            .lock()
            .map(|s| s.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// The `n` longest waits: deletions (deletionTimestamp to gone) and Database spec
    /// changes (a new generation seen to observedGeneration reaching it).
    pub fn slowest(&self, n: usize) -> Vec<Latency> {
        let mut all = self.waits();
        all.truncate(n);
        all
    }

    /// Every wait, the longest first.
    pub fn waits(&self) -> Vec<Latency> {
        let mut all = self.latencies.lock().map(|l| l.clone()).unwrap_or_default();
        // Still waiting at the end counts too.
        let now = Timestamp::now();
        for (_, s) in self.all() {
            if s.gone_at.is_none()
                && let Some(since) = s.deleting_since
            {
                all.push(Latency {
                    kind: s.kind,
                    name: s.name.clone(),
                    secs: now.duration_since(since).as_secs_f64(),
                    what: format!("{} {} deletion, still not done", s.kind, s.name),
                    since,
                    pending: true,
                });
            }
        }
        all.sort_by(|a, b| b.secs.total_cmp(&a.secs));
        all
    }

    fn record(&self, kind: &'static str, name: &str, what: String, since: Timestamp) {
        let secs = Timestamp::now().duration_since(since).as_secs_f64();
        if let Ok(mut l) = self.latencies.lock() {
            l.push(Latency {
                kind,
                name: name.to_string(),
                secs,
                what,
                since,
                pending: false,
            });
        }
    }

    /// Records `obj`; returns the previous record.
    pub fn apply(&self, uid: String, mut now: Seen, deleting: Option<Timestamp>) -> Option<Seen> {
        let Ok(mut seen) = self.seen.lock() else {
            return None;
        };
        let before = seen.get(&uid).cloned();
        if let Some(b) = &before
            && (b.gone_at.is_some() || b.rv > now.rv)
        {
            return before;
        }
        now.deleting_since = before.as_ref().and_then(|b| b.deleting_since).or(deleting);
        if now.kind == "Database" && now.deleting_since.is_none() {
            let pending = before.as_ref().and_then(|b| b.unobserved);
            now.unobserved = match pending {
                Some((g, since)) if now.observed >= g => {
                    self.record(
                        "Database",
                        &now.name,
                        format!("Database {} spec change to generation {g}", now.name),
                        since,
                    );
                    None
                }
                Some(p) => Some(p),
                None if now.generation > now.observed => Some((now.generation, Timestamp::now())),
                None => None,
            };
        }
        seen.insert(uid, now);
        before
    }

    pub fn gone(&self, uid: &str) -> Option<Seen> {
        let Ok(mut seen) = self.seen.lock() else {
            return None;
        };
        let entry = seen.get_mut(uid)?;
        if entry.gone_at.is_some() {
            return None;
        }
        entry.gone_at = Some(Timestamp::now());
        let entry = entry.clone();
        drop(seen);
        if let Some(since) = entry.deleting_since {
            self.record(
                entry.kind,
                &entry.name,
                format!("{} {} deletion", entry.kind, entry.name),
                since,
            );
        }
        Some(entry)
    }

    /// UIDs of `kind` not gone.
    pub fn live_uids(&self, kind: &str) -> Vec<String> {
        self.seen
            .lock()
            .map(|s| {
                s.iter()
                    .filter(|(_, v)| v.kind == kind && v.gone_at.is_none())
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}
