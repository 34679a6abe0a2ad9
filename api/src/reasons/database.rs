//! A Database's and a DatabaseUser's reasons, which share most of theirs.

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
                RoleBindingConflict => Retried,
                /// Writing the RoleBinding that grants the connection Secrets failed.
                KubernetesApiError => Retried,
                /// The server cannot be reached, or its breaker is open.
                ServerUnreachable => Retried,
                /// The server refused the admin.
                AuthenticationFailed => Retried,
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
                /// The server's admin lacks a right this needs (named in the message; the
                /// DatabaseServer's status.capabilities says what it has): nothing was
                /// changed, and nothing is until the right is granted.
                AdminLacksPrivilege => Waits,
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
                InternalError => Retried,
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
        /// The artifact is encrypted and none of the controller's identities opens it.
        DecryptionKeyMissing => Waits,
        /// The store could not be read.
        StoreUnavailable => Retried,
        /// pg_restore is running.
        Restoring => Progressing,
        /// pg_restore failed or could not run.
        RestoreFailed => Retried,
        /// `cloneFrom.databaseRef` names no Database in the namespace.
        CloneSourceNotFound => Waits,
        /// The Database `cloneFrom.databaseRef` names is not Ready (or is being deleted).
        CloneSourceNotReady => Progressing,
        /// The copy's server is of an older major version than the source's.
        CloneToOlderMajor => Waits,
        /// A `cloneFrom.mask` rule names a table or column the source does not have, or a
        /// value the column cannot hold.
        MaskInvalid => Waits,
        /// The clone is copying (progress in the message and `status.clone`).
        Cloning => Progressing,
        /// The clone waits for the server's `limits.concurrentClones` or
        /// `limits.cloneSpace`.
        CloneQueued => Progressing,
        /// The copy failed (pg_dump, the mask or psql); retried from an empty database.
        CloneFailed => Retried,
        /// No pg_dump and psql given to the controller copy the source into the server.
        ClientProgramMissing => Waits,
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
        /// `Progressing=True`: a [`ReasonClass::Retried`](super::ReasonClass::Retried) reason is being retried.
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
