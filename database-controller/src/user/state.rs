//! The DatabaseUser controller's state, the status it last wrote, and its Events.

use std::sync::{Arc, OnceLock};

use dbops_api::{Database, DatabaseUser, DatabaseUserStatus};
use dbops_shared::events::Recorder;
use dbops_shared::memo::Memo;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

use crate::tenant_secrets::TenantSecrets;

/// The user controller's state.
pub struct State {
    pub servers: Arc<Servers>,
    pub directory: Directory,
    pub recorder: Recorder,
    /// The Database controller's cache.
    pub databases: Arc<OnceLock<Store<Database>>>,
    pub tenants: TenantSecrets,
    /// The status last written for each DatabaseUser (by UID), until the cache shows it:
    /// a reconcile on an older cached object must not act on an older status (it would
    /// rotate twice).
    pub written: Memo<DatabaseUserStatus>,
}

impl State {
    /// The latest status: the one last written unless the cache already shows it.
    pub fn latest(&self, user: &DatabaseUser) -> DatabaseUserStatus {
        let uid = user.uid().unwrap_or_default();
        let cached = user.status.clone().unwrap_or_default();
        if self
            .written
            .forget_if(&uid, |w| user.status.as_ref() == Some(w))
        {
            return cached;
        }
        self.written.get(&uid, Clone::clone).unwrap_or(cached)
    }

    /// Publishes an Event on `user` (action `Reconcile`).
    pub async fn event(&self, user: &DatabaseUser, normal: bool, reason: &str, note: &str) {
        dbops_shared::events::publish(&self.recorder, user, normal, "Reconcile", reason, note)
            .await;
    }
}
