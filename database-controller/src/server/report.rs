//! What the server-controller reports (pure): a probe's outcome ([`Probe`]) and the
//! status and conditions it and the pooler's report make ([`desired`]).

use dbops_api::reasons::{DatabaseServerReason, ReasonClass, SharedReason};
use dbops_api::{
    DatabaseServer, DatabaseServerStatus, ServerCapabilities, ServerTlsStatus, condition,
};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, set_condition};
use dbops_shared::status::{Desired, Note};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// What a probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    Ready {
        version: String,
        tls: ServerTlsStatus,
        user: String,
        capabilities: ServerCapabilities,
    },
    /// Its reason's class says whether a retry can cure it (`Retried`: probed again
    /// soon) or it waits for a Secret to change.
    Failed {
        reason: DatabaseServerReason,
        message: String,
    },
}

impl Probe {
    /// A failure shown with `reason`.
    pub fn failed(reason: DatabaseServerReason, message: impl Into<String>) -> Self {
        Probe::Failed {
            reason,
            message: message.into(),
        }
    }

    /// Whether it failed for a reason only time cures (probed again soon).
    pub fn failed_transiently(&self) -> bool {
        matches!(self, Probe::Failed { reason, .. } if reason.class() == ReasonClass::Retried)
    }
}

/// A reason of the shared crate as the server's: every one a probe meets is one
/// (tested in `server`); `ServerUnreachable` if one ever is not.
pub fn server_reason(reason: SharedReason) -> DatabaseServerReason {
    reason
        .to()
        .unwrap_or(DatabaseServerReason::ServerUnreachable)
}

/// How the Ready message describes the admin: a superuser, or what it lacks of what
/// dbops can use.
pub fn admin_summary(user: &str, c: &ServerCapabilities) -> String {
    if c.superuser {
        return format!("{user} (superuser)");
    }
    let lacks: Vec<&str> = [
        (c.create_role, "createRole"),
        (c.create_database, "createDatabase"),
        (c.replication, "replication"),
        (c.create_subscription, "createSubscription"),
        (c.signal_backend, "signalBackend"),
    ]
    .iter()
    .filter(|(has, _)| !has)
    .map(|(_, name)| *name)
    .collect();
    if lacks.is_empty() {
        format!("{user} (not a superuser; every right dbops uses)")
    } else {
        format!(
            "{user} (not a superuser; lacks {}: see status.capabilities)",
            lacks.join(", ")
        )
    }
}

/// What a server's status reports: its probe, or, while its deletion waits, what still
/// uses it.
pub enum Report<'a> {
    Probe(&'a Probe),
    InUse(String),
}

/// The status a report asks for, built on `old` (the latest status) at time `t`, with an
/// Event when `Ready` changes (pure).
pub fn desired(
    server: &DatabaseServer,
    old: &DatabaseServerStatus,
    report: Report<'_>,
    databases: usize,
    pooler: Option<&crate::pooler::Report>,
    t: Time,
) -> Desired<DatabaseServerStatus> {
    let mut new = old.clone();
    let generation = server.metadata.generation;
    new.observed_generation = generation;
    new.databases = Some(i32::try_from(databases).unwrap_or(i32::MAX));
    let pooler_note = pooler_condition(&mut new, pooler, generation, t.clone());
    let (status, reason, message) = match report {
        Report::InUse(message) => (
            ConditionStatus::False,
            DatabaseServerReason::InUse.as_str(),
            message,
        ),
        Report::Probe(Probe::Ready {
            version,
            tls,
            user,
            capabilities,
        }) => {
            new.server_version = Some(version.clone());
            new.tls = Some(tls.clone());
            new.capabilities = Some(capabilities.clone());
            let user = admin_summary(user, capabilities);
            let over = match &tls.protocol {
                Some(p) => format!("{p} ({})", tls.mode.as_str()),
                None => "plain TCP (tls.mode disable)".into(),
            };
            (
                ConditionStatus::True,
                DatabaseServerReason::Reachable.as_str(),
                format!("connected as {user} over {over}; PostgreSQL {version}"),
            )
        }
        Report::Probe(probe @ Probe::Failed { reason, message }) => {
            // Written once per outage: while the reason stays, the first message stays
            // (the details of a failing connection vary from one probe to the next).
            let transient = probe.failed_transiently();
            let kept = dbops_shared::conditions::get(&old.conditions, condition::READY)
                .filter(|c| transient && c.status == "False" && c.reason == *reason)
                .map(|c| c.message.clone());
            (
                ConditionStatus::False,
                reason.as_str(),
                kept.unwrap_or_else(|| message.clone()),
            )
        }
    };
    let changed_ready = set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::READY,
            status,
            reason,
            message: message.clone(),
            observed_generation: generation,
        },
        t,
    );
    let mut desired = Desired::new(new);
    if let Some(note) = pooler_note {
        desired = desired.with(note);
    }
    match (changed_ready, status) {
        (false, _) => desired,
        (true, ConditionStatus::True) => desired.with(Note::normal("Probe", reason, message)),
        (true, _) => desired.with(Note::warning("Probe", reason, message)),
    }
}

/// `status.pooler` and `PoolerReady` from the pooler's report (both gone without one),
/// with the Event to tell when `PoolerReady` changed.
pub fn pooler_condition(
    new: &mut DatabaseServerStatus,
    pooler: Option<&crate::pooler::Report>,
    generation: Option<i64>,
    t: Time,
) -> Option<Note> {
    use crate::pooler::Outcome;
    let Some(report) = pooler else {
        new.pooler = None;
        new.conditions
            .retain(|c| c.type_ != condition::POOLER_READY);
        return None;
    };
    new.pooler = Some(report.status.clone());
    let (status, reason, message) = match &report.outcome {
        Outcome::Running => (
            ConditionStatus::True,
            DatabaseServerReason::PoolerRunning,
            format!(
                "{} pooler Pods ready at {}:{}, {} databases, {} logins",
                report.status.ready_replicas,
                report.status.host,
                report.status.port,
                report.status.databases,
                report.status.logins
            ),
        ),
        Outcome::Starting(m) => (
            ConditionStatus::False,
            DatabaseServerReason::PoolerStarting,
            m.clone(),
        ),
        Outcome::NameTaken(m) => (
            ConditionStatus::False,
            DatabaseServerReason::PoolerNameTaken,
            m.clone(),
        ),
        Outcome::ConfigInvalid(m) => (
            ConditionStatus::False,
            DatabaseServerReason::PoolerConfigInvalid,
            m.clone(),
        ),
    };
    let changed = set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::POOLER_READY,
            status,
            reason: reason.as_str(),
            message: message.clone(),
            observed_generation: generation,
        },
        t,
    );
    match (changed, status) {
        (false, _) => None,
        (true, ConditionStatus::True) => Some(Note::normal("Pooler", reason.as_str(), message)),
        (true, _) if reason == DatabaseServerReason::PoolerStarting => {
            Some(Note::normal("Pooler", reason.as_str(), message))
        }
        (true, _) => Some(Note::warning("Pooler", reason.as_str(), message)),
    }
}
