//! The clones copying into each server now, bounded by the server's
//! `limits.concurrentClones` and `limits.cloneSpace` (pure bookkeeping: the caller says
//! what the limits are and what the clones already on the server take). Only the leader
//! reconciles, so the process's count is the installation's. A clone refused a place is
//! remembered, and woken (its namespace and name sent on [`Slots::wakes`]) as soon as a
//! place on its server comes back.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use futures::channel::mpsc;

/// A waiting clone's Database: namespace and name.
pub type Waiting = (String, String);

/// Each server's running clones (their Database's uid and the size they will take) and
/// waiting ones.
pub struct Slots {
    running: Mutex<HashMap<String, HashMap<String, i64>>>,
    waiting: Mutex<HashMap<String, BTreeSet<Waiting>>>,
    wake: mpsc::UnboundedSender<Waiting>,
    wakes: Mutex<Option<mpsc::UnboundedReceiver<Waiting>>>,
}

impl Default for Slots {
    fn default() -> Self {
        let (wake, wakes) = mpsc::unbounded();
        Self {
            running: Mutex::default(),
            waiting: Mutex::default(),
            wake,
            wakes: Mutex::new(Some(wakes)),
        }
    }
}

/// A clone's place among the running ones; given back when dropped.
pub struct Slot {
    slots: Arc<Slots>,
    server: String,
    uid: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut running = self.slots.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(on) = running.get_mut(&self.server) {
            on.remove(&self.uid);
        }
        drop(running);
        let mut waiting = self.slots.waiting.lock().unwrap_or_else(|e| e.into_inner());
        for who in waiting.remove(&self.server).unwrap_or_default() {
            // Nobody listens once the controller has stopped: nothing to wake.
            let _ = self.slots.wake.unbounded_send(who);
        }
    }
}

/// What a clone asks of its server.
pub struct Ask<'a> {
    pub server: &'a str,
    pub uid: &'a str,
    /// Its Database, woken when a place comes back.
    pub who: Waiting,
    /// The source's size, what the copy will take.
    pub size: i64,
    /// `limits.concurrentClones` (or its default).
    pub most: usize,
    /// `limits.cloneSpace` in bytes, if set.
    pub space: Option<i64>,
    /// What the finished clones on the server take.
    pub used: i64,
}

impl Slots {
    /// The Databases to look at again because a place came back: once (the controller's
    /// `reconcile_on`).
    pub fn wakes(&self) -> Option<mpsc::UnboundedReceiver<Waiting>> {
        self.wakes.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// A place for the clone, or why it waits (and it is woken when a place comes back).
    pub fn take(self: &Arc<Self>, ask: &Ask<'_>) -> Result<Slot, String> {
        let taken = self.try_take(ask);
        if taken.is_err() {
            let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            waiting
                .entry(ask.server.to_string())
                .or_default()
                .insert(ask.who.clone());
        }
        taken
    }

    fn try_take(self: &Arc<Self>, ask: &Ask<'_>) -> Result<Slot, String> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let on = running.entry(ask.server.to_string()).or_default();
        let in_flight: i64 = on
            .iter()
            .filter(|(u, _)| u.as_str() != ask.uid)
            .map(|(_, s)| *s)
            .sum();
        if !on.contains_key(ask.uid) && on.len() >= ask.most {
            return Err(format!(
                "{} clones are copying into {} (limits.concurrentClones: {}); this one waits its turn",
                on.len(),
                ask.server,
                ask.most
            ));
        }
        if let Some(space) = ask.space
            && ask.used + in_flight + ask.size > space
        {
            return Err(format!(
                "clones on {} take {} bytes and this copy needs about {} (limits.cloneSpace: {space} bytes); it waits until clones are deleted or expire",
                ask.server,
                ask.used + in_flight,
                ask.size
            ));
        }
        on.insert(ask.uid.to_string(), ask.size);
        Ok(Slot {
            slots: Arc::clone(self),
            server: ask.server.to_string(),
            uid: ask.uid.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask<'a>(uid: &'a str, size: i64, space: Option<i64>) -> Ask<'a> {
        Ask {
            server: "pg",
            uid,
            who: ("ns".into(), uid.into()),
            size,
            most: 2,
            space,
            used: 100,
        }
    }

    #[test]
    fn clones_wait_for_a_place_and_for_space_and_places_come_back() {
        let slots = Arc::new(Slots::default());
        let a = slots.take(&ask("a", 10, None)).expect("first");
        let _b = slots.take(&ask("b", 10, None)).expect("second");
        let third = slots.take(&ask("c", 10, None));
        assert!(third.is_err_and(|why| why.contains("concurrentClones: 2")));
        // The same clone asking again keeps its place.
        let again = slots.take(&ask("a", 10, None));
        assert!(again.is_ok());
        drop(again);
        drop(a);
        let mut wakes = slots.wakes().expect("the receiver, once");
        assert!(slots.wakes().is_none());
        assert_eq!(
            wakes.try_recv().ok(),
            Some(("ns".to_string(), "c".to_string())),
            "the waiting clone is woken"
        );
        let _c = slots.take(&ask("c", 10, None)).expect("a place came back");
        let slots = Arc::new(Slots::default());
        let _d = slots.take(&ask("d", 50, Some(200))).expect("room");
        let e = slots.take(&ask("e", 60, Some(200)));
        assert!(e.is_err_and(|why| why.contains("cloneSpace")));
    }
}
