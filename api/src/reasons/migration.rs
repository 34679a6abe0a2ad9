//! A Migration's reasons.

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
        /// A server's admin lacks a right the Migration needs (named in the message).
        AdminLacksPrivilege => Failed,
        /// The snapshot Backup failed.
        SnapshotFailed => Failed,
        /// Sessions survived `pg_terminate_backend`.
        SessionsRemain => Retried,
        /// A server cannot be reached.
        ServerUnreachable => Retried,
        /// A pooler instance's admin console cannot be reached or refused a command.
        PoolerUnreachable => Retried,
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
        /// A cache (the servers, their Secrets and namespaces, the Databases) has not
        /// listed its objects yet.
        CacheNotSynced => Retried,
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
