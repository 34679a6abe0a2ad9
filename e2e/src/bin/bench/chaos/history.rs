//! What every Database, Backup and Migration was, as watches saw it: the checks need to
//! know, for an object that is gone, what it was (a deleted `Retain` Database may leave
//! its database; a deleted `Delete` Backup may not leave its artifact).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use dbops_api::{Backup, BackupPhase, Database, Migration};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::{NS, World};

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
    fn apply(&self, uid: String, mut now: Seen, deleting: Option<Timestamp>) -> Option<Seen> {
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

    fn gone(&self, uid: &str) -> Option<Seen> {
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
    fn live_uids(&self, kind: &str) -> Vec<String> {
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

fn database_seen(d: &Database) -> Seen {
    Seen {
        kind: "Database",
        name: d.name_any(),
        policy: format!("{:?}", d.spec.deletion_policy),
        server: d.spec.server_ref.name.clone(),
        phase: d
            .status
            .as_ref()
            .and_then(|s| super::ready_condition(&s.conditions))
            .map(|(st, reason, _)| format!("Ready={st}/{reason}"))
            .unwrap_or_default(),
        generation: d.metadata.generation.unwrap_or(0),
        observed: d
            .status
            .as_ref()
            .and_then(|s| s.observed_generation)
            .unwrap_or(0),
        ..Seen::default()
    }
}

/// `, <reason>: <message>` of a `Failed=True` condition, or nothing.
fn failure(conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition]) -> String {
    conditions
        .iter()
        .find(|c| c.type_ == "Failed" && c.status == "True")
        .map(|c| format!(", {}: {}", c.reason, c.message))
        .unwrap_or_default()
}

fn backup_seen(b: &Backup) -> Seen {
    Seen {
        kind: "Backup",
        name: b.name_any(),
        policy: format!("{:?}", b.spec.deletion_policy),
        server: b.spec.database_ref.name.clone(),
        phase: b
            .status
            .as_ref()
            .and_then(|s| {
                let why = failure(&s.conditions);
                Some(match s.phase? {
                    BackupPhase::Failed if !why.is_empty() => format!("Failed ({})", &why[2..]),
                    p => format!("{p:?}"),
                })
            })
            .unwrap_or_default(),
        ..Seen::default()
    }
}

fn migration_seen(m: &Migration) -> Seen {
    Seen {
        kind: "Migration",
        name: m.name_any(),
        policy: m.spec.target.server_ref.name.clone(),
        server: m.spec.database_ref.name.clone(),
        phase: m
            .status
            .as_ref()
            .and_then(|s| {
                let phase = format!("{:?}", s.phase?);
                Some(match (&s.failed_step, failure(&s.conditions)) {
                    (Some(step), why) => format!("{phase} (failed step {step:?}{why})"),
                    (None, why) if !why.is_empty() => format!("{phase} ({})", &why[2..]),
                    _ => phase,
                })
            })
            .unwrap_or_default(),
        ..Seen::default()
    }
}

fn rv_of<K: Resource>(obj: &K) -> u64 {
    obj.meta()
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn observe_one<K: Resource>(world: &World, obj: &K, seen: fn(&K) -> Seen) {
    let uid = obj.meta().uid.clone().unwrap_or_default();
    let mut now = seen(obj);
    now.rv = rv_of(obj);
    let deleting = obj.meta().deletion_timestamp.as_ref().map(|t| t.0);
    let before = world.history.apply(uid, now.clone(), deleting);
    note_change(world, before.as_ref(), &now);
}

/// Records a list (a consistent snapshot): every item, and every object of that kind
/// last seen before the list's resourceVersion and missing from it as gone. Lists are
/// what the history trusts for "gone" and for timing: a watch may lag (it does, for a
/// while, after an apiserver restart), a list does not.
fn observe_list<K: Resource + Clone>(
    world: &World,
    kind: &str,
    list: &kube::api::ObjectList<K>,
    seen: fn(&K) -> Seen,
) {
    let list_rv: u64 = list
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut uids = std::collections::BTreeSet::new();
    for obj in &list.items {
        uids.insert(obj.meta().uid.clone().unwrap_or_default());
        observe_one(world, obj, seen);
    }
    for uid in world.history.live_uids(kind) {
        let older = world.history.get(&uid).is_some_and(|s| s.rv < list_rv);
        if older
            && !uids.contains(&uid)
            && let Some(s) = world.history.gone(&uid)
        {
            note_gone(world, &s);
        }
    }
}

/// [`observe_list`] of the three kinds.
pub(crate) fn observe_lists(
    world: &World,
    dbs: &kube::api::ObjectList<Database>,
    backups: &kube::api::ObjectList<Backup>,
    migrations: &kube::api::ObjectList<Migration>,
) {
    observe_list(world, "Database", dbs, database_seen);
    observe_list(world, "Backup", backups, backup_seen);
    observe_list(world, "Migration", migrations, migration_seen);
}

/// Starts the three watches.
pub(crate) fn spawn(world: Arc<World>) -> Vec<tokio::task::JoinHandle<()>> {
    vec![
        super::spawn(watch::<Database>(world.clone(), database_seen)),
        super::spawn(watch::<Backup>(world.clone(), backup_seen)),
        super::spawn(watch::<Migration>(world, migration_seen)),
    ]
}

async fn watch<K>(world: Arc<World>, seen: fn(&K) -> Seen)
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(world.client.clone(), NS);
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(stream);
    while let Some(event) = stream.next().await {
        let Ok(event) = event else { continue };
        match event {
            watcher::Event::InitApply(obj) | watcher::Event::Apply(obj) => {
                observe_one(&world, &obj, seen);
            }
            // What vanished while not watching: the driver's and the settling's lists
            // (consistent snapshots with a resourceVersion) tell; see `observe_list`.
            watcher::Event::Init | watcher::Event::InitDone => {}
            watcher::Event::Delete(obj) => {
                if let Some(s) = world.history.gone(&obj.uid().unwrap_or_default()) {
                    note_gone(&world, &s);
                }
            }
        }
    }
}

fn note_change(world: &World, before: Option<&Seen>, now: &Seen) {
    let changed = before.is_none_or(|b| b.phase != now.phase);
    if !changed {
        return;
    }
    let word = now.phase.split_whitespace().next().unwrap_or_default();
    let terminal = matches!(
        (now.kind, word),
        ("Backup", "Completed" | "Failed")
            | (
                "Migration",
                "Succeeded" | "RolledBack" | "Failed" | "AwaitingApproval"
            )
    );
    if terminal {
        world.journal.line(
            "OBSERVED",
            format!("{} {}: {}", now.kind, now.name, now.phase),
        );
    }
}

fn note_gone(world: &World, s: &Seen) {
    let what = match s.kind {
        "Database" => format!("policy {}, on {}", s.policy, s.server),
        "Backup" => format!("policy {}, of {}, {}", s.policy, s.server, s.phase),
        _ => format!("of {}, to {}, {}", s.server, s.policy, s.phase),
    };
    world.journal.line(
        "OBSERVED",
        format!("{} {} is gone ({what})", s.kind, s.name),
    );
}
