//! What a controller process remembers per object, by the object's uid: the status it last
//! wrote, the last full check, the attempts it made. Nothing here is persisted; a restart
//! starts from nothing. Each owner bounds its own map (forgets an object once it is
//! done, prunes against its watch cache): [`Memo`] only keeps the map and its lock.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// A value per object uid, behind one lock that a panicking holder does not poison.
#[derive(Debug)]
pub struct Memo<V> {
    by_uid: Mutex<HashMap<String, V>>,
}

impl<V> Default for Memo<V> {
    fn default() -> Self {
        Self {
            by_uid: Mutex::new(HashMap::new()),
        }
    }
}

impl<V> Memo<V> {
    fn map(&self) -> MutexGuard<'_, HashMap<String, V>> {
        self.by_uid.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers `value` for `uid` (in place of what was there); the number of uids
    /// remembered afterwards.
    pub fn insert(&self, uid: &str, value: V) -> usize {
        let mut map = self.map();
        map.insert(uid.to_string(), value);
        map.len()
    }

    /// `f` of what is remembered for `uid`; `None` if nothing is.
    pub fn get<T>(&self, uid: &str, f: impl FnOnce(&V) -> T) -> Option<T> {
        self.map().get(uid).map(f)
    }

    /// Whether something is remembered for `uid` and `f` holds for it.
    pub fn is(&self, uid: &str, f: impl FnOnce(&V) -> bool) -> bool {
        self.map().get(uid).is_some_and(f)
    }

    pub fn forget(&self, uid: &str) {
        self.map().remove(uid);
    }

    /// Forgets what is remembered for `uid` if `f` holds for it; whether it did.
    pub fn forget_if(&self, uid: &str, f: impl FnOnce(&V) -> bool) -> bool {
        let mut map = self.map();
        let drop = map.get(uid).is_some_and(f);
        if drop {
            map.remove(uid);
        }
        drop
    }

    /// Keeps only the uids for which `f` holds. A map left at under a quarter of its
    /// room gives the rest back (a table grown by a burst of thousands of objects would
    /// otherwise stay that size for the life of the process).
    pub fn retain(&self, mut f: impl FnMut(&str, &V) -> bool) {
        let mut map = self.map();
        map.retain(|uid, value| f(uid, value));
        if map.capacity() > 64 && map.len() < map.capacity() / 4 {
            map.shrink_to_fit();
        }
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// The uids remembered, in no particular order.
    pub fn uids(&self) -> Vec<String> {
        self.map().keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memo_remembers_and_forgets_by_uid() {
        let memo = Memo::default();
        assert_eq!(memo.insert("a", 1), 1);
        assert_eq!(memo.insert("b", 2), 2);
        assert_eq!(memo.insert("a", 3), 2, "a uid is remembered once");
        assert_eq!(memo.get("a", |v| *v), Some(3));
        assert!(memo.is("b", |v| *v == 2) && !memo.is("c", |_| true));
        assert!(!memo.forget_if("a", |v| *v == 1), "kept: the test fails");
        assert!(memo.forget_if("a", |v| *v == 3));
        memo.retain(|uid, _| uid != "b");
        assert!(memo.is_empty());
        memo.insert("c", 4);
        memo.forget("c");
        assert_eq!(memo.uids(), Vec::<String>::new());
    }

    #[test]
    fn a_memo_emptied_after_a_burst_gives_its_room_back() {
        let memo = Memo::default();
        for i in 0..10_000 {
            memo.insert(&format!("uid-{i}"), i);
        }
        let grown = memo.map().capacity();
        memo.retain(|uid, _| uid == "uid-7");
        assert_eq!(memo.len(), 1);
        assert!(
            memo.map().capacity() < grown / 100,
            "{} of {grown}",
            memo.map().capacity()
        );
    }
}
