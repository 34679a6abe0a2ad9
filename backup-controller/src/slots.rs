//! Dump slots: `--max-concurrent-backups` in all, and one per PostgreSQL server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dbops_shared::postgres::ServerKey;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Dump slots: `--max-concurrent-backups` in all, and one per server.
pub struct Slots {
    global: Arc<Semaphore>,
    per_server: Mutex<HashMap<ServerKey, Arc<Semaphore>>>,
}

/// The two permits a dump holds while it runs.
pub struct Slot {
    _global: OwnedSemaphorePermit,
    _server: OwnedSemaphorePermit,
}

impl Slots {
    pub fn new(max_concurrent: usize) -> Self {
        Self {
            global: Arc::new(Semaphore::new(max_concurrent.max(1))),
            per_server: Mutex::new(HashMap::new()),
        }
    }

    /// Both permits, if both are free now.
    pub fn try_acquire(&self, server: &ServerKey) -> Option<Slot> {
        let per_server = {
            let mut map = self.per_server.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(server.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(1)))
                .clone()
        };
        let server = per_server.try_acquire_owned().ok()?;
        let global = self.global.clone().try_acquire_owned().ok()?;
        Some(Slot {
            _global: global,
            _server: server,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_dump_per_server_and_a_global_limit() {
        let slots = Slots::new(2);
        let a = ServerKey {
            host: "a".into(),
            port: 5432,
        };
        let b = ServerKey {
            host: "b".into(),
            port: 5432,
        };
        let c = ServerKey {
            host: "c".into(),
            port: 5432,
        };
        let first = slots.try_acquire(&a).unwrap();
        assert!(slots.try_acquire(&a).is_none(), "one dump per server");
        let _second = slots.try_acquire(&b).unwrap();
        assert!(slots.try_acquire(&c).is_none(), "two in all");
        drop(first);
        assert!(slots.try_acquire(&c).is_some());
    }
}
