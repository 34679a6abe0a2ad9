//! What every reason enum has: its class, the trait, the error of a failed parse.

use std::fmt;
use std::str::FromStr;

/// How a controller treats a reason: what its status shows and whether it tries again.
/// Each controller's error derives its retry from the class alone
/// (`dbops_shared::controller::retry_of`: `Retried` is retried with backoff, any other
/// waits for a change or ends the object), so the status and the retry agree.
///
/// - Database: [`ReasonClass::Retried`] is retried with backoff (status
///   `Progressing=True`, reason `Retrying`, phase `Provisioning`),
///   [`ReasonClass::Progressing`] a step on the way, including the deletion's expected
///   steps (a Normal Event; looked at again when a watch says it moved),
///   [`ReasonClass::Waits`] every other failure (phase `Failed`, `Progressing=False`;
///   looked at again on a change or at the resync), [`ReasonClass::Degraded`]
///   `DatabaseMissing` (phase `Degraded`). Whether a failure also sets `Degraded` on a Database
///   provisioned before is [`DatabaseReason::degrades`](super::DatabaseReason::degrades), not a class: it crosses them.
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
