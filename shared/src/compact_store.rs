//! A watch cache that keeps each object as the JSON of what it keeps of it: one
//! allocation per object instead of the few dozen of the decoded form (issue 35).
//!
//! kube-runtime's `Store` keeps each object decoded: a connection Secret cut down to its
//! password, username and a digest (`keep_in_cache` in the database-controller) still
//! took 456 bytes of struct and 25 more allocations (its name, namespace, uid and
//! resource version, an owner reference of five strings, and one B-tree node of about
//! 540 bytes for each of its labels, annotations and data, however few their entries):
//! 3.4 KB of heap, against 0.8 KB for its JSON. A cache read only by key, a few times per
//! reconcile, can afford to decode what it hands out: [`CompactStore::get`] decodes the
//! kept JSON into a new object each time.
//!
//! It follows a kube `watcher` stream as kube's reflector does ([`CompactStore::apply`]
//! on each event, before anyone hears of it): a relist is built aside and replaces the
//! objects when it is complete, so objects deleted while the watch was down go, and reads
//! meanwhile see the cache as it was. [`CompactStore::ready_within`] waits for the first
//! complete list; every waiter is woken when it comes.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use kube::Resource;
use kube::runtime::watcher;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::relisted::Relisted;

/// `namespace/name` (`name` for a cluster-scoped object).
type Key = Box<str>;
/// The object's JSON.
type Kept = Box<str>;

struct Inner {
    objects: Relisted<HashMap<Key, Kept>>,
    /// Whether a first list has completed.
    ready: watch::Sender<bool>,
}

/// A cache of `K` filled from a watch, each object kept as its JSON (see the module's
/// documentation). Clones share the cache.
pub struct CompactStore<K> {
    inner: Arc<Inner>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for CompactStore<K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> Default for CompactStore<K> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Inner {
                objects: Relisted::default(),
                ready: watch::Sender::new(false),
            }),
            kind: PhantomData,
        }
    }
}

fn key(namespace: Option<&str>, name: &str) -> Key {
    match namespace {
        Some(namespace) => format!("{namespace}/{name}").into_boxed_str(),
        None => name.into(),
    }
}

impl<K> CompactStore<K>
where
    K: Resource + Serialize + DeserializeOwned,
{
    pub fn new() -> Self {
        Self::default()
    }

    fn key_of(obj: &K) -> Option<Key> {
        let meta = obj.meta();
        Some(key(meta.namespace.as_deref(), meta.name.as_deref()?))
    }

    /// The object's JSON; `None` (and a warning) if it does not encode, which a
    /// Kubernetes object always does.
    fn kept(obj: &K) -> Option<Kept> {
        match serde_json::to_string(obj) {
            Ok(json) => Some(json.into_boxed_str()),
            Err(error) => {
                tracing::warn!(%error, name = ?obj.meta().name, "an object the cache could not encode is left out of it");
                None
            }
        }
    }

    /// Follows one event of the watch (as kube's reflector does).
    pub fn apply(&self, event: &watcher::Event<K>) {
        let ended = self.inner.objects.follow(
            event,
            |objects, obj| {
                let Some(key) = Self::key_of(obj) else { return };
                match Self::kept(obj) {
                    Some(kept) => objects.insert(key, kept),
                    // Never a stale copy in its place.
                    None => objects.remove(&key),
                };
            },
            |objects, obj| {
                if let Some(key) = Self::key_of(obj) {
                    objects.remove(&key);
                }
            },
            || None,
        );
        if ended {
            self.inner.objects.write().shrink_to_fit();
            self.inner.ready.send_replace(true);
        }
    }

    /// The object `name` (of `namespace`), decoded from what the cache keeps.
    pub fn get(&self, namespace: Option<&str>, name: &str) -> Option<Arc<K>> {
        let objects = self.inner.objects.read();
        let kept = objects.get(&key(namespace, name))?;
        match serde_json::from_str(kept) {
            Ok(obj) => Some(Arc::new(obj)),
            Err(error) => {
                // It was encoded from a `K`: not expected. Read as not cached, so the
                // caller asks the API.
                tracing::warn!(%error, name, "a cached object did not decode; read as absent");
                None
            }
        }
    }

    /// Whether the cache holds `name` (of `namespace`), without decoding it.
    pub fn contains(&self, namespace: Option<&str>, name: &str) -> bool {
        self.inner
            .objects
            .read()
            .contains_key(&key(namespace, name))
    }

    /// How many objects the cache holds.
    pub fn len(&self) -> usize {
        self.inner.objects.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a first list has completed.
    pub fn is_ready(&self) -> bool {
        *self.inner.ready.borrow()
    }

    /// Whether a first list completes within `bound` (at once if it has). Every waiter
    /// is woken when it does.
    pub async fn ready_within(&self, bound: Duration) -> bool {
        let mut ready = self.inner.ready.subscribe();
        matches!(
            tokio::time::timeout(bound, ready.wait_for(|r| *r)).await,
            Ok(Ok(_))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::ObjectMeta;
    use std::collections::BTreeMap;

    fn secret(name: &str, password: &str) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("team-a".into()),
                uid: Some(format!("uid-{name}")),
                resource_version: Some("7".into()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".into(),
                    "dbops".into(),
                )])),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([(
                "password".into(),
                ByteString(password.as_bytes().to_vec()),
            )])),
            ..Secret::default()
        }
    }

    fn listed(store: &CompactStore<Secret>, objects: &[Secret]) {
        store.apply(&watcher::Event::Init);
        for obj in objects {
            store.apply(&watcher::Event::InitApply(obj.clone()));
        }
        store.apply(&watcher::Event::InitDone);
    }

    #[test]
    fn what_it_hands_out_is_what_the_watch_said() {
        let store = CompactStore::new();
        let a = secret("a-connection", "first");
        listed(&store, std::slice::from_ref(&a));
        assert_eq!(
            store.get(Some("team-a"), "a-connection").as_deref(),
            Some(&a)
        );
        assert!(store.contains(Some("team-a"), "a-connection"));
        assert!(store.get(Some("team-b"), "a-connection").is_none());

        let changed = secret("a-connection", "second");
        store.apply(&watcher::Event::Apply(changed.clone()));
        assert_eq!(
            store.get(Some("team-a"), "a-connection").as_deref(),
            Some(&changed)
        );
        store.apply(&watcher::Event::Delete(changed));
        assert!(store.get(Some("team-a"), "a-connection").is_none());
        assert!(store.is_empty());
    }

    #[test]
    fn a_relist_replaces_the_objects_once_complete() {
        let store = CompactStore::new();
        listed(&store, &[secret("gone", "p"), secret("stays", "p")]);
        store.apply(&watcher::Event::Init);
        store.apply(&watcher::Event::InitApply(secret("stays", "q")));
        // Mid-relist, reads see the cache as it was.
        assert!(store.contains(Some("team-a"), "gone"));
        store.apply(&watcher::Event::InitDone);
        assert!(!store.contains(Some("team-a"), "gone"));
        assert_eq!(
            store.get(Some("team-a"), "stays").as_deref(),
            Some(&secret("stays", "q"))
        );
        assert_eq!(store.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn every_waiter_hears_of_the_first_list() {
        let store: CompactStore<Secret> = CompactStore::new();
        assert!(!store.is_ready());
        assert!(!store.ready_within(Duration::from_secs(1)).await);
        let waiters: Vec<_> = (0..16)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.ready_within(Duration::from_secs(30)).await })
            })
            .collect();
        tokio::task::yield_now().await;
        listed(&store, &[]);
        for waiter in waiters {
            assert!(waiter.await.expect("the waiter ran"));
        }
        assert!(store.is_ready());
    }
}
