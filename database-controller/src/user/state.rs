//! The DatabaseUser controller's state, the status it last wrote, and its Events.

use std::sync::{Arc, OnceLock};

use dbops_api::{Database, DatabaseUser, DatabaseUserStatus};
use dbops_shared::events::Recorder;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;
use dbops_shared::status::{Note, StatusWriter};
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
    /// The one status writer of DatabaseUsers (`dbops_shared::status`): its latest status
    /// is the one it last wrote until the cache shows it, so a reconcile on an older cached
    /// object never acts on an older status (it would rotate twice).
    pub written: StatusWriter<DatabaseUser>,
}

impl State {
    /// The latest status: the one last written unless the cache already shows it.
    pub fn latest(&self, user: &DatabaseUser) -> DatabaseUserStatus {
        self.written.latest(user)
    }

    /// Publishes an Event on `user` (action `Reconcile`) that no status write carries (a
    /// login retired, the user deleted), through `dbops_shared::status::announce`.
    pub async fn event(&self, user: &DatabaseUser, normal: bool, reason: &str, note: &str) {
        let note = Note::of(normal, "Reconcile", reason, note);
        dbops_shared::status::announce(&self.recorder, user, &note).await;
    }
}
