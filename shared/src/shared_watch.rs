//! One watch of a kind for a whole process (issue 41): its store, what each controller of
//! the process that follows the kind needs of its changes, and indexes that answer "which
//! objects have this key" without a scan of the store.
//!
//! A process that runs several controllers (the database-controller runs three) used to
//! open one watch of a kind per use: the apiserver sent every Database change four times
//! and the process decoded it four times. Here one watch fills one store, and each use
//! subscribes before the watch starts:
//! - [`SharedWatch::applied`]: the owning controller's trigger (created or changed
//!   objects, filtered by a [`Trigger`]), for kube's `Controller::for_shared_stream`;
//! - [`SharedWatch::touched`]: every change, deletions included (the object as it was
//!   last seen), for `watches_shared_stream` of another controller or a mapper;
//! - [`SharedWatch::index`]: the objects by keys a function gives (an object may have
//!   none), kept up to date before any subscriber hears of the change.
//!
//! [`SharedWatch::start`] runs the watch on a task of its own; the returned
//! [`WatchTask`] ends it when dropped (the controllers' wiring holds it). A watch that
//! runs from the process's start (the DatabaseServer directory's, before the Lease is
//! taken) takes subscriptions later too: a late subscriber first hears of every object
//! the store holds, then of each change, as if it had been there for the first list.
//! Each subscriber has a bounded channel: one that is not polled holds the watch up (as
//! kube's own shared streams do), so every subscription must be driven; one whose stream
//! was dropped (a Lease lost) is forgotten.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher;
use tokio::sync::mpsc;

use crate::relisted::Relisted;

/// How many changes a subscriber may have waiting before the watch waits for it.
const BUFFER: usize = 1024;

/// Which changes of the controller's own kind start a reconcile (the filter of
/// [`SharedWatch::applied`], and of `controller::Running::controller`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// Every change, status included.
    AnyChange,
    /// Only a new `metadata.generation` (spec changes and the start of deletion): the
    /// controller's own status writes then start no reconcile. Requeues, and the extra
    /// watches, still do.
    GenerationChange,
    /// A new `metadata.generation` or a change of the annotations (an annotation that asks
    /// for something, such as `dbops.dev/rotate`).
    GenerationOrAnnotations,
}

impl Trigger {
    /// What the filter compares between two sightings of an object; `None` passes always.
    fn fingerprint<K: Resource>(self, obj: &K) -> Option<u64> {
        let meta = obj.meta();
        let mut h = DefaultHasher::new();
        match self {
            Trigger::AnyChange => return None,
            Trigger::GenerationChange => meta.generation?.hash(&mut h),
            Trigger::GenerationOrAnnotations => {
                meta.generation?.hash(&mut h);
                if let Some(annotations) = &meta.annotations {
                    for (k, v) in annotations {
                        (k, v).hash(&mut h);
                    }
                }
            }
        }
        Some(h.finish())
    }
}

/// The key of an object in a subscriber's filter: its namespace, name and uid, hashed.
fn identity<K: Resource>(obj: &K) -> u64 {
    let meta = obj.meta();
    let mut h = DefaultHasher::new();
    (&meta.namespace, &meta.name, &meta.uid).hash(&mut h);
    h.finish()
}

/// What a shared watch keeps: a Kubernetes object that tasks share.
pub trait Watchable:
    Resource<DynamicType = ()> + Clone + std::fmt::Debug + Send + Sync + 'static
{
}

impl<K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + Send + Sync + 'static> Watchable
    for K
{
}

type Keys<K> = Arc<dyn Fn(&K) -> Vec<String> + Send + Sync>;
type Observer<K> = Arc<dyn Fn(&K) + Send + Sync>;

struct Maps<K: Watchable> {
    by_key: HashMap<String, HashSet<ObjectRef<K>>>,
    of: HashMap<ObjectRef<K>, Vec<String>>,
}

impl<K: Watchable> Default for Maps<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
            of: HashMap::new(),
        }
    }
}

impl<K: Watchable> Maps<K> {
    fn put(&mut self, obj: &K, keys: Vec<String>) {
        let r = ObjectRef::from_obj(obj);
        self.remove(&r);
        if keys.is_empty() {
            return;
        }
        for key in &keys {
            self.by_key
                .entry(key.clone())
                .or_default()
                .insert(r.clone());
        }
        self.of.insert(r, keys);
    }

    fn remove(&mut self, r: &ObjectRef<K>) {
        for key in self.of.remove(r).unwrap_or_default() {
            if let Some(set) = self.by_key.get_mut(&key) {
                set.remove(r);
                if set.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
    }
}

/// The objects of a [`SharedWatch`] by the keys a function gives each of them.
pub struct Index<K: Watchable> {
    /// The maps, and those a relist builds until it is complete.
    maps: Arc<Relisted<Maps<K>>>,
    keys: Keys<K>,
    store: Store<K>,
}

impl<K: Watchable> Clone for Index<K> {
    fn clone(&self) -> Self {
        Self {
            maps: self.maps.clone(),
            keys: self.keys.clone(),
            store: self.store.clone(),
        }
    }
}

impl<K: Watchable> Index<K> {
    /// The objects whose keys include `key`, as the store holds them now.
    pub fn get(&self, key: &str) -> Vec<Arc<K>> {
        let refs: Vec<ObjectRef<K>> = {
            let maps = self.maps.read();
            match maps.by_key.get(key) {
                Some(set) => set.iter().cloned().collect(),
                None => return Vec::new(),
            }
        };
        refs.iter().filter_map(|r| self.store.get(r)).collect()
    }

    /// Every object that has at least one key, as the store holds it now.
    pub fn all(&self) -> Vec<Arc<K>> {
        let refs: Vec<ObjectRef<K>> = {
            let maps = self.maps.read();
            maps.of.keys().cloned().collect()
        };
        refs.iter().filter_map(|r| self.store.get(r)).collect()
    }

    /// How many objects have at least one key.
    pub fn len(&self) -> usize {
        self.maps.read().of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn apply(&self, event: &watcher::Event<K>) {
        self.maps.follow(
            event,
            |maps, obj| maps.put(obj, (self.keys)(obj)),
            |maps, obj| maps.remove(&ObjectRef::from_obj(obj)),
            // An index made in the middle of a relist saw none of it: it is built from
            // the store the relist left.
            || Some(self.rebuilt()),
        );
    }

    /// The maps of what the store holds now.
    fn rebuilt(&self) -> Maps<K> {
        let mut maps: Maps<K> = Maps::default();
        for obj in self.store.state() {
            maps.put(obj.as_ref(), (self.keys)(obj.as_ref()));
        }
        maps
    }
}

/// One subscription: its channel, and for [`SharedWatch::applied`] its filter and what it
/// last passed of each object.
struct Subscriber<K> {
    tx: mpsc::Sender<Arc<K>>,
    /// `None`: every change, deletions included ([`SharedWatch::touched`]).
    filter: Option<Mutex<(Trigger, HashMap<u64, u64>)>>,
}

impl<K: Resource> Subscriber<K> {
    /// Whether the subscriber hears of `obj`'s change (`deleted`: its deletion).
    fn wants(&self, obj: &K, deleted: bool) -> bool {
        let Some(filter) = &self.filter else {
            return true;
        };
        let mut filter = filter.lock().unwrap_or_else(|e| e.into_inner());
        let (filter, seen) = &mut *filter;
        let id = identity(obj);
        if deleted {
            seen.remove(&id);
            return false;
        }
        match filter.fingerprint(obj) {
            None => true,
            Some(now) => seen.insert(id, now) != Some(now),
        }
    }

    /// After a relist: forgets the objects not in `live` (deleted while the watch was
    /// down, so no deletion was seen).
    fn forget_gone(&self, live: &HashSet<u64>) {
        if let Some(filter) = &self.filter {
            let mut filter = filter.lock().unwrap_or_else(|e| e.into_inner());
            filter.1.retain(|id, _| live.contains(id));
        }
    }
}

/// What the watch's task and every handle share.
struct Shared<K: Watchable> {
    name: String,
    store: Store<K>,
    subscribers: Mutex<Vec<Arc<Subscriber<K>>>>,
    indexes: Mutex<Vec<Index<K>>>,
    /// Told of each object created or changed, after the store and the indexes and before
    /// any subscriber ([`SharedWatch::on_change`]).
    observers: Mutex<Vec<Observer<K>>>,
    /// Whether the first list is being (or has been) taken: a later subscriber is told of
    /// what the store holds first.
    started: std::sync::atomic::AtomicBool,
}

type Events<K> = futures::stream::BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

/// A watch not started yet: its events and its store's writer.
type Unstarted<K> = (Events<K>, reflector::store::Writer<K>);

/// One watch of `K`, its store, subscriptions and indexes (see the module documentation).
/// Clones are handles on the same watch.
pub struct SharedWatch<K: Watchable> {
    shared: Arc<Shared<K>>,
    /// The watch and the store's writer, until [`SharedWatch::start`] takes them.
    unstarted: Arc<Mutex<Option<Unstarted<K>>>>,
}

impl<K: Watchable> Clone for SharedWatch<K> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            unstarted: self.unstarted.clone(),
        }
    }
}

/// A running [`SharedWatch`]: dropping it ends the watch.
pub struct WatchTask(tokio::task::JoinHandle<()>);

impl Drop for WatchTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<K: Watchable> SharedWatch<K> {
    /// A watch of `events` (a kube `watcher` stream with its backoff), named `name` in
    /// logs; nothing runs until [`SharedWatch::start`].
    pub fn new(
        name: impl Into<String>,
        events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    ) -> Self {
        let (store, writer) = reflector::store();
        Self {
            shared: Arc::new(Shared {
                name: name.into(),
                store,
                subscribers: Mutex::default(),
                indexes: Mutex::default(),
                observers: Mutex::default(),
                started: Default::default(),
            }),
            unstarted: Arc::new(Mutex::new(Some((events.boxed(), writer)))),
        }
    }

    /// The store the watch fills.
    pub fn store(&self) -> Store<K> {
        self.shared.store.clone()
    }

    fn subscribe(&self, filter: Option<Trigger>) -> impl Stream<Item = Arc<K>> + Send + 'static {
        let mut subscribers = self
            .shared
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Late: told first of what the store holds (with room for it).
        let late = self
            .shared
            .started
            .load(std::sync::atomic::Ordering::Acquire)
            .then(|| self.shared.store.state());
        let room = BUFFER + late.as_ref().map_or(0, Vec::len);
        let (tx, mut rx) = mpsc::channel(room);
        let subscriber: Arc<Subscriber<K>> = Arc::new(Subscriber {
            tx,
            filter: filter.map(|f| Mutex::new((f, HashMap::new()))),
        });
        for obj in late.into_iter().flatten() {
            if subscriber.wants(obj.as_ref(), false) {
                let _ = subscriber.tx.try_send(obj);
            }
        }
        subscribers.push(subscriber);
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    /// The objects created or changed as `filter` says (a deletion is not one).
    pub fn applied(&self, filter: Trigger) -> impl Stream<Item = Arc<K>> + Send + 'static {
        self.subscribe(Some(filter))
    }

    /// Every change, deletions included (the object as last seen).
    pub fn touched(&self) -> impl Stream<Item = Arc<K>> + Send + 'static {
        self.subscribe(None)
    }

    /// An index of the objects by `keys` (an object with none is not in it).
    pub fn index(&self, keys: impl Fn(&K) -> Vec<String> + Send + Sync + 'static) -> Index<K> {
        let mut indexes = self
            .shared
            .indexes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let index = Index {
            maps: Arc::default(),
            keys: Arc::new(keys),
            store: self.shared.store.clone(),
        };
        *index.maps.write() = index.rebuilt();
        indexes.push(index.clone());
        index
    }

    /// Calls `f` with each object the watch reports created or changed, as the store holds
    /// it now (after the indexes, before any subscriber hears of it): for what must follow
    /// the cache at once, such as a memo of writes the cache has not shown yet. Neither a
    /// deletion nor a relist's objects (the store holds those once the relist is complete).
    pub fn on_change(&self, f: impl Fn(&K) + Send + Sync + 'static) {
        self.shared
            .observers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::new(f));
    }

    /// Runs the watch until the returned task is dropped (a second call runs nothing). A
    /// failed list or watch is logged (the client reports it to the watch health) and
    /// retried with the stream's backoff.
    pub fn start(&self) -> WatchTask {
        let unstarted = self
            .unstarted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some((events, writer)) = unstarted else {
            return WatchTask(tokio::spawn(async {}));
        };
        let shared = self.shared.clone();
        shared
            .started
            .store(true, std::sync::atomic::Ordering::Release);
        WatchTask(tokio::spawn(async move {
            let mut events = std::pin::pin!(reflector(writer, events));
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => shared.dispatch(&event).await,
                    Err(error) => {
                        tracing::warn!(%error, watch = shared.name, "watch failed; retrying with backoff");
                    }
                }
            }
        }))
    }
}

impl<K: Watchable> Shared<K> {
    /// One event, after the store took it: the indexes, then each subscriber that wants it.
    async fn dispatch(&self, event: &watcher::Event<K>) {
        for index in self
            .indexes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            index.apply(event);
        }
        let (obj, deleted) = match event {
            watcher::Event::Apply(obj) | watcher::Event::InitApply(obj) => {
                (as_stored(&self.store, obj), false)
            }
            watcher::Event::Delete(obj) => (Arc::new(obj.clone()), true),
            watcher::Event::InitDone => {
                let live: HashSet<u64> = self
                    .store
                    .state()
                    .iter()
                    .map(|o| identity(o.as_ref()))
                    .collect();
                for sub in self.subscribers() {
                    sub.forget_gone(&live);
                }
                return;
            }
            watcher::Event::Init => return,
        };
        // A relist's objects are the store's only once it is complete: not observed.
        if matches!(event, watcher::Event::Apply(_)) {
            let observers = self
                .observers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for observe in observers {
                observe(&obj);
            }
        }
        let mut gone = false;
        for sub in self.subscribers() {
            if sub.wants(&obj, deleted) && sub.tx.send(obj.clone()).await.is_err() {
                gone = true;
            }
        }
        if gone {
            self.subscribers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|s| !s.tx.is_closed());
            tracing::debug!(watch = self.name, "a subscriber ended");
        }
    }

    fn subscribers(&self) -> Vec<Arc<Subscriber<K>>> {
        self.subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// `obj` as the store holds it when that is this very version (no second copy), else a
/// copy of its own (during a relist the store keeps the old list until it is complete).
fn as_stored<K: Watchable>(store: &Store<K>, obj: &K) -> Arc<K> {
    match store.get(&ObjectRef::from_obj(obj)) {
        Some(held) if held.meta().resource_version == obj.meta().resource_version => held,
        _ => Arc::new(obj.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::{SharedWatch, Trigger};
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::watcher::Event;
    use std::collections::BTreeMap;

    fn cm(name: &str, generation: i64, label: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                generation: Some(generation),
                resource_version: Some(format!("{generation}{label}")),
                labels: Some(BTreeMap::from([("k".to_string(), label.to_string())])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn label(c: &ConfigMap) -> Vec<String> {
        c.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("k").cloned())
            .into_iter()
            .collect()
    }

    /// One watch, three uses: the owner hears of new generations only, a mapper of every
    /// change and deletion, and the index answers by label through a relist.
    #[tokio::test]
    async fn each_subscriber_hears_what_it_asked_for_and_the_index_follows() {
        let events = vec![
            Event::Init,
            Event::InitApply(cm("a", 1, "x")),
            Event::InitApply(cm("b", 1, "y")),
            Event::InitDone,
            Event::Apply(cm("a", 1, "z")),
            Event::Apply(cm("a", 2, "z")),
            Event::Delete(cm("b", 1, "y")),
            Event::Init,
            Event::InitApply(cm("a", 2, "x")),
            Event::InitApply(cm("c", 1, "x")),
            Event::InitDone,
        ];
        let watch = SharedWatch::new("test", futures::stream::iter(events.into_iter().map(Ok)));
        let owner = watch.applied(Trigger::GenerationChange);
        let mapper = watch.touched();
        let index = watch.index(label);
        let task = watch.start();
        let names = |s: Vec<std::sync::Arc<ConfigMap>>| -> Vec<String> {
            s.iter()
                .map(|c| c.metadata.name.clone().unwrap_or_default())
                .collect()
        };
        let owner: Vec<_> = owner.take(4).collect().await;
        assert_eq!(
            names(owner),
            ["a", "b", "a", "c"],
            "a's generation 2 once, no deletion"
        );
        let mapper: Vec<_> = mapper.take(7).collect().await;
        assert_eq!(names(mapper), ["a", "b", "a", "a", "b", "a", "c"]);
        let mut x = names(index.get("x"));
        x.sort();
        assert_eq!(x, ["a", "c"]);
        assert!(index.get("y").is_empty() && index.get("z").is_empty());
        assert_eq!(index.len(), 2);
        assert_eq!(index.all().len(), 2);
        drop(task);
    }

    /// An observer sees each created or changed object once the store holds it, before
    /// any subscriber hears of it; no deletion, and not a relist's objects.
    #[tokio::test]
    async fn an_observer_sees_each_change_as_the_store_holds_it_before_the_subscribers() {
        let events = vec![
            Event::Init,
            Event::InitApply(cm("a", 1, "x")),
            Event::InitDone,
            Event::Apply(cm("a", 2, "y")),
            Event::Delete(cm("a", 2, "y")),
            Event::Apply(cm("b", 1, "z")),
        ];
        let watch = SharedWatch::new(
            "observed",
            futures::stream::iter(events.into_iter().map(Ok)),
        );
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let store = watch.store();
        let log = seen.clone();
        watch.on_change(move |c: &ConfigMap| {
            let held = store
                .get(&kube::runtime::reflector::ObjectRef::from_obj(c))
                .is_some_and(|h| h.metadata.resource_version == c.metadata.resource_version);
            log.lock().unwrap().push((label(c), held));
        });
        let touched = watch.touched();
        let task = watch.start();
        let heard: Vec<_> = touched.take(4).collect().await;
        assert_eq!(
            heard.len(),
            4,
            "the subscriber heard every change, the deletion too"
        );
        assert_eq!(
            *seen.lock().unwrap(),
            [(vec!["y".to_string()], true), (vec!["z".to_string()], true)],
            "each change once, as the store holds it; no deletion, no relist"
        );
        drop(task);
    }

    /// A subscriber and an index that come after the watch started hear of every object
    /// the store holds, then of each change.
    #[tokio::test]
    async fn a_late_subscriber_hears_of_what_the_store_holds_first() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let watch = SharedWatch::new("late", rx);
        let early = watch.touched();
        let task = watch.start();
        for e in [
            Event::Init,
            Event::InitApply(cm("a", 1, "x")),
            Event::InitDone,
        ] {
            tx.unbounded_send(Ok(e)).unwrap();
        }
        let early: Vec<_> = early.take(1).collect().await;
        assert_eq!(early.len(), 1);
        let late = watch.applied(Trigger::GenerationChange);
        let index = watch.index(label);
        tx.unbounded_send(Ok(Event::Apply(cm("a", 1, "y"))))
            .unwrap();
        tx.unbounded_send(Ok(Event::Apply(cm("b", 1, "y"))))
            .unwrap();
        let late: Vec<_> = late.take(2).collect().await;
        let names: Vec<_> = late
            .iter()
            .map(|c| c.metadata.name.clone().unwrap_or_default())
            .collect();
        assert_eq!(
            names,
            ["a", "b"],
            "a from the store, not again for a label; then b"
        );
        assert_eq!(index.get("y").len(), 2);
        assert!(index.get("x").is_empty());
        drop(task);
    }
}
