//! The watches (and lists) that feed the [`History`]: every Database, Backup and Migration
//! seen, each change and disappearance printed to the journal.

use std::sync::Arc;

use dbops_api::{Backup, BackupPhase, Database, Migration};
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::history::Seen;
use super::world::{NS, World};

/// What every kind's [`Seen`] holds: its kind, name, policy, server and phase (none yet:
/// empty).
fn seen(
    kind: &'static str,
    obj: &impl ResourceExt,
    policy: String,
    server: &str,
    phase: Option<String>,
) -> Seen {
    Seen {
        kind,
        name: obj.name_any(),
        policy,
        server: server.to_string(),
        phase: phase.unwrap_or_default(),
        ..Seen::default()
    }
}

fn database_seen(d: &Database) -> Seen {
    let ready = d
        .status
        .as_ref()
        .and_then(|s| super::world::ready_condition(&s.conditions))
        .map(|(st, reason, _)| format!("Ready={st}/{reason}"));
    let policy = format!("{:?}", d.spec.deletion_policy);
    Seen {
        generation: d.metadata.generation.unwrap_or(0),
        observed: d
            .status
            .as_ref()
            .and_then(|s| s.observed_generation)
            .unwrap_or(0),
        ..seen("Database", d, policy, &d.spec.server_ref.name, ready)
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
    let phase = b.status.as_ref().and_then(|s| {
        let why = failure(&s.conditions);
        Some(match s.phase? {
            BackupPhase::Failed if !why.is_empty() => format!("Failed ({})", &why[2..]),
            p => format!("{p:?}"),
        })
    });
    let policy = format!("{:?}", b.spec.deletion_policy);
    seen("Backup", b, policy, &b.spec.database_ref.name, phase)
}

fn migration_seen(m: &Migration) -> Seen {
    let phase = m.status.as_ref().and_then(|s| {
        let phase = format!("{:?}", s.phase?);
        Some(match (&s.failed_step, failure(&s.conditions)) {
            (Some(step), why) => format!("{phase} (failed step {step:?}{why})"),
            (None, why) if !why.is_empty() => format!("{phase} ({})", &why[2..]),
            _ => phase,
        })
    });
    let target = m.spec.target.server_ref.name.clone();
    seen("Migration", m, target, &m.spec.database_ref.name, phase)
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
        super::world::spawn(watch::<Database>(world.clone(), database_seen)),
        super::world::spawn(watch::<Backup>(world.clone(), backup_seen)),
        super::world::spawn(watch::<Migration>(world, migration_seen)),
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
