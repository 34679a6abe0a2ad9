//! A Backup's reasons.

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
        /// The server's admin lacks a right the dump needs (named in the message).
        AdminLacksPrivilege => Failed,
        /// pg_dump failed.
        DumpFailed => Retried,
        /// The manifest could not be written.
        ManifestFailed => Retried,
        /// The recipients the artifacts are to be encrypted to cannot be read.
        EncryptionKeysInvalid => Retried,
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
        /// `Verified=True`: the artifact restored with the tables, rows, objects and
        /// extensions the dump saw.
        VerificationPassed => Ready,
        /// `Verified=Unknown`: the artifact is being restored and checked.
        Verifying => Progressing,
        /// The artifact read back from the store does not have its recorded SHA-256.
        VerificationChecksumMismatch => Degraded,
        /// pg_restore failed on the artifact (or it did not decrypt).
        VerificationRestoreFailed => Degraded,
        /// A table holds a different number of rows than the dump's snapshot did.
        RowCountMismatch => Degraded,
        /// The restored schema has other objects or extensions than the dump saw.
        ObjectsMismatch => Degraded,
        /// The artifact could not be verified: no `--verify-server`, no key to open it,
        /// no inventory in its manifest, or the verification server refused.
        VerificationUnavailable => Waits,
        /// The artifact is larger than `--verify-max-bytes`.
        VerificationTooLarge => Waits,
        /// The verification took longer than `--verify-timeout`.
        VerificationTimedOut => Waits,
    }
}
