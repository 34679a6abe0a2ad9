//! A map a watch fills the way kube's reflector fills its store: changes go into it as
//! they come, and a relist is built aside and replaces it whole once complete (objects
//! deleted while the watch was down go; reads meanwhile see it as it was). The shared
//! watch's indexes and the compact store follow their watches through it.

use std::sync::{Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::runtime::watcher;

/// The map being read, and the one a relist builds until it is complete.
#[derive(Default)]
pub(crate) struct Relisted<M> {
    live: RwLock<M>,
    relist: Mutex<Option<M>>,
}

impl<M: Default> Relisted<M> {
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, M> {
        self.live.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, M> {
        self.live.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Follows one event: `put` an object created or changed (into the relist's map during
    /// a relist), `remove` one deleted; at the relist's end its map replaces the live one,
    /// or `unbegun` gives one when no relist was begun here (`None`: the live map stays).
    /// Returns whether the event ended a relist.
    pub(crate) fn follow<K>(
        &self,
        event: &watcher::Event<K>,
        put: impl FnOnce(&mut M, &K),
        remove: impl FnOnce(&mut M, &K),
        unbegun: impl FnOnce() -> Option<M>,
    ) -> bool {
        match event {
            watcher::Event::Apply(obj) => put(&mut self.write(), obj),
            watcher::Event::Delete(obj) => remove(&mut self.write(), obj),
            watcher::Event::Init => *self.relisting() = Some(M::default()),
            watcher::Event::InitApply(obj) => {
                if let Some(relist) = self.relisting().as_mut() {
                    put(relist, obj);
                }
            }
            watcher::Event::InitDone => {
                let fresh = self.relisting().take().or_else(unbegun);
                if let Some(fresh) = fresh {
                    *self.write() = fresh;
                }
                return true;
            }
        }
        false
    }

    fn relisting(&self) -> std::sync::MutexGuard<'_, Option<M>> {
        self.relist.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
