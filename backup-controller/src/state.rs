//! What the Backup controller keeps for the life of the process: its flags turned into
//! clients, the caches and memos its reconciles share. Depends on nothing of this crate
//! but the slot and retry types it holds.

use dbops_shared::backoff::Backoff;
use dbops_shared::backup_store::BackupStore;
use dbops_shared::events::Recorder;
use dbops_shared::pg_tools;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;

use dbops_api::Backup;
use dbops_shared::status::StatusWriter;
use kube::runtime::reflector::Store;

use crate::retries::Retries;
use crate::slots::Slots;

/// The backup-controller's own state.
pub struct State {
    /// The Backups as the controller's watch cache holds them: what the status writer's
    /// memo is pruned against.
    pub cache: Store<Backup>,
    pub store: BackupStore,
    /// `--backup-recipients-secret`: the Secret whose recipients every artifact is
    /// encrypted to (read at each attempt), if artifacts are encrypted.
    pub recipients_secret: Option<String>,
    /// The pg_dump programs (`--pg-dump`, `--pg-bin-dir`): each dump takes the oldest
    /// major that dumps its server; and the pg_restore programs (`--pg-restore`,
    /// `--pg-bin-dir`) a verification picks from.
    pub clients: pg_tools::Clients,
    pub servers: Servers,
    /// DatabaseServers and their admin and CA Secrets (the controllers' namespace only).
    pub directory: Directory,
    pub slots: Slots,
    /// The shared backoff curve (`--backoff-base`, `--backoff-max`), applied to the
    /// attempt count in the status so that it survives restarts.
    pub backoff: Backoff,
    pub recorder: Recorder,
    pub databases: DatabaseIndex,
    /// The one writer of Backup statuses in this process, and its answer to a watch
    /// cache older than its own last write ([`StatusWriter::latest`]).
    pub statuses: StatusWriter<Backup>,
    pub retries: Retries,
    /// This replica, as `status.runner` names it: `$POD_NAME`.
    pub identity: String,
    /// Where and how artifacts are verified (`spec.verify`).
    pub verification: Verification,
    /// The controller's own metrics (completed and verified Backups).
    pub metrics: crate::metrics::BackupMetrics,
}

/// The verification settings (`--verify-*`) and the one verification this replica runs
/// at a time.
pub struct Verification {
    /// `--verify-server`: the DatabaseServer artifacts are restored on, if any.
    pub server: Option<String>,
    /// `--verify-timeout`: the longest a verification (and a dump's inventory) may take.
    pub timeout: std::time::Duration,
    /// `--verify-max-bytes`: larger artifacts are not verified.
    pub max_bytes: u64,
    /// `--backup-identities-secret`: the Secret whose identities open encrypted artifacts.
    pub identities_secret: Option<String>,
    /// `--dump-inventory`: every dump counts what it saw (else only those of Backups
    /// created with `spec.verify`).
    pub inventory: bool,
    /// One verification at a time: the others wait for it.
    pub running: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Which Backups refer to which Database: Backup → `spec.databaseRef`, kept for Backups
/// that are not finished, so a Database event maps to the Backups waiting for them without
/// a scan.
pub type DatabaseIndex = dbops_shared::ref_index::RefIndex;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_maps_a_database_to_its_unfinished_backups() {
        let index = DatabaseIndex::default();
        index.record("ns", "b1", "orders");
        index.record("ns", "b2", "orders");
        index.record("other", "b3", "orders");
        let mut of = index.referrers_of("ns", "orders");
        of.sort();
        assert_eq!(of, ["b1", "b2"]);
        index.forget("ns", "b1");
        index.forget("ns", "b2");
        assert!(index.referrers_of("ns", "orders").is_empty());
    }
}
