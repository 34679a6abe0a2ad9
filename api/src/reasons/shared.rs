//! The reasons the shared crate names: a server's directory entry, PostgreSQL, TLS, the
//! extensions and the client programs. The shared crate returns them typed; each
//! controller carries one into its kind's enum with [`SharedReason::to`] (a kind that
//! meets a reason has it: each controller's tests hold the ones it meets).

use super::class::Reason;

macro_rules! shared_reasons {
    ($( $(#[$vdoc:meta])* $variant:ident, )+) => {
        /// A reason the shared crate gives; its class is the kind's that carries it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum SharedReason {
            $( $(#[$vdoc])* $variant, )+
        }

        impl SharedReason {
            /// Every reason the shared crate gives.
            pub const ALL: &'static [SharedReason] = &[ $( SharedReason::$variant, )+ ];

            /// The CamelCase string written in status.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( SharedReason::$variant => stringify!($variant), )+
                }
            }
        }
    };
}

shared_reasons! {
    /// No DatabaseServer of that name is served.
    ServerNotFound,
    /// The server's `allowedNamespaces` does not select the namespace.
    NamespaceNotAllowed,
    /// The server's admin Secret is missing.
    AdminSecretNotFound,
    /// The server's admin Secret is unusable.
    AdminSecretInvalid,
    /// The server's CA Secret is missing.
    CASecretNotFound,
    /// The server's CA Secret is unusable.
    CASecretInvalid,
    /// The server is being deleted.
    ServerDeleting,
    /// The caches have not listed their objects yet.
    CacheNotSynced,
    /// No connection, or the breaker is open.
    ServerUnreachable,
    /// The server refused the user.
    AuthenticationFailed,
    /// The certificate does not chain to the CA.
    CertificateNotTrusted,
    /// The certificate does not name the host.
    HostnameMismatch,
    /// TLS is required and the server does not offer it.
    ServerWithoutTLS,
    /// A statement waited longer than the lock timeout.
    LockTimeout,
    /// A statement ran longer than the statement timeout.
    StatementTimeout,
    /// The admin lacks a right the statement needs.
    AdminLacksPrivilege,
    /// Another SQL error.
    SqlError,
    /// The server's `allowedExtensions` does not list the extension.
    ExtensionNotAllowed,
    /// The extension is not installed on the server.
    ExtensionNotAvailable,
    /// No pg_dump is new enough for the server.
    PgDumpTooOld,
    /// No pg_restore reads the artifact.
    PgRestoreTooOld,
    /// The pg_restores that read the artifact are too new for the server.
    PgRestoreTooNew,
}

impl SharedReason {
    /// The same reason as `R`'s, if kind `R` has it.
    pub fn to<R: Reason>(self) -> Option<R> {
        R::parse(self.as_str())
    }
}

impl std::fmt::Display for SharedReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<SharedReason> for &'static str {
    fn from(reason: SharedReason) -> &'static str {
        reason.as_str()
    }
}

impl PartialEq<SharedReason> for &str {
    fn eq(&self, reason: &SharedReason) -> bool {
        *self == reason.as_str()
    }
}

impl PartialEq<&str> for SharedReason {
    fn eq(&self, text: &&str) -> bool {
        self.as_str() == *text
    }
}

#[cfg(test)]
mod tests {
    use super::super::backup::BackupReason;
    use super::super::database::DatabaseReason;
    use super::super::migration::MigrationReason;
    use super::*;

    /// Each reason is one of a kind that meets it: a Database or a Backup (the pick of a
    /// pg_dump is the backup's and the Migration's).
    #[test]
    fn each_shared_reason_is_a_kinds() {
        for r in SharedReason::ALL {
            let somewhere = r.to::<DatabaseReason>().is_some()
                || r.to::<BackupReason>().is_some()
                || r.to::<MigrationReason>().is_some();
            assert!(somewhere, "{r}");
            assert_eq!(format!("{r:?}"), r.as_str());
        }
    }
}
