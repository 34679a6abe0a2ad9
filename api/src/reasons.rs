//! The reasons a dbops object's conditions carry, typed: one enum per kind
//! ([`DatabaseServerReason`], [`DatabaseReason`], [`DatabaseUserReason`],
//! [`BackupReason`], [`MigrationReason`]) and [`ProcessReason`] for the reasons that
//! never reach a condition (metrics, logs, `/readyz`).
//!
//! In status a reason stays a string (the CRD schemas do not change): a controller
//! writes [`as_str`](DatabaseReason::as_str) (or the `&'static str` the enum converts
//! into), and reads one back with [`parse`](DatabaseReason::parse) or `str::parse`.
//! A stored string compares with a variant directly:
//!
//! ```
//! use dbops_api::reasons::{DatabaseReason, ReasonClass};
//!
//! let stored = String::from("QuotaExceeded");
//! assert!(stored == DatabaseReason::QuotaExceeded);
//! let reason: DatabaseReason = stored.parse().unwrap();
//! assert_eq!(reason.class(), ReasonClass::Waits);
//! let written: &'static str = reason.into();
//! assert_eq!(written, "QuotaExceeded");
//! ```
//!
//! Each variant's string is its name, exactly (`CASecretNotFound`, `ServerWithoutTLS`).
//! A reason several kinds share (`ServerUnreachable`, `NameConflict`) is a variant of
//! each: its [`class`](Reason::class) can differ from kind to kind (an
//! `AuthenticationFailed` Backup has failed for good; a Database waits for the admin
//! Secret to be fixed). [`Reason::to`] carries a reason from one enum to another when
//! the other has it (the shared crate's server errors into a kind's reason).
//!
//! The catalogue for people is the "Condition reasons" section of docs/operations.md;
//! `api/tests/reasons_documented.rs` holds its tables against these enums both ways, so
//! a reason added here without a row there (or the other way round) fails the tests.
//! Event reasons (`PasswordRotated`, `BackupScheduled`, `<Step>Succeeded`) are not here,
//! nor the step names a Migration's `Progressing` condition carries
//! ([`crate::migration::MigrationStep`]).

use std::fmt;
use std::str::FromStr;

/// How a controller treats a reason: what its status shows and whether it tries again.
///
/// The classes are read off what the controllers do with each reason today:
/// - Database: [`ReasonClass::Retried`] is the database-controller's `retrying` list
///   (status `Progressing=True`, reason `Retrying`, phase `Provisioning`),
///   [`ReasonClass::Progressing`] its `on_the_way` list plus the deletion's expected
///   steps (a Normal Event), [`ReasonClass::Waits`] every other failure (phase `Failed`,
///   `Progressing=False`; some of them, `Error::Retry` in the controller, are still
///   looked at again after a backoff), [`ReasonClass::Degraded`] `DatabaseMissing`
///   (phase `Degraded`). Whether a failure also sets `Degraded` on a Database
///   provisioned before is [`DatabaseReason::degrades`], not a class: it crosses them.
///   A DatabaseUser's reasons have the Database's classes.
/// - Backup: [`ReasonClass::Failed`] is a permanent failure (phase `Failed` at once),
///   [`ReasonClass::Retried`] a transient one (retried up to `maxRetries`).
/// - Migration: [`ReasonClass::Failed`] rolls back at once (`Error::Fatal`),
///   [`ReasonClass::Retried`] counts against the step's attempts; a server's Secrets,
///   authentication and TLS are refused for good at Preflight and retried later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReasonClass {
    /// `Ready=True`: the object is as specified.
    Ready,
    /// The calm reason of a condition other than `Ready` (`AsExpected`, `NoFailure`,
    /// `WithinLimit`, a Migration's mode): nothing to report.
    Nominal,
    /// A step on the expected way (waiting for a slot, restoring, deleting): a Normal
    /// Event, nothing to do.
    Progressing,
    /// A failure the controller retries on its own with the per-object backoff.
    Retried,
    /// Nothing changes until the object, its Secret, its server or another object does
    /// (the controller may still look again, but the status says it waits).
    Waits,
    /// Something that worked is damaged and no retry repairs it (a database gone from
    /// its server, a size over the limit).
    Degraded,
    /// The object has ended in failure: no further attempt (a Backup `Failed`, a
    /// Migration rolling back or refused).
    Failed,
}

impl ReasonClass {
    /// Every class.
    pub const ALL: &'static [ReasonClass] = &[
        ReasonClass::Ready,
        ReasonClass::Nominal,
        ReasonClass::Progressing,
        ReasonClass::Retried,
        ReasonClass::Waits,
        ReasonClass::Degraded,
        ReasonClass::Failed,
    ];

    /// The class's name, as the module docs write it.
    pub const fn as_str(self) -> &'static str {
        match self {
            ReasonClass::Ready => "Ready",
            ReasonClass::Nominal => "Nominal",
            ReasonClass::Progressing => "Progressing",
            ReasonClass::Retried => "Retried",
            ReasonClass::Waits => "Waits",
            ReasonClass::Degraded => "Degraded",
            ReasonClass::Failed => "Failed",
        }
    }
}

impl fmt::Display for ReasonClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is no reason of the kind it was parsed as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownReason {
    /// The kind whose reasons were searched, for example `Database`.
    pub kind: &'static str,
    /// The string that was not found.
    pub text: String,
}

impl fmt::Display for UnknownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not a {} condition reason", self.text, self.kind)
    }
}

impl std::error::Error for UnknownReason {}

/// What every reason enum has; each also has the same as inherent items, so callers do
/// not need this trait in scope. Generic code (the docs test, a metric label) uses it.
pub trait Reason:
    Copy + Eq + fmt::Debug + fmt::Display + FromStr<Err = UnknownReason> + 'static
{
    /// The kind whose conditions carry these reasons (`Database`), or `process`.
    const KIND: &'static str;
    /// Every reason.
    const ALL: &'static [Self];

    /// The CamelCase string written in status.
    fn as_str(self) -> &'static str;

    /// How the controllers treat it.
    fn class(self) -> ReasonClass;

    /// The reason `text` names, if it is one of this kind.
    fn parse(text: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|r| r.as_str() == text)
    }

    /// The same reason as another kind's, if that kind has it.
    fn to<R: Reason>(self) -> Option<R> {
        R::parse(self.as_str())
    }
}

/// Declares a reason enum: each variant's string is its name.
macro_rules! reasons {
    (
        $(#[$doc:meta])*
        $name:ident for $kind:literal {
            $( $(#[$vdoc:meta])* $variant:ident => $class:ident, )+
        }
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vdoc])* $variant, )+
        }

        impl $name {
            /// Every reason of the kind.
            pub const ALL: &'static [$name] = &[ $( $name::$variant, )+ ];

            /// The CamelCase string written in status.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => stringify!($variant), )+
                }
            }

            /// How the controllers treat it (see [`ReasonClass`]).
            pub const fn class(self) -> ReasonClass {
                match self {
                    $( $name::$variant => ReasonClass::$class, )+
                }
            }

            /// The reason `text` names, if it is one of this kind.
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $( stringify!($variant) => Some($name::$variant), )+
                    _ => None,
                }
            }
        }

        impl Reason for $name {
            const KIND: &'static str = $kind;
            const ALL: &'static [Self] = $name::ALL;

            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }

            fn class(self) -> ReasonClass {
                $name::class(self)
            }

            fn parse(text: &str) -> Option<Self> {
                $name::parse(text)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownReason;

            fn from_str(text: &str) -> Result<Self, UnknownReason> {
                $name::parse(text).ok_or_else(|| UnknownReason {
                    kind: $kind,
                    text: text.to_string(),
                })
            }
        }

        impl From<$name> for &'static str {
            fn from(reason: $name) -> &'static str {
                reason.as_str()
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, reason: &$name) -> bool {
                self == reason.as_str()
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, reason: &$name) -> bool {
                *self == reason.as_str()
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, reason: &$name) -> bool {
                self == reason.as_str()
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, text: &str) -> bool {
                self.as_str() == text
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, text: &&str) -> bool {
                self.as_str() == *text
            }
        }
    };
}

reasons! {
    /// The reasons of a DatabaseServer's `Ready` condition (the database-controller's
    /// probe): its Secrets and the server refuse or wait; the server's own failures are
    /// probed again every 10 s.
    DatabaseServerReason for "DatabaseServer" {
        /// The probe connected as the admin with the TLS asked for.
        Reachable => Ready,
        /// `adminSecretRef` names no Secret in the controllers' namespace.
        AdminSecretNotFound => Waits,
        /// The admin Secret lacks `username` or `password`, or a value is not UTF-8.
        AdminSecretInvalid => Waits,
        /// `tls.caSecretRef` names no Secret in the controllers' namespace.
        CASecretNotFound => Waits,
        /// The CA Secret has no usable `ca.crt`.
        CASecretInvalid => Waits,
        /// No connection, or the circuit breaker is open.
        ServerUnreachable => Retried,
        /// The server refused the admin's name or password.
        AuthenticationFailed => Retried,
        /// The server's certificate does not chain to the CA.
        CertificateNotTrusted => Retried,
        /// `verify-full` and the certificate does not name the host.
        HostnameMismatch => Retried,
        /// TLS is required and the server does not offer it.
        ServerWithoutTLS => Retried,
        /// Reading the version and TLS of the probe's session failed.
        SqlError => Retried,
        /// A statement of the probe waited too long for a lock.
        LockTimeout => Retried,
        /// A statement of the probe ran too long.
        StatementTimeout => Retried,
        /// The caches of servers, Secrets and namespaces are not filled yet.
        CacheNotSynced => Retried,
        /// The server is being deleted and Databases or Migrations still use it.
        InUse => Waits,
    }
}

/// Declares the enum of a Database or a DatabaseUser: the kind's own reasons, then the
/// ones both have. They come from the same code (the server's directory and probe, the
/// namespace's RoleBinding, PostgreSQL, the session limits and the Secret template) and
/// have the same class in both.
macro_rules! database_reasons {
    (
        $(#[$doc:meta])*
        $name:ident for $kind:literal { $($own:tt)* }
    ) => {
        reasons! {
            $(#[$doc])*
            $name for $kind {
                $($own)*
                /// The Database's `spec.serverRef` names no DatabaseServer this
                /// installation serves.
                ServerNotFound => Waits,
                /// The server's `allowedNamespaces` does not select the namespace.
                NamespaceNotAllowed => Waits,
                /// The server's admin Secret is missing.
                AdminSecretNotFound => Waits,
                /// The server's admin Secret is unusable.
                AdminSecretInvalid => Waits,
                /// The server's CA Secret is missing.
                CASecretNotFound => Waits,
                /// The server's CA Secret is unusable.
                CASecretInvalid => Waits,
                /// A cache has not listed its objects yet.
                CacheNotSynced => Retried,
                /// A RoleBinding of the controller's name exists that dbops did not make.
                RoleBindingConflict => Waits,
                /// Writing the RoleBinding that grants the connection Secrets failed.
                KubernetesApiError => Waits,
                /// The server cannot be reached, or its breaker is open.
                ServerUnreachable => Retried,
                /// The server refused the admin.
                AuthenticationFailed => Waits,
                /// The server's certificate does not chain to the CA.
                CertificateNotTrusted => Retried,
                /// The certificate does not name the host.
                HostnameMismatch => Retried,
                /// TLS is required and the server does not offer it.
                ServerWithoutTLS => Retried,
                /// A statement waited longer than `--lock-timeout`.
                LockTimeout => Retried,
                /// A statement ran longer than `--statement-timeout`.
                StatementTimeout => Retried,
                /// Another SQL error.
                SqlError => Retried,
                /// A role, database or Secret of that name is not this object's.
                NameConflict => Waits,
                /// A Secret `<name>-connection` exists that this object did not create.
                SecretConflict => Waits,
                /// A connection limit or session setting is over the server's ceiling.
                LimitExceeded => Waits,
                /// A session setting is not a duration or an amount of memory.
                InvalidSpec => Waits,
                /// A `spec.secretTemplate` value does not render.
                InvalidSecretTemplate => Waits,
                /// A state the controller does not expect.
                InternalError => Waits,
            }
        }
    };
}

database_reasons! {
    /// The reasons of a Database's conditions: `Ready` (and while deleting
    /// `Progressing`), `Progressing`, `Degraded`, `SizeExceeded`, `MigrationInProgress`.
    DatabaseReason for "Database" {
        /// Role, database, extensions and connection Secret are as specified.
        Provisioned => Ready,
        /// The namespace has more Databases on the server than it allows.
        QuotaExceeded => Waits,
        /// A new Database names a DatabaseServer being deleted.
        ServerDeleting => Waits,
        /// `spec.extensions` names an extension the server does not allow.
        ExtensionNotAllowed => Waits,
        /// An allowed extension is not installed on the server.
        ExtensionNotAvailable => Waits,
        /// The database was created and has disappeared from the server.
        DatabaseMissing => Degraded,
        /// `restoreFrom` names a Backup not `Completed` yet.
        WaitingForBackup => Progressing,
        /// `restoreFrom` names no Backup in the namespace.
        BackupNotFound => Waits,
        /// The Backup named in `restoreFrom` failed.
        BackupFailed => Waits,
        /// The Backup's artifact or manifest is not in the store.
        ArtifactNotFound => Waits,
        /// The artifact's SHA-256 differs from its manifest or the Backup's status.
        ChecksumMismatch => Waits,
        /// The store could not be read.
        StoreUnavailable => Retried,
        /// pg_restore is running.
        Restoring => Progressing,
        /// pg_restore failed or could not run.
        RestoreFailed => Retried,
        /// No pg_restore given to the controller reads the artifact.
        PgRestoreTooOld => Waits,
        /// The pg_restores that read the artifact are too new for the server.
        PgRestoreTooNew => Waits,
        /// The Database is being deleted (`Ready`).
        Deleting => Progressing,
        /// Deleting: the final Backup is not Ready yet, or failed.
        WaitingForFinalBackup => Progressing,
        /// Deleting: a Backup of the final snapshot's name is not this Database's.
        FinalSnapshotConflict => Waits,
        /// Deleting: a Migration of this Database is running.
        MigrationInProgress => Waits,
        /// `Progressing=True`: a [`ReasonClass::Retried`] reason is being retried.
        Retrying => Retried,
        /// `Degraded=False`.
        AsExpected => Nominal,
        /// `SizeExceeded=False`: the database is within `limits.databaseSize`.
        WithinLimit => Nominal,
        /// `SizeExceeded=True`: the database is larger than `limits.databaseSize`.
        SizeExceeded => Degraded,
        /// `MigrationInProgress=True`: a Migration is moving the database.
        MigrationRunning => Progressing,
        /// `MigrationInProgress=False`.
        NoMigration => Nominal,
    }
}

impl DatabaseReason {
    /// Whether a failure for this reason marks a Database provisioned before `Degraded`
    /// ("it worked before and is broken now"), whatever its class.
    pub const fn degrades(self) -> bool {
        matches!(
            self,
            DatabaseReason::ServerUnreachable
                | DatabaseReason::DatabaseMissing
                | DatabaseReason::SqlError
                | DatabaseReason::AuthenticationFailed
                | DatabaseReason::CertificateNotTrusted
                | DatabaseReason::HostnameMismatch
                | DatabaseReason::ServerWithoutTLS
        )
    }
}

database_reasons! {
    /// The reasons of a DatabaseUser's `Ready` condition. The user's status has no
    /// `Progressing`: the classes say what the Database's would.
    DatabaseUserReason for "DatabaseUser" {
        /// The logins, their privileges and the connection Secret are as specified.
        UserReady => Ready,
        /// `spec.databaseRef` names no Database in the namespace.
        DatabaseNotFound => Waits,
        /// The Database is not provisioned yet.
        DatabaseNotReady => Waits,
        /// The Database is being deleted.
        DatabaseDeleting => Waits,
        /// `spec.schemas` names schemas that do not exist.
        SchemaNotFound => Waits,
    }
}

reasons! {
    /// The reasons of a Backup's `Ready`, `Progressing` and `Failed` conditions.
    BackupReason for "Backup" {
        /// The artifact and its manifest are in the store.
        Completed => Ready,
        /// The Database is not Ready (or not provisioned yet).
        WaitingForDatabase => Progressing,
        /// All slots are busy, or a dump of the same server is running.
        WaitingForSlot => Progressing,
        /// An attempt is dumping.
        Running => Progressing,
        /// `Progressing=True`: an attempt failed with a transient reason.
        Retrying => Retried,
        /// `Failed=False`.
        NoFailure => Nominal,
        /// The Database named in `databaseRef` does not exist.
        DatabaseNotFound => Failed,
        /// The Database (by UID) was deleted and created again under its name.
        DatabaseReplaced => Failed,
        /// The last allowed attempt was interrupted.
        Interrupted => Failed,
        /// The server refused the admin.
        AuthenticationFailed => Failed,
        /// The server's certificate does not chain to the CA.
        CertificateNotTrusted => Failed,
        /// The certificate does not name the host.
        HostnameMismatch => Failed,
        /// TLS is required and the server does not offer it.
        ServerWithoutTLS => Failed,
        /// The store refused the request.
        StoreRefused => Failed,
        /// The store's configuration is unusable.
        StoreMisconfigured => Failed,
        /// No pg_dump given to the controller dumps the server.
        PgDumpTooOld => Failed,
        /// No pg_dump answered `--version`.
        ClientProgramFailed => Retried,
        /// The store lost the artifact being written.
        ArtifactNotFound => Failed,
        /// The server cannot be reached.
        ServerUnreachable => Retried,
        /// A lock held by another session.
        LockTimeout => Retried,
        /// A statement ran too long.
        StatementTimeout => Retried,
        /// Another SQL error.
        SqlError => Retried,
        /// pg_dump failed.
        DumpFailed => Retried,
        /// The manifest could not be written.
        ManifestFailed => Retried,
        /// The store is unreachable.
        StoreUnavailable => Retried,
        /// The Database's server is not one this installation serves.
        ServerNotFound => Retried,
        /// The server's admin Secret is missing.
        AdminSecretNotFound => Retried,
        /// The server's admin Secret is unusable.
        AdminSecretInvalid => Retried,
        /// The server's CA Secret is missing.
        CASecretNotFound => Retried,
        /// The server's CA Secret is unusable.
        CASecretInvalid => Retried,
        /// A cache has not listed its objects yet.
        CacheNotSynced => Retried,
    }
}

reasons! {
    /// The reasons of a Migration's `Ready`, `Progressing`, `Failed` and `ModeChosen`
    /// conditions (while a step runs, `Progressing` carries the step's name instead).
    MigrationReason for "Migration" {
        /// `Ready=False` while a step runs.
        InProgress => Progressing,
        /// The Database named in `databaseRef` does not exist (Pending).
        DatabaseNotFound => Waits,
        /// `cutover: Manual`: waiting for `spec.approved`.
        AwaitingApproval => Waits,
        /// The Database is on the target and Cleanup is done.
        Succeeded => Ready,
        /// A step failed; the compensations run.
        RollingBack => Progressing,
        /// A compensation failed and is retried.
        CompensationRetrying => Retried,
        /// Every step that ran was undone.
        RolledBack => Failed,
        /// Another Migration of the same Database is active.
        MigrationAlreadyActive => Failed,
        /// `Failed=False`.
        NoFailure => Nominal,
        /// The target is the Database's server.
        TargetIsSource => Failed,
        /// The source database is missing or not this Database's.
        SourceNotFound => Failed,
        /// The target's major is older than the source's.
        TargetVersionTooOld => Failed,
        /// An extension of the database is not allowed on the target.
        ExtensionNotAllowed => Failed,
        /// An extension of the database is not available on the target.
        ExtensionNotAvailable => Failed,
        /// Logical replication into a target older than 16 would run tenant code as the admin.
        LogicalUnsafeBefore16 => Failed,
        /// A role, database, snapshot Backup or replication role of that name is not this Migration's.
        NameConflict => Failed,
        /// The target does not admit the namespace.
        NamespaceNotAllowed => Retried,
        /// The target is full for the namespace.
        QuotaExceeded => Failed,
        /// A server of the Migration does not exist.
        ServerNotFound => Retried,
        /// The target is being deleted.
        ServerDeleting => Retried,
        /// A server's admin Secret is missing.
        AdminSecretNotFound => Retried,
        /// A server's admin Secret is unusable.
        AdminSecretInvalid => Retried,
        /// A server's CA Secret is missing.
        CASecretNotFound => Retried,
        /// A server's CA Secret is unusable.
        CASecretInvalid => Retried,
        /// A server refused the admin.
        AuthenticationFailed => Retried,
        /// A server's certificate does not chain to the CA.
        CertificateNotTrusted => Retried,
        /// A certificate does not name the host.
        HostnameMismatch => Retried,
        /// TLS is required and a server does not offer it.
        ServerWithoutTLS => Retried,
        /// The Database is being deleted.
        DatabaseDeleting => Failed,
        /// The source's `wal_level` is not `logical`.
        WalLevelNotLogical => Failed,
        /// The source has no free replication slot.
        NoFreeReplicationSlot => Failed,
        /// The source has no free WAL sender.
        NoFreeWalSender => Failed,
        /// Tables without a primary key or replica identity.
        TablesWithoutReplicaIdentity => Failed,
        /// The database holds large objects.
        LargeObjectsPresent => Failed,
        /// The snapshot Backup failed.
        SnapshotFailed => Failed,
        /// Sessions survived `pg_terminate_backend`.
        SessionsRemain => Retried,
        /// A server cannot be reached.
        ServerUnreachable => Retried,
        /// A statement waited too long for a lock.
        LockTimeout => Retried,
        /// A statement ran too long.
        StatementTimeout => Retried,
        /// Another SQL error.
        SqlError => Retried,
        /// pg_dump failed.
        DumpFailed => Retried,
        /// pg_restore failed.
        RestoreFailed => Retried,
        /// pg_dump or pg_restore could not run.
        CopyFailed => Retried,
        /// No pg_dump reads the source's major.
        PgDumpTooOld => Failed,
        /// No pg_restore reads the dump.
        PgRestoreTooOld => Failed,
        /// The pg_restores are too new for the target.
        PgRestoreTooNew => Failed,
        /// No pg_dump or pg_restore answered `--version`.
        ClientProgramFailed => Retried,
        /// The target cannot connect to the source for its subscription.
        SourceUnreachableFromTarget => Retried,
        /// `CREATE SUBSCRIPTION` failed otherwise.
        SubscriptionFailed => Retried,
        /// The target failed to apply replicated changes.
        ReplicationApplyFailed => Failed,
        /// Someone dropped the subscription.
        SubscriptionGone => Failed,
        /// Someone dropped the replication slot.
        ReplicationSlotGone => Failed,
        /// The source removed WAL the slot needs.
        ReplicationSlotLost => Failed,
        /// The source's tables or columns changed during the replication.
        SchemaChanged => Failed,
        /// A slot is still in use after its WAL sender was ended.
        ReplicationSlotActive => Retried,
        /// The target did not catch up in time.
        CatchUpTimedOut => Failed,
        /// The tables or their row counts differ between the servers.
        VerifyFailed => Failed,
        /// Preflight has not recorded the source.
        SourceNotRecorded => Retried,
        /// A state the controller does not expect.
        InternalError => Retried,
        /// The hidden test flag `--debug-fail-at` asked for a failure.
        InjectedFailure => Failed,
        /// The Migration was deleted before SwitchTraffic.
        MigrationDeleted => Failed,
        /// The Database was deleted before SwitchTraffic.
        DatabaseDeleted => Failed,
        /// A rollback without a recorded reason.
        StepFailed => Failed,
        /// `ModeChosen=True`: Logical.
        LogicalPossible => Nominal,
        /// `ModeChosen=False`: `mode: Dump`.
        DumpRequested => Nominal,
        /// `ModeChosen=False`: `Auto` fell back to Dump without a named reason.
        LogicalNotPossible => Nominal,
    }
}

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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn check<R: Reason>() {
        let mut seen = BTreeSet::new();
        for r in R::ALL {
            assert!(seen.insert(r.as_str()), "{} twice in {}", r, R::KIND);
            assert_eq!(format!("{r:?}"), r.as_str());
            assert_eq!(r.to_string(), r.as_str());
            assert_eq!(r.as_str().parse::<R>(), Ok(*r));
            assert_eq!(<R as Reason>::parse(r.as_str()), Some(*r));
            let first = r.as_str().chars().next().unwrap();
            assert!(
                first.is_ascii_uppercase() && r.as_str().chars().all(|c| c.is_ascii_alphanumeric())
            );
        }
        let err = "NoSuchReason".parse::<R>().unwrap_err();
        assert_eq!(err.kind, R::KIND);
        assert!(err.to_string().contains("NoSuchReason"));
    }

    #[test]
    fn every_reason_round_trips_through_its_string() {
        check::<DatabaseServerReason>();
        check::<DatabaseReason>();
        check::<DatabaseUserReason>();
        check::<BackupReason>();
        check::<MigrationReason>();
        check::<ProcessReason>();
    }

    #[test]
    fn a_stored_string_compares_with_a_variant() {
        let stored = String::from("QuotaExceeded");
        assert!(stored == DatabaseReason::QuotaExceeded);
        assert!("QuotaExceeded" == DatabaseReason::QuotaExceeded);
        assert!(DatabaseReason::QuotaExceeded == "QuotaExceeded");
        assert!(stored != DatabaseReason::NameConflict);
        let written: &'static str = DatabaseReason::ServerWithoutTLS.into();
        assert_eq!(written, "ServerWithoutTLS");
    }

    #[test]
    fn a_reason_moves_to_another_kind_that_has_it() {
        let r = DatabaseReason::ServerUnreachable;
        assert_eq!(
            r.to::<BackupReason>(),
            Some(BackupReason::ServerUnreachable)
        );
        assert_eq!(DatabaseReason::Restoring.to::<BackupReason>(), None);
    }

    /// The classes repeat the database-controller's `retrying`, `on_the_way` and
    /// `degrades` lists (status.rs) exactly, so replacing them changes nothing.
    #[test]
    fn the_database_classes_are_the_controllers_lists() {
        let retried: BTreeSet<&str> = DatabaseReason::ALL
            .iter()
            .filter(|r| r.class() == ReasonClass::Retried && **r != DatabaseReason::Retrying)
            .map(|r| r.as_str())
            .collect();
        assert_eq!(
            retried,
            BTreeSet::from([
                "CacheNotSynced",
                "ServerUnreachable",
                "CertificateNotTrusted",
                "HostnameMismatch",
                "ServerWithoutTLS",
                "LockTimeout",
                "StatementTimeout",
                "SqlError",
                "StoreUnavailable",
                "RestoreFailed",
            ])
        );
        let degrades: BTreeSet<&str> = DatabaseReason::ALL
            .iter()
            .filter(|r| r.degrades())
            .map(|r| r.as_str())
            .collect();
        assert_eq!(
            degrades,
            BTreeSet::from([
                "ServerUnreachable",
                "AuthenticationFailed",
                "CertificateNotTrusted",
                "HostnameMismatch",
                "ServerWithoutTLS",
                "SqlError",
                "DatabaseMissing",
            ])
        );
        assert_eq!(
            DatabaseReason::WaitingForBackup.class(),
            ReasonClass::Progressing
        );
        assert_eq!(DatabaseReason::Restoring.class(), ReasonClass::Progressing);
    }
}
