//! The Database controller's state, shared by its reconciles: the caches it reads, the
//! sessions to the servers, and what it remembers per Database (the status it wrote last,
//! in its [`StatusWriter`]; [`Verified`], the last full check) with what a check produced
//! ([`Provisioned`]). Nothing here talks to the API or to PostgreSQL.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{Database, Migration};
use dbops_shared::events::Recorder;
use dbops_shared::memo::Memo;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;
use dbops_shared::status::StatusWriter;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

use crate::owner_logins::Logins;
use crate::restore::Restorer;
use crate::routine::Routine;
use crate::tenant_secrets::TenantSecrets;

/// The database-controller's own state.
pub struct State {
    /// Sessions to PostgreSQL servers, shared with the DatabaseServer controller.
    pub servers: Arc<Servers>,
    pub recorder: Recorder,
    /// DatabaseServers, their admin and CA Secrets (the controllers' namespace only) and
    /// the namespaces' labels.
    pub directory: Directory,
    /// Every Migration, kept by a reflector (set up with the watches); shared with the
    /// DatabaseServer controller.
    pub migrations: Arc<std::sync::OnceLock<Store<Migration>>>,
    /// When each Database's PostgreSQL state was last verified, and at which generation.
    pub verified: Verified,
    /// The expiry instants already warned about (`spec.expireAfter`), by UID.
    pub expiry_warned: ExpiryWarnings,
    /// The Database status writes (the shared path), and the status to decide on when
    /// the cache has not shown the last one yet ([`StatusWriter::latest`]).
    pub statuses: StatusWriter<Database>,
    /// The controller's own cache of Databases (set up with the watches), to forget
    /// what is remembered about Databases that are gone, count a server's Databases and
    /// apply its quota. Shared with the DatabaseServer controller.
    pub databases: Arc<std::sync::OnceLock<Store<Database>>>,
    /// The connection Secrets (label `app.kubernetes.io/managed-by=dbops`), one cache per
    /// namespace where Databases need them, reached through a RoleBinding made there; no
    /// other Secret of a tenant is cached.
    pub tenants: TenantSecrets,
    pub last_prune: Mutex<Option<Instant>>,
    /// Routine checks put off for a busy server, and the sizes last read.
    pub routine: Routine,
    /// The backup store and pg_restore, for `spec.restoreFrom`.
    pub restorer: Restorer,
    /// The Databases (namespace, name) with a `dbops_database_size_bytes` series, so
    /// [`State::prune`] drops those of Databases that are gone.
    pub sizes: Mutex<HashSet<(String, String)>>,
    /// The clones copying into each server (`spec.cloneFrom`, `limits.concurrentClones`).
    pub clones: Arc<crate::clone_slots::Slots>,
}

impl State {
    /// Drops index and memo entries of Databases no longer in the cache, at most once per
    /// `every`: memory stays bounded by the Databases that exist.
    pub fn prune(&self, every: Duration) {
        let Some(store) = self.databases.get() else {
            return;
        };
        {
            let mut last = self.last_prune.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|at| at.elapsed() < every) {
                return;
            }
            *last = Some(Instant::now());
        }
        let live: HashSet<String> = store
            .state()
            .iter()
            .filter_map(|d| d.metadata.uid.clone())
            .collect();
        // An entry older than half the resync interval (the window `Verified::recent` is
        // read in) no longer spares a check.
        self.verified
            .checks
            .retain(|uid, (_, _, at)| live.contains(uid) && at.elapsed() < every / 2);
        self.statuses.sweep(store);
        self.routine.retain(|uid| live.contains(uid));
        let named: HashSet<(String, String)> = store
            .state()
            .iter()
            .map(|d| (d.namespace().unwrap_or_default(), d.name_any()))
            .collect();
        self.sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(namespace, name)| {
                let keep = named.contains(&(namespace.clone(), name.clone()));
                if !keep {
                    crate::metrics::forget_database_size(namespace, name);
                }
                keep
            });
    }
}

/// The last full check of each Database against PostgreSQL. A reconcile soon after one
/// (triggered by the controller's own status or Secret write) checks the Secret only;
/// PostgreSQL is read again at the latest one resync interval later.
#[derive(Default)]
pub struct Verified {
    checks: Memo<(i64, Provisioned, Instant)>,
}

impl Verified {
    pub(crate) fn recent(
        &self,
        uid: &str,
        generation: i64,
        within: Duration,
    ) -> Option<Provisioned> {
        self.checks
            .get(uid, |(g, p, at)| {
                (*g == generation && at.elapsed() < within).then(|| p.clone())
            })
            .flatten()
    }

    pub(crate) fn record(&self, uid: &str, generation: i64, provisioned: &Provisioned) {
        self.checks
            .insert(uid, (generation, provisioned.clone(), Instant::now()));
    }

    pub(crate) fn forget(&self, uid: &str) {
        self.checks.forget(uid);
    }
}

/// What a successful provisioning produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Provisioned {
    pub provider_id: String,
    pub server_version: String,
    /// The DatabaseServer it is on, and the `host:port` applications connect to.
    pub server: String,
    pub endpoint: String,
    /// `pg_database_size` at the check, and the server's `limits.databaseSize`.
    pub size_bytes: i64,
    pub size_limit: Option<i64>,
    /// The login in the connection Secret, and the rotation's state.
    pub logins: Logins,
}

/// The expiry instants this process warned about (`spec.expireAfter`: one Warning Event
/// per instant), by Database UID.
#[derive(Default)]
pub struct ExpiryWarnings(
    std::sync::Mutex<std::collections::HashMap<String, k8s_openapi::jiff::Timestamp>>,
);

impl ExpiryWarnings {
    /// Whether the warning of `uid` expiring at `at` is new (and records it).
    pub fn first(&self, uid: &str, at: k8s_openapi::jiff::Timestamp) -> bool {
        let mut warned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        warned.insert(uid.to_string(), at) != Some(at)
    }

    /// A Database gone: its entry goes.
    pub fn forget(&self, uid: &str) {
        let mut warned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        warned.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verification_is_recent_only_for_its_generation_and_window() {
        let verified = Verified::default();
        let p = Provisioned {
            provider_id: "h:5432/1".into(),
            server_version: "15".into(),
            server: "pg-main".into(),
            endpoint: "h:5432".into(),
            size_bytes: 0,
            size_limit: None,
            logins: Logins::default(),
        };
        verified.record("uid-1", 1, &p);
        assert_eq!(
            verified.recent("uid-1", 1, Duration::from_secs(60)),
            Some(p.clone())
        );
        assert_eq!(
            verified.recent("uid-1", 2, Duration::from_secs(60)),
            None,
            "a new generation needs a full check"
        );
        assert_eq!(
            verified.recent("uid-1", 1, Duration::ZERO),
            None,
            "outside the window"
        );
        verified.forget("uid-1");
        assert_eq!(verified.recent("uid-1", 1, Duration::from_secs(60)), None);
    }
}
