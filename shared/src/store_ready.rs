//! Waiting for a watch cache's first list, for any number of waiters at once.
//!
//! `Store::wait_until_ready` of kube-runtime 5 waits on one oneshot channel shared by every
//! clone of the store, and a oneshot keeps one waker: each waiter that polls it replaces
//! the waker of the one before. When the first list is in, only the waiter that polled
//! last is woken; every other one sleeps until its own deadline. At a controller's start
//! (or a namespace's first reconciles) that was 16 reconciles waiting out a 15 s bound
//! while the cache had been ready for 14.9 s (issue 25).
//!
//! [`until_ready`] does not rely on that one wakeup: a waiter that sees a store ready tells
//! every other waiter to look again (a process-wide [`Notify`]), and each waiter also looks
//! again every [`RECHECK`], for the case where the one waiter that held the waker gave up
//! before the list came.

use std::sync::LazyLock;
use std::time::Duration;

use futures::FutureExt;
use kube::runtime::reflector::{Lookup, Store, store::WriterDropped};
use tokio::sync::Notify;

/// How often a waiter looks at its store again, woken or not.
pub const RECHECK: Duration = Duration::from_millis(100);

/// Said to every waiter when any store is seen ready.
static SEEN_READY: LazyLock<Notify> = LazyLock::new(Notify::new);

/// Waits until `store` has its first full list, like `Store::wait_until_ready`, but wakes
/// every concurrent waiter (see the module's documentation). Unbounded: see
/// [`ready_within`] for the bounded wait. Fails only when the store's writer is gone unready.
pub async fn until_ready<K>(store: &Store<K>) -> Result<(), WriterDropped>
where
    K: Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    // The common case, every reconcile once the cache is in: nothing to wait for or tell.
    if let Some(result) = store.wait_until_ready().now_or_never() {
        return result;
    }
    loop {
        // Registered before the look, so a store seen ready in between is not missed.
        let told = SEEN_READY.notified();
        tokio::pin!(told);
        told.as_mut().enable();
        tokio::select! {
            biased;
            result = store.wait_until_ready() => {
                SEEN_READY.notify_waiters();
                return result;
            }
            () = &mut told => {}
            () = tokio::time::sleep(RECHECK) => {}
        }
    }
}

/// Whether `store` has its first full list within `bound` ([`until_ready`]); a writer gone
/// unready counts as not ready.
pub async fn ready_within<K>(store: &Store<K>, bound: Duration) -> bool
where
    K: Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    matches!(
        tokio::time::timeout(bound, until_ready(store)).await,
        Ok(Ok(()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;

    /// Before `until_ready`, the callers awaited `store.wait_until_ready()` directly: of
    /// the three waiters here only one came back, the two others at their deadline.
    #[tokio::test]
    async fn every_concurrent_waiter_sees_the_first_list() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    tokio::time::timeout(Duration::from_secs(10), until_ready(&store)).await
                })
            })
            .collect();
        // Each waiter has polled once and is waiting.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let listed = std::time::Instant::now();
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitDone);
        for waiter in waiters {
            let result = waiter.await.expect("the waiter task ran");
            assert!(
                matches!(result, Ok(Ok(()))),
                "a waiter did not see the list: {result:?}"
            );
        }
        // Woken, not timed out: well within a few rechecks.
        assert!(
            listed.elapsed() < Duration::from_secs(2),
            "waiters took {:?}",
            listed.elapsed()
        );
    }
}
