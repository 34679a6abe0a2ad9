//! A DatabaseServer's reasons.

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
        /// The admin may not read what the probe reads.
        AdminLacksPrivilege => Retried,
        /// A statement of the probe waited too long for a lock.
        LockTimeout => Retried,
        /// A statement of the probe ran too long.
        StatementTimeout => Retried,
        /// The caches of servers, Secrets and namespaces are not filled yet.
        CacheNotSynced => Retried,
        /// The server is being deleted and Databases or Migrations still use it.
        InUse => Waits,
        /// `PoolerReady`: every pooler Pod is ready.
        PoolerRunning => Ready,
        /// `PoolerReady`: the pooler's Pods are starting or not all ready.
        PoolerStarting => Progressing,
        /// `PoolerReady`: an object of the pooler's name in the controllers' namespace was
        /// not made by dbops; nothing is changed.
        PoolerNameTaken => Waits,
        /// `PoolerReady`: the pooler's configuration cannot be written.
        PoolerConfigInvalid => Waits,
    }
}
