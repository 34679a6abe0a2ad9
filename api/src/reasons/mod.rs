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

            /// How the controllers treat it (see [`ReasonClass`](crate::reasons::ReasonClass)).
            pub const fn class(self) -> $crate::reasons::ReasonClass {
                match self {
                    $( $name::$variant => $crate::reasons::ReasonClass::$class, )+
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

        impl $crate::reasons::Reason for $name {
            const KIND: &'static str = $kind;
            const ALL: &'static [Self] = $name::ALL;

            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }

            fn class(self) -> $crate::reasons::ReasonClass {
                $name::class(self)
            }

            fn parse(text: &str) -> Option<Self> {
                $name::parse(text)
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::reasons::UnknownReason;

            fn from_str(text: &str) -> Result<Self, $crate::reasons::UnknownReason> {
                $name::parse(text).ok_or_else(|| $crate::reasons::UnknownReason {
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

mod backup;
mod class;
mod database;
mod migration;
mod process;
mod server;
mod shared;

pub use backup::BackupReason;
pub use class::{Reason, ReasonClass, UnknownReason};
pub use database::{DatabaseReason, DatabaseUserReason};
pub use migration::MigrationReason;
pub use process::ProcessReason;
pub use server::DatabaseServerReason;
pub use shared::SharedReason;

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

    /// The Database's `Retried` reasons are exactly those the database-controller
    /// retries with backoff (its error's kind derives from the class); the
    /// `degrades` list and the steps on the way are as the status shows them.
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
                "KubernetesApiError",
                "RoleBindingConflict",
                "ServerUnreachable",
                "AuthenticationFailed",
                "CertificateNotTrusted",
                "HostnameMismatch",
                "ServerWithoutTLS",
                "LockTimeout",
                "StatementTimeout",
                "SqlError",
                "StoreUnavailable",
                "RestoreFailed",
                "CloneFailed",
                "InternalError",
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
        for on_the_way in [
            DatabaseReason::Cloning,
            DatabaseReason::CloneQueued,
            DatabaseReason::CloneSourceNotReady,
        ] {
            assert_eq!(
                on_the_way.class(),
                ReasonClass::Progressing,
                "{on_the_way:?}"
            );
        }
    }
}
