//! Every name the dbops controllers put on objects besides the API's own fields:
//! finalizers, labels and annotations on Kubernetes objects, and the marks they leave in
//! PostgreSQL comments and lock keys. One place to find what a name means, who writes it
//! and who reads it; a controller names them through these consts, never a literal.
//!
//! ```
//! use dbops_api::names::{finalizer, label};
//!
//! assert_eq!(finalizer::DATABASE_CLEANUP, "dbops.dev/database-cleanup");
//! assert_eq!(label::MANAGED_BY, ("app.kubernetes.io/managed-by", "dbops"));
//! ```
//!
//! Changing a value orphans what a running installation wrote with the old one (a
//! finalizer nobody removes, a Secret no longer recognised as the controller's): keep
//! the values; add new names here.

/// The prefix of every dbops label, annotation, finalizer and comment mark.
pub const PREFIX: &str = "dbops.dev/";

/// Finalizers: each keeps its object until its controller has cleaned up.
pub mod finalizer {
    /// On a Database (database-controller): its database, roles and connection Secret
    /// are dropped (or kept, or snapshot) per `deletionPolicy` before it goes.
    pub const DATABASE_CLEANUP: &str = "dbops.dev/database-cleanup";
    /// On a DatabaseUser (database-controller): its roles are dropped before it goes.
    pub const USER_CLEANUP: &str = "dbops.dev/user-cleanup";
    /// On a DatabaseServer (database-controller), like PVC protection: removed once no
    /// Database and no unfinished Migration uses the server.
    pub const SERVER_IN_USE: &str = "dbops.dev/server-in-use";
    /// On a Backup with `deletionPolicy: Delete` (backup-controller): its artifact and
    /// manifest are removed from the store before it goes.
    pub const BACKUP_ARTIFACT: &str = "dbops.dev/backup-artifact";
    /// On a Migration (migration-controller): a Migration deleted before SwitchTraffic
    /// rolls back before it goes.
    pub const MIGRATION_ROLLBACK: &str = "dbops.dev/migration-rollback";

    /// Every finalizer.
    pub const ALL: [&str; 5] = [
        DATABASE_CLEANUP,
        USER_CLEANUP,
        SERVER_IN_USE,
        BACKUP_ARTIFACT,
        MIGRATION_ROLLBACK,
    ];
}

/// Labels: selectable, so a watch or a list can find the objects by them.
pub mod label {
    /// On a Database's connection Secret: the Database's name.
    pub const DATABASE: &str = "dbops.dev/database";
    /// On a DatabaseUser's connection Secret: the DatabaseUser's name.
    pub const DATABASE_USER: &str = "dbops.dev/database-user";
    /// On a final snapshot Backup (`deletionPolicy: Snapshot`): the metadata.uid of the
    /// Database being deleted.
    pub const FINAL_SNAPSHOT_OF: &str = "dbops.dev/final-snapshot-of";
    /// On a scheduled Backup (backup-scheduler): the name of the Database whose
    /// schedule created it.
    pub const SCHEDULE_OF: &str = "dbops.dev/schedule-of";
    /// On a Migration's snapshot Backup: the Migration it belongs to.
    pub const MIGRATION: &str = "dbops.dev/migration";
    /// On a DatabaseServer's pooler objects and Pods: their name, `dbops-pooler-<server>`
    /// (the Deployment's and Service's selector).
    pub const POOLER: &str = "dbops.dev/pooler";
    /// On what dbops creates for itself (connection Secrets, scheduled Backups, the
    /// tenant RoleBindings): the objects it may change or delete carry it.
    pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "dbops");
    /// On the tenant RoleBindings and the backup store's ConfigMap.
    pub const PART_OF: (&str, &str) = ("app.kubernetes.io/part-of", "dbops");
    /// On the tenant RoleBindings: the component that made them.
    pub const COMPONENT: (&str, &str) = ("app.kubernetes.io/component", "database-controller");
    /// On the tenant RoleBindings: the application that made them.
    pub const NAME: (&str, &str) = ("app.kubernetes.io/name", "dbops-database-controller");
}

/// Annotations: values too long or too free for a label.
pub mod annotation {
    /// On a Database or DatabaseUser, set by a user: any new value (a timestamp) starts
    /// one password rotation.
    pub const ROTATE: &str = "dbops.dev/rotate";
    /// On a Backup: the metadata.uid of the Database it must dump. A Backup carrying it
    /// fails (`DatabaseReplaced`) rather than dump another Database of the same name.
    pub const DATABASE_UID: &str = "dbops.dev/database-uid";
    /// On a scheduled Backup: its slot, RFC 3339 in UTC.
    pub const SCHEDULED_AT: &str = "dbops.dev/scheduled-at";
    /// On an object one controller creates for another: the W3C trace context, so the
    /// reconcile that follows continues the trace.
    pub const TRACEPARENT: &str = "dbops.dev/traceparent";
    /// On a connection Secret: the SHA-256 of the password the controller wrote, so an
    /// edit of it is noticed (and rotated).
    pub const PASSWORD_SHA256: &str = "dbops.dev/password-sha256";
    /// On a connection Secret: the keys rendered from `spec.secretTemplate`,
    /// comma-separated.
    pub const TEMPLATE_KEYS: &str = "dbops.dev/template-keys";
    /// On a connection Secret while the login before the last rotation still works:
    /// `<login> <until, seconds since the epoch> <its SCRAM verifier>`, so that the login
    /// can be set up where the Database moves (a Migration) with the same credential and
    /// end; never a password.
    pub const PREVIOUS_LOGIN: &str = "dbops.dev/previous-login";
    /// On the backup store's ConfigMap `dbops-backup-store`: what it is for.
    pub const DESCRIPTION: &str = "dbops.dev/description";
    /// On a DatabaseServer's pooler objects: the DatabaseServer they serve (a name too
    /// long for a label).
    pub const SERVER: &str = "dbops.dev/server";
    /// On a DatabaseServer's pooler objects: the SHA-256 of the object as dbops applied
    /// it (a converged pooler is read, not written).
    pub const APPLIED_SHA256: &str = "dbops.dev/applied-sha256";
    /// On a pooler Pod, put by a Migration's cutover: the digest of the pooler's Secret it
    /// waits for (updating the Pod makes the kubelet bring the Secret into its volume at
    /// once).
    pub const POOLER_CONFIG: &str = "dbops.dev/pooler-config";
}

/// Keys that never reach the API server: the database-controller's cache of connection
/// Secrets keeps a digest of the controller's own keys under this one (not a valid
/// Secret key, so never one a user wrote).
pub const OWN_KEYS_SHA256_KEY: &str = "dbops.dev/own-keys-sha256";

/// Marks in PostgreSQL: the words of a role's or database's `COMMENT`, and lock keys.
pub mod comment {
    /// `dbops.dev/uid=<Database uid>`: the first word of the comment of a role or
    /// database created for that Database; only what carries it is ever dropped.
    pub const UID_PREFIX: &str = "dbops.dev/uid=";
    /// `dbops.dev/migration=<Migration uid>`: on what a Migration created (the target's
    /// database and roles, its replication role).
    pub const MIGRATION_PREFIX: &str = "dbops.dev/migration=";
    /// On a replication role, after [`MIGRATION_PREFIX`]: it is one.
    pub const REPLICATION: &str = "dbops.dev/replication";
    /// On a database being restored: a half-restored database is dropped before the next
    /// attempt.
    pub const RESTORE_PENDING: &str = "dbops.dev/restore=pending";
    /// `dbops.dev/grant/<database>`: the advisory lock key that serialises the grants
    /// of one database's users.
    pub const GRANT_LOCK_PREFIX: &str = "dbops.dev/grant/";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dbops_name_has_the_prefix_and_no_two_are_equal() {
        let names = [
            finalizer::ALL.as_slice(),
            &[
                label::DATABASE,
                label::DATABASE_USER,
                label::FINAL_SNAPSHOT_OF,
                label::SCHEDULE_OF,
                label::MIGRATION,
                label::POOLER,
                annotation::ROTATE,
                annotation::DATABASE_UID,
                annotation::SCHEDULED_AT,
                annotation::TRACEPARENT,
                annotation::PASSWORD_SHA256,
                annotation::TEMPLATE_KEYS,
                annotation::DESCRIPTION,
                annotation::SERVER,
                annotation::APPLIED_SHA256,
                OWN_KEYS_SHA256_KEY,
            ],
        ]
        .concat();
        let mut seen = std::collections::BTreeSet::new();
        for name in names {
            assert!(name.starts_with(PREFIX), "{name}");
            assert!(seen.insert(name), "{name} twice");
        }
    }
}
