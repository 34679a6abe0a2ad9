//! The reasons that never reach a condition.

reasons! {
    /// Reasons that never reach a condition: the `reason` label of
    /// `dbops_reconcile_errors_total`, the logs, spans and `/readyz`.
    ProcessReason for "process" {
        /// The backup store is not writable (`/readyz`).
        BackupStoreNotWritable => Retried,
        /// The store is not the one registered in `dbops-backup-store` (`/readyz`).
        BackupStoreMismatch => Retried,
        /// The store or the API could not be asked (`/readyz`).
        BackupStoreUnavailable => Retried,
        /// A Kubernetes API request failed.
        KubernetesApiError => Retried,
        /// A reconcile ran longer than `--reconcile-timeout`.
        ReconcileTimeout => Retried,
        /// The backup-scheduler's cache of Backups has not synced.
        StoreNotSynced => Retried,
        /// The object a reconcile read was deleted or created again meanwhile; nothing
        /// was written for it.
        Superseded => Retried,
        /// A Database's `spec.backup.schedule` does not parse or never fires.
        InvalidSchedule => Waits,
        /// A Database name over 63 characters cannot have a schedule.
        NameTooLong => Waits,
    }
}
