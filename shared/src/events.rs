//! Events about the objects a controller reconciles.
//!
//! [`Recorder`] stands in for kube-runtime's recorder of the same name, whose cache keeps a
//! full copy of every Event it sent for six minutes (about 4 KiB each: a burst of 10,000
//! new Databases held ~40 MiB) and scans all of them on every publish. This one keeps, per
//! Event sent in the last six minutes, only what a repeat needs: the Event's name and
//! namespace, its count and when it was last seen (~100 bytes), at most [`MAX_REMEMBERED`]
//! of them. A repeat (same object, type, action, reason and note) within that window adds
//! to the Event's `series` instead of creating another Event, as kube's does.

use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
    sync::{Arc, Mutex, PoisonError},
};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        events::v1::{Event as K8sEvent, EventSeries},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, Resource,
    api::{Patch, PatchParams, PostParams},
    runtime::events::{Event, EventType, Reporter},
};
use serde_json::json;
use tracing::Instrument;

/// How long a sent Event is remembered for a repeat to join its series.
const REMEMBERED_FOR: SignedDuration = SignedDuration::from_mins(6);
/// The most Events remembered at once; past it the oldest are forgotten (a repeat of a
/// forgotten one is a new Event, nothing worse).
pub const MAX_REMEMBERED: usize = 4096;
/// The expired entries are swept at most this often (and whenever the map is full).
const SWEEP_EVERY: SignedDuration = SignedDuration::from_secs(30);

/// What is kept of a sent Event.
#[derive(Debug, Clone)]
struct Sent {
    name: String,
    namespace: String,
    count: i32,
    last: Timestamp,
}

#[derive(Debug, Default)]
struct Memory {
    sent: HashMap<u64, Sent>,
    swept: Option<Timestamp>,
}

impl Memory {
    /// Drops what is older than the window; when still full, the oldest half.
    fn sweep(&mut self, now: Timestamp) {
        let due = self.swept.is_none_or(|at| at + SWEEP_EVERY <= now);
        if !due && self.sent.len() < MAX_REMEMBERED {
            return;
        }
        self.swept = Some(now);
        self.sent.retain(|_, s| s.last + REMEMBERED_FOR > now);
        if self.sent.len() >= MAX_REMEMBERED {
            let mut times: Vec<Timestamp> = self.sent.values().map(|s| s.last).collect();
            times.sort_unstable();
            let cut = times[times.len() / 2];
            self.sent.retain(|_, s| s.last > cut);
        }
    }
}

/// Publishes Events as one reporting controller (see the module's notes).
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    memory: Arc<Mutex<Memory>>,
}

impl Recorder {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            memory: Arc::default(),
        }
    }

    fn key(&self, ev: &Event, regarding: &ObjectReference) -> u64 {
        let mut h = DefaultHasher::new();
        (ev.type_ == EventType::Normal).hash(&mut h);
        ev.action.hash(&mut h);
        ev.reason.hash(&mut h);
        ev.note.hash(&mut h);
        for r in std::iter::once(regarding).chain(ev.secondary.as_ref()) {
            (&r.kind, &r.namespace, &r.name, &r.uid).hash(&mut h);
        }
        h.finish()
    }

    fn event(&self, ev: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        let controller = &self.reporter.controller;
        K8sEvent {
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            note: ev.note.clone(),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: ev.secondary.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or(controller),
                    now.as_nanosecond()
                )),
                ..ObjectMeta::default()
            },
            reporting_controller: Some(controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| controller.clone()),
            ),
            type_: Some(
                match ev.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .into(),
            ),
            ..K8sEvent::default()
        }
    }

    /// Creates the Event, or adds to the series of the same Event sent within the window.
    pub async fn publish(&self, ev: &Event, regarding: &ObjectReference) -> kube::Result<()> {
        let now = Timestamp::now();
        let key = self.key(ev, regarding);
        let repeat = {
            let mut memory = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
            memory.sweep(now);
            memory.sent.get(&key).cloned()
        };
        let sent = match repeat {
            Some(before) => {
                let count = before.count + 1;
                let series = EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                };
                Api::<K8sEvent>::namespaced(self.client.clone(), &before.namespace)
                    .patch(
                        &before.name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({ "series": series })),
                    )
                    .await?;
                Sent {
                    count,
                    last: now,
                    ..before
                }
            }
            None => {
                let event = self.event(ev, regarding, now);
                // A cluster-scoped object's Events go to "default", as kube's recorder does.
                let namespace = event
                    .metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".into());
                let created = Api::<K8sEvent>::namespaced(self.client.clone(), &namespace)
                    .create(&PostParams::default(), &event)
                    .await?;
                Sent {
                    name: created.metadata.name.unwrap_or_default(),
                    namespace,
                    count: 1,
                    last: now,
                }
            }
        };
        self.memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .sent
            .insert(key, sent);
        Ok(())
    }
}

/// Publishes a Normal (or Warning) Event about `obj` in the background: the reconcile does
/// not wait for the API server (one request less on its path), and a failure is logged,
/// never fatal: an Event is a report, not a step of the reconcile. The request stays in
/// the reconcile's trace. Only through `crate::status`: with a status write, or
/// [`crate::status::announce`].
pub(crate) async fn publish<K>(
    recorder: &Recorder,
    obj: &K,
    normal: bool,
    action: &str,
    reason: &str,
    note: &str,
) where
    K: Resource<DynamicType = ()>,
{
    let ev = Event {
        type_: if normal {
            EventType::Normal
        } else {
            EventType::Warning
        },
        reason: reason.to_string(),
        note: Some(note.to_string()),
        action: action.to_string(),
        secondary: None,
    };
    let reference = obj.object_ref(&());
    let reason = ev.reason.clone();
    let recorder = recorder.clone();
    tokio::spawn(
        async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::warn!(error = %e, reason, "could not publish an Event");
            }
        }
        .in_current_span(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(last: Timestamp) -> Sent {
        Sent {
            name: "db.1".into(),
            namespace: "shop".into(),
            count: 1,
            last,
        }
    }

    #[test]
    fn events_are_forgotten_after_the_window_and_never_past_the_cap() {
        let start = Timestamp::from_second(1_800_000_000).unwrap();
        let mut memory = Memory::default();
        memory.sent.insert(1, sent(start));
        memory
            .sent
            .insert(2, sent(start + SignedDuration::from_mins(5)));
        memory.sweep(start + SignedDuration::from_mins(7));
        assert_eq!(
            memory.sent.keys().collect::<Vec<_>>(),
            [&2],
            "one past 6 min"
        );

        let mut full = Memory::default();
        for i in 0..MAX_REMEMBERED as u64 {
            full.sent
                .insert(i, sent(start + SignedDuration::from_millis(i as i64)));
        }
        // Swept just now, yet full: the older half goes.
        full.swept = Some(start + SignedDuration::from_secs(10));
        full.sweep(start + SignedDuration::from_secs(10));
        assert!(full.sent.len() <= MAX_REMEMBERED / 2);
        assert!(
            full.sent.contains_key(&(MAX_REMEMBERED as u64 - 1)),
            "the newest stays"
        );
    }
}
