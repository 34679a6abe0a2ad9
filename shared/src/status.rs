//! One way to write a status, and the Events it implies, for every kind.
//!
//! # The path
//! Per kind, the controller has a **pure** `desired(object, outcome) -> Desired<Status>`:
//! the status it should have and the Events that the change from the current one implies
//! (unit-tested without a cluster). Then one call, [`StatusWriter::write`], which
//! 1. writes nothing when the desired status equals the latest one (see below): a converged
//!    object costs no API write;
//! 2. otherwise replaces `/status` whole with one JSON patch whose preconditions the API
//!    server checks against the stored object: always `test /metadata/uid` (a status is
//!    never written onto an object deleted and created again under the same name since it
//!    was read), and with [`Guard::ResourceVersion`] also `test /metadata/resourceVersion`;
//! 3. remembers what it wrote, and publishes the Events only once the write succeeded.
//!
//! # The stale cache: one answer
//! A reconcile reads its object from the watch cache, which may be older than this
//! process's own last write (the watch delivers it later). One controller process, the
//! leader, is the only writer of a kind's status, so a cached status that differs from
//! the one this process last wrote for that uid is **older** than that write, never newer.
//! [`StatusWriter::latest`] therefore returns the written status (and the resourceVersion
//! the write produced) until the cache shows it, then forgets it: memory is spent only on
//! objects whose last write the watch has not delivered yet, and pruned against the cache.
//!
//! Where the next status depends on the previous one (a state machine: a Migration's
//! steps, a Backup's attempts), use [`Guard::ResourceVersion`]: anything the sole-writer
//! argument does not cover (a replica that was leader a moment ago, a human writing the
//! status subresource, a spec change since the read) then ends in [`Write::Conflict`],
//! and the caller reads the object again (a GET) and decides anew; it never writes a
//! decision made on an older object. Statuses derived from the world alone (Database,
//! DatabaseServer, DatabaseUser: the next reconcile recomputes them from PostgreSQL and
//! the Secrets) use [`Guard::Uid`]: the last write wins.
//!
//! # Events: only here
//! Every Event dbops publishes goes through this module: the [`Note`]s of a
//! [`Desired`], published once its status is written, or, for what no status write can
//! carry, [`announce`]: an object that is going (its last status is not written: a
//! Database or user deleted, a Backup's artifact removed), something told on another
//! object than the one reconciled (a Database deleted with its namespace, told on its
//! DatabaseServer), or an action whose outcome the status does not keep (a login retired,
//! a schedule's Backup made). `crate::events::publish` is this crate's own.
//!
//! # Permanent or retry
//! One vocabulary, [`crate::controller::ErrorKind`]: `Transient` (retried with per-object
//! backoff) or `Permanent` (reported in a condition; nothing is retried until something
//! changes, a resync looks again).

use std::{fmt::Debug, sync::Mutex};

use dbops_api::{
    Backup, BackupStatus, Database, DatabaseServer, DatabaseServerStatus, DatabaseStatus,
    DatabaseUser, DatabaseUserStatus, Migration, MigrationStatus,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::reflector::Store,
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::json;

use crate::{events::Recorder, memo::Memo};

/// A kind whose status one controller writes.
pub trait HasStatus:
    Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static
{
    type Status: Clone + Default + Debug + PartialEq + Serialize + Send + Sync + 'static;
    fn status(&self) -> Option<&Self::Status>;
}

macro_rules! has_status {
    ($($kind:ty => $status:ty),* $(,)?) => {
        $(impl HasStatus for $kind {
            type Status = $status;
            fn status(&self) -> Option<&$status> {
                self.status.as_ref()
            }
        })*
    };
}

has_status! {
    Database => DatabaseStatus,
    DatabaseServer => DatabaseServerStatus,
    DatabaseUser => DatabaseUserStatus,
    Backup => BackupStatus,
    Migration => MigrationStatus,
}

/// What a write is conditional on, besides the object's uid (always).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// The status is recomputed from the world each reconcile: the last write wins.
    Uid,
    /// The status was decided from the previous one: written only over the version read.
    ResourceVersion,
}

/// An Event that a status change implies, published once the status is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub normal: bool,
    /// What the controller was doing (`Provision`, `Backup`, `Migrate`...).
    pub action: &'static str,
    pub reason: String,
    pub message: String,
}

impl Note {
    /// A Normal Event when `normal`, else a Warning.
    pub fn of(
        normal: bool,
        action: &'static str,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            normal,
            action,
            reason: reason.into(),
            message: message.into(),
        }
    }

    pub fn normal(
        action: &'static str,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::of(true, action, reason, message)
    }

    pub fn warning(
        action: &'static str,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::of(false, action, reason, message)
    }
}

/// The status an object should have and the Events its change implies: what a kind's
/// pure `desired` returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired<S> {
    pub status: S,
    pub notes: Vec<Note>,
}

impl<S> Desired<S> {
    pub fn new(status: S) -> Self {
        Self {
            status,
            notes: Vec::new(),
        }
    }

    pub fn with(mut self, note: Note) -> Self {
        self.notes.push(note);
        self
    }
}

/// Publishes `note` about `obj` without a status write: for an Event that no status change
/// carries (see the module's notes). In the background, a failure logged, never fatal.
pub async fn announce<K>(recorder: &Recorder, obj: &K, note: &Note)
where
    K: Resource<DynamicType = ()>,
{
    crate::events::publish(
        recorder,
        obj,
        note.normal,
        note.action,
        &note.reason,
        &note.message,
    )
    .await;
}

/// What [`StatusWriter::write`] did.
#[derive(Debug)]
pub enum Write<K> {
    /// The status was already the desired one: no request was made.
    Unchanged,
    /// Written; the object as the API server returned it.
    Written(Box<K>),
    /// [`Guard::ResourceVersion`] only: the object changed since it was read. Read it
    /// again and decide anew.
    Conflict,
    /// The object is gone, or another object holds its name now (the uid test failed).
    /// With [`Guard::ResourceVersion`] a caller handles it as [`Write::Conflict`] (read
    /// again, decide anew); with [`Guard::Uid`] it asks whether the object it read is still
    /// the live one (the database-controller's `live::status_write_gone`, for Databases
    /// and DatabaseUsers alike).
    Gone,
}

/// What was written last for one object.
#[derive(Clone, Debug)]
struct Recent<S> {
    status: S,
    resource_version: Option<String>,
}

/// The smallest memo [`StatusWriter`] sweeps against the cache.
const SWEEP_MIN: usize = 64;

/// The one status writer of a kind in a process (see the module's notes).
pub struct StatusWriter<K: HasStatus> {
    recent: Memo<Recent<K::Status>>,
    /// The size at which the memo is swept next.
    sweep_at: Mutex<usize>,
}

impl<K: HasStatus> Default for StatusWriter<K> {
    fn default() -> Self {
        Self {
            recent: Memo::default(),
            sweep_at: Mutex::new(SWEEP_MIN),
        }
    }
}

impl<K: HasStatus> StatusWriter<K> {
    /// The status to decide on: the one this process wrote last if the cache has not shown
    /// it yet, else the cached one (and the entry is forgotten).
    pub fn latest(&self, cached: &K) -> K::Status {
        self.latest_with_version(cached).0
    }

    /// [`Self::latest`] and the resourceVersion that goes with it.
    pub fn latest_with_version(&self, cached: &K) -> (K::Status, Option<String>) {
        let uid = cached.uid().unwrap_or_default();
        let from_cache = || {
            (
                cached.status().cloned().unwrap_or_default(),
                cached.resource_version(),
            )
        };
        if self.forget_shown(&uid, cached) {
            return from_cache();
        }
        self.recent
            .get(&uid, |r| (r.status.clone(), r.resource_version.clone()))
            .unwrap_or_else(from_cache)
    }

    /// Writes `desired.status` unless it is the latest already, then publishes
    /// `desired.notes` about `obj` (only when written). `cache`, when given, is swept now
    /// and then of entries the watch has caught up with.
    pub async fn write(
        &self,
        api: &Api<K>,
        obj: &K,
        desired: Desired<K::Status>,
        guard: Guard,
        recorder: &Recorder,
        cache: Option<&Store<K>>,
    ) -> Result<Write<K>, kube::Error> {
        let (latest, version) = self.latest_with_version(obj);
        if desired.status == latest {
            return Ok(Write::Unchanged);
        }
        let uid = obj.uid().unwrap_or_default();
        let mut ops = vec![json!({"op": "test", "path": "/metadata/uid", "value": uid})];
        if guard == Guard::ResourceVersion {
            ops.push(json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}));
        }
        ops.push(json!({"op": "add", "path": "/status", "value": desired.status}));
        let patch = serde_json::from_value(serde_json::Value::Array(ops))
            .map_err(kube::Error::SerdeError)?;
        let written = match api
            .patch_status(
                &obj.name_any(),
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
        {
            Ok(written) => written,
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Write::Gone),
            // A failed `test` is 422 (Unprocessable): the uid's (the name holds another
            // object now) or the resourceVersion's (changed since it was read).
            Err(kube::Error::Api(e)) if e.code == 422 || e.code == 409 => {
                self.recent.forget(&uid);
                return Ok(match guard {
                    Guard::ResourceVersion => Write::Conflict,
                    Guard::Uid => Write::Gone,
                });
            }
            Err(e) => return Err(e),
        };
        self.remember(&uid, desired.status, written.resource_version(), cache);
        for note in &desired.notes {
            announce(recorder, &written, note).await;
        }
        Ok(Write::Written(Box::new(written)))
    }

    fn remember(
        &self,
        uid: &str,
        status: K::Status,
        resource_version: Option<String>,
        cache: Option<&Store<K>>,
    ) {
        let len = self.recent.insert(
            uid,
            Recent {
                status,
                resource_version,
            },
        );
        let mut sweep_at = self.sweep_at.lock().unwrap_or_else(|e| e.into_inner());
        if len < (*sweep_at).max(SWEEP_MIN) {
            return;
        }
        if let Some(cache) = cache {
            // An object the cache does not hold yet keeps its write.
            self.sweep_against(cache, true);
        }
        *sweep_at = self.recent.len() * 2;
    }

    /// The watch shows `obj` (its store holds it now): the write kept for it is forgotten
    /// if this is its status. A burst of writes is then forgotten as the watch catches up,
    /// not kept (a second copy of each status) until the memo has doubled or the next
    /// reconcile of each object.
    pub fn seen(&self, obj: &K) {
        if let Some(uid) = obj.meta().uid.as_deref() {
            self.forget_shown(uid, obj);
        }
    }

    /// Forgets the write kept for `uid` if `shown` (as a cache holds it) carries its status;
    /// whether it did.
    fn forget_shown(&self, uid: &str, shown: &K) -> bool {
        self.recent
            .forget_if(uid, |r| shown.status() == Some(&r.status))
    }

    /// Forgets an object (deleted, or handed over).
    pub fn forget(&self, uid: &str) {
        self.recent.forget(uid);
    }

    /// Keeps only the objects for which `live` holds (a prune against the watch cache).
    pub fn retain(&self, mut live: impl FnMut(&str) -> bool) {
        self.recent.retain(|uid, _| live(uid));
    }

    /// Keeps only the writes `cache` has not shown yet: an object the cache shows with the
    /// status written last, or no longer holds, is forgotten. Once the watch has caught up
    /// the memo is empty, whatever the number of objects (a write kept after that would be
    /// a second copy of every status in the process).
    pub fn sweep(&self, cache: &Store<K>) {
        self.sweep_against(cache, false);
    }

    /// Forgets each write `cache` shows; an object `cache` does not hold is kept only
    /// when `keep_unseen`.
    fn sweep_against(&self, cache: &Store<K>, keep_unseen: bool) {
        let cached = cache.state();
        let by_uid: std::collections::HashMap<&str, &K> = cached
            .iter()
            .filter_map(|k| k.meta().uid.as_deref().map(|uid| (uid, k.as_ref())))
            .collect();
        self.recent.retain(|uid, r| match by_uid.get(uid) {
            Some(k) => k.status() != Some(&r.status),
            None => keep_unseen,
        });
    }

    /// How many objects' writes the cache has not shown yet (for tests and metrics).
    pub fn pending(&self) -> usize {
        self.recent.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_api::DatabaseStatus;

    fn db(uid: &str, rv: &str, phase: Option<&str>) -> Database {
        let mut v = json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": format!("db-{uid}"), "namespace": "ns", "uid": uid, "resourceVersion": rv},
            "spec": {"serverRef": {"name": "pg"}},
        });
        if let Some(p) = phase {
            v["status"] = json!({"phase": p});
        }
        serde_json::from_value(v).unwrap()
    }

    fn status(phase: &str) -> DatabaseStatus {
        serde_json::from_value(json!({"phase": phase})).unwrap()
    }

    #[test]
    fn the_written_status_wins_over_an_older_cache_until_the_cache_shows_it() {
        let w = StatusWriter::<Database>::default();
        w.recent.insert(
            "u1",
            Recent {
                status: status("Ready"),
                resource_version: Some("7".into()),
            },
        );
        // The cache is older than the write: the write's status and version.
        let (s, v) = w.latest_with_version(&db("u1", "5", Some("Pending")));
        assert_eq!(s, status("Ready"));
        assert_eq!(v.as_deref(), Some("7"));
        assert_eq!(w.pending(), 1);
        // The cache caught up (a later version, e.g. a spec change after the write): the
        // cache's, and the entry is gone.
        let (s, v) = w.latest_with_version(&db("u1", "9", Some("Ready")));
        assert_eq!(s, status("Ready"));
        assert_eq!(v.as_deref(), Some("9"));
        assert_eq!(w.pending(), 0);
        // Another object: its own cached status.
        assert_eq!(w.latest(&db("u2", "3", None)), DatabaseStatus::default());
    }

    #[test]
    fn a_write_is_forgotten_when_the_watch_shows_it_and_kept_until_then() {
        let w = StatusWriter::<Database>::default();
        for uid in ["u1", "u2"] {
            w.remember(uid, status("Ready"), Some("7".into()), None);
        }
        // The watch shows u1 still as it was before the write: kept.
        w.seen(&db("u1", "5", Some("Pending")));
        assert_eq!(w.pending(), 2);
        // The watch shows u1 written: forgotten, without a reconcile or a sweep.
        w.seen(&db("u1", "7", Some("Ready")));
        assert_eq!(w.pending(), 1);
        assert_eq!(
            w.latest_with_version(&db("u2", "5", Some("Pending"))).0,
            status("Ready"),
            "u2's write still wins over its older cache"
        );
    }

    #[test]
    fn a_burst_of_writes_is_swept_once_the_cache_shows_them() {
        use kube::runtime::{reflector, watcher};
        let w = StatusWriter::<Database>::default();
        let (cache, mut feed) = reflector::store::<Database>();
        // 200 writes; the cache shows the first 150 of them, the last 50 not yet.
        for i in 0..200 {
            let uid = format!("u{i}");
            let shown = if i < 150 {
                Some("Ready")
            } else {
                Some("Pending")
            };
            feed.apply_watcher_event(&watcher::Event::Apply(db(&uid, "1", shown)));
        }
        for i in 0..200 {
            w.remember(
                &format!("u{i}"),
                status("Ready"),
                Some("2".into()),
                Some(&cache),
            );
        }
        // Swept whenever the memo doubled since the last sweep (64, then twice what was
        // left): what the cache shows is gone, what it does not show is kept.
        assert!(w.pending() >= 50, "a write the cache has not shown is kept");
        assert!(w.pending() < 200, "a sweep ran: {}", w.pending());
        for i in 150..200 {
            assert_eq!(
                w.latest(&db(&format!("u{i}"), "1", Some("Pending"))),
                status("Ready")
            );
        }
        w.retain(|uid| uid != "u199");
        assert_eq!(
            w.latest(&db("u199", "1", Some("Pending"))),
            status("Pending")
        );
    }

    #[test]
    fn once_the_cache_has_caught_up_the_memo_holds_nothing() {
        use kube::runtime::{reflector, watcher};
        let w = StatusWriter::<Database>::default();
        let (cache, mut feed) = reflector::store::<Database>();
        // 40 writes (under the size at which `remember` sweeps): the cache shows 30 of
        // them, 5 not yet, and 5 objects are gone from it.
        for i in 0..40 {
            let shown = if i < 30 { "Ready" } else { "Pending" };
            if i < 35 {
                feed.apply_watcher_event(&watcher::Event::Apply(db(
                    &format!("u{i}"),
                    "2",
                    Some(shown),
                )));
            }
            w.remember(
                &format!("u{i}"),
                status("Ready"),
                Some("2".into()),
                Some(&cache),
            );
        }
        assert_eq!(w.pending(), 40, "under SWEEP_MIN nothing was swept yet");
        w.sweep(&cache);
        assert_eq!(w.pending(), 5, "only the writes the cache has not shown");
        for i in 30..35 {
            assert_eq!(
                w.latest(&db(&format!("u{i}"), "1", Some("Pending"))),
                status("Ready")
            );
        }
    }

    #[test]
    fn desired_collects_the_notes_in_order() {
        let d = Desired::new(status("Ready"))
            .with(Note::normal("Provision", "Provisioned", "ready"))
            .with(Note::warning("Provision", "SizeExceeded", "big"));
        assert_eq!(d.notes.len(), 2);
        assert!(d.notes[0].normal && !d.notes[1].normal);
        assert_eq!(d.notes[1].reason, "SizeExceeded");
    }
}
