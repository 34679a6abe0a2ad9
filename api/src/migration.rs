//! `Migration`: move a Database to another server as a resumable saga.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{DatabaseRef, LocalObjectReference, ServerReference};

/// Desired state of a Migration.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "dbops.dev",
    version = "v1alpha1",
    kind = "Migration",
    namespaced,
    status = "MigrationStatus",
    derive = "PartialEq",
    shortname = "pgmig",
    category = "dbops",
    doc = "Moves a Database to another PostgreSQL server without losing a committed write. Dump mode: Preflight, Snapshot, FreezeSource, ProvisionTarget, CopyData, Verify, SwitchTraffic, Cleanup. Logical mode: Preflight, Snapshot, ProvisionTarget, Replicate, FreezeSource, CatchUp, Verify, SwitchTraffic, Cleanup.",
    printcolumn(
        name = "Database",
        type_ = "string",
        json_path = ".spec.databaseRef.name",
        description = "The Database moved"
    ),
    printcolumn(
        name = "Target",
        type_ = "string",
        json_path = ".spec.target.serverRef.name",
        description = "Target DatabaseServer"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Pending, Running, AwaitingApproval, Succeeded, Failed, RollingBack or RolledBack"
    ),
    printcolumn(
        name = "Mode",
        type_ = "string",
        json_path = ".status.mode",
        description = "The mode chosen at Preflight: Logical or Dump"
    ),
    printcolumn(
        name = "Step",
        type_ = "string",
        json_path = ".status.currentStep",
        description = "Current step"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MigrationSpec {
    /// The Database to move, in the same namespace. Immutable.
    pub database_ref: DatabaseRef,

    /// Where the Database goes. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("target is immutable"))]
    pub target: MigrationTarget,

    /// How the data moves: Auto (default: Logical when the source allows it, else Dump,
    /// with the reason in status and an Event), Logical (replication while the source stays
    /// writable, then a freeze of seconds for the catch-up) or Dump (the source frozen for
    /// the whole dump and restore). Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("mode is immutable"))]
    pub mode: MigrationMode,

    /// Automatic switches traffic after Verify; Manual waits in AwaitingApproval until
    /// `approved` is true (Dump: after Verify, the source frozen; Logical: while
    /// replicating, before the freeze, the source writable).
    #[serde(default)]
    pub cutover: Cutover,

    /// With `cutover: Manual`, set to true to let the Migration switch traffic.
    #[serde(default)]
    pub approved: bool,

    /// What happens to the source database after cutover: Keep (frozen, read-only) or Drop.
    #[serde(default)]
    pub source_retention: SourceRetention,
}

/// The target of a Migration.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationTarget {
    /// The DatabaseServer the Database moves to; it must allow the Migration's namespace.
    pub server_ref: ServerReference,
}

/// How a Migration moves the data.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum MigrationMode {
    /// Logical when the Preflight finds it possible, otherwise Dump (saying why).
    #[default]
    Auto,
    /// Logical replication: the source stays writable until a short freeze for the
    /// final catch-up. Refused at Preflight when the source does not allow it.
    Logical,
    /// pg_dump and pg_restore with the source frozen for the whole copy.
    Dump,
}

/// The mode a Migration runs in, chosen once by Preflight.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ChosenMode {
    /// Logical replication (steps Replicate and CatchUp).
    Logical,
    /// Dump and restore (step CopyData).
    Dump,
}

impl ChosenMode {
    /// The saga's steps in this mode, in order.
    pub fn steps(self) -> &'static [MigrationStep] {
        match self {
            ChosenMode::Logical => &MigrationStep::LOGICAL,
            ChosenMode::Dump => &MigrationStep::DUMP,
        }
    }
}

/// When traffic is switched.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Cutover {
    /// Switch as soon as Verify succeeds.
    #[default]
    Automatic,
    /// Wait for `spec.approved: true`: after Verify in Dump mode, while replicating
    /// (before the freeze) in Logical mode.
    Manual,
}

/// The source database after cutover.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SourceRetention {
    /// Leave it frozen and read-only.
    #[default]
    Keep,
    /// Drop it and its role.
    Drop,
}

/// Observed state of a Migration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MigrationPhase>,

    /// The step being worked on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<MigrationStep>,

    /// The mode the Migration runs in (Logical or Dump), recorded once by Preflight and
    /// never changed afterwards; the reason is the ModeChosen condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ChosenMode>,

    /// Logical mode: the replication's progress, while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationStatus>,

    /// Every step with its state, times and message, in saga order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepStatus>,

    /// The Backup taken as the rollback point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_ref: Option<LocalObjectReference>,

    /// The step whose failure started the rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_step: Option<MigrationStep>,

    /// Ready, Progressing and Failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// The server the Database was on when the Migration started (recorded by Preflight):
    /// FreezeSource, its compensation and Cleanup act on it, whatever the Database says
    /// later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_server: Option<ServerReference>,

    /// The UID of the Database moved (recorded by Preflight): the ownership mark looked
    /// for on the source and written on the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_uid: Option<String>,

    /// The database and owner role names in PostgreSQL (recorded by Preflight): the
    /// compensations find them even when the Database object is already gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_name: Option<String>,

    /// See `databaseName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_role: Option<String>,

    /// What FreezeSource found before it changed anything, written before the change, so
    /// the compensation restores exactly that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze: Option<FreezeRecord>,

    /// True once ProvisionTarget is about to change the target server (written before its
    /// first statement there): until then a rollback has nothing to remove on the target.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub target_touched: bool,

    /// The Database's metadata.generation after SwitchTraffic patched spec.serverRef: the
    /// switch is complete when the Database is Ready at this generation or a later one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switched_generation: Option<i64>,

    /// The cutover through the source server's pooler (a DatabaseServer with
    /// `spec.pooler`), recorded by FreezeSource before it pauses the database there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooler: Option<PoolerCutover>,
}

/// A cutover through the source server's pooler: the pooler holds the database's new
/// transactions from FreezeSource on, routes it to the target once the Database is Ready
/// there, and lets them go; its clients see a wait, not an error.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolerCutover {
    /// The DatabaseServer whose pooler it is (the source).
    pub server: String,
    /// The database's route in the pooler.
    pub database: String,
    /// Whether the pooler holds the database's transactions during the cutover. False
    /// when it cannot serve the database on the target (`message` says why): its clients
    /// then see the switch as clients connected directly do.
    pub held: bool,
    /// The pooler instances (ready Pods) that paused the database.
    #[serde(default)]
    pub instances: i32,
    /// When the pooler began to hold the database's transactions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<Time>,
    /// When every instance let them go again (routed to the target, or back to the source
    /// after a rollback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_at: Option<Time>,
    /// What happened, or why the pooler does not hold the database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl PoolerCutover {
    /// Whether the pooler holds the database's transactions now: held, and not let go yet.
    pub fn holds(&self) -> bool {
        self.held && self.resumed_at.is_none()
    }
}

/// The progress of a Logical-mode Migration's replication.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicationStatus {
    /// Tables whose initial copy is done (subscription state ready or synchronized).
    pub tables_copied: i32,
    /// Tables replicated.
    pub tables_total: i32,
    /// Bytes of the source's WAL the target has not confirmed yet (absent until known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_bytes: Option<i64>,
    /// The size of the target database in bytes (the copy's progress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_bytes: Option<i64>,
    /// The source's WAL position right after the freeze: CatchUp waits until the target
    /// has applied everything up to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up_lsn: Option<String>,
    /// True once the target applied everything up to `catchUpLsn` and the sequences
    /// were copied.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub caught_up: bool,
    /// The OID of the subscription on the target (recorded before it is dropped): its
    /// table-synchronization slots on the source are named after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_oid: Option<i64>,
}

/// The source database's settings before FreezeSource changed them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct FreezeRecord {
    /// The database's connection limit before the freeze (-1: none).
    pub previous_connection_limit: i32,
    /// The database-level `default_transaction_read_only` setting before the freeze;
    /// absent when the database had none (the compensation then resets it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_read_only: Option<String>,
    /// The roles whose CONNECT privilege on the database the freeze revoked (`PUBLIC` for
    /// everyone), given back by the compensation. Present when the source's admin is not
    /// a superuser, whom a connection limit of 0 would shut out as well: the freeze then
    /// closes the database by its privileges and leaves the limit alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_to: Option<Vec<String>>,
}

/// Lifecycle phase of a Migration.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum MigrationPhase {
    Pending,
    Running,
    AwaitingApproval,
    Succeeded,
    Failed,
    RollingBack,
    RolledBack,
}

impl MigrationPhase {
    /// Whether the Migration has ended: Succeeded, Failed or RolledBack.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::RolledBack)
    }
}

/// A step of the migration saga. The order of the steps depends on the mode
/// ([`MigrationStep::DUMP`], [`MigrationStep::LOGICAL`]).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum MigrationStep {
    Preflight,
    Snapshot,
    FreezeSource,
    ProvisionTarget,
    CopyData,
    /// Logical mode: schema, publication, replication role and subscription; waits for
    /// the initial copy and a small lag.
    Replicate,
    /// Logical mode, after the freeze: the target applies everything up to the source's
    /// WAL position, sequences are copied, the replication is taken down.
    CatchUp,
    Verify,
    SwitchTraffic,
    Cleanup,
}

impl MigrationStep {
    /// Every step (of either mode).
    pub const ALL: [MigrationStep; 10] = [
        MigrationStep::Preflight,
        MigrationStep::Snapshot,
        MigrationStep::FreezeSource,
        MigrationStep::ProvisionTarget,
        MigrationStep::CopyData,
        MigrationStep::Replicate,
        MigrationStep::CatchUp,
        MigrationStep::Verify,
        MigrationStep::SwitchTraffic,
        MigrationStep::Cleanup,
    ];

    /// The Dump mode's steps in saga order.
    pub const DUMP: [MigrationStep; 8] = [
        MigrationStep::Preflight,
        MigrationStep::Snapshot,
        MigrationStep::FreezeSource,
        MigrationStep::ProvisionTarget,
        MigrationStep::CopyData,
        MigrationStep::Verify,
        MigrationStep::SwitchTraffic,
        MigrationStep::Cleanup,
    ];

    /// The Logical mode's steps in saga order.
    pub const LOGICAL: [MigrationStep; 9] = [
        MigrationStep::Preflight,
        MigrationStep::Snapshot,
        MigrationStep::ProvisionTarget,
        MigrationStep::Replicate,
        MigrationStep::FreezeSource,
        MigrationStep::CatchUp,
        MigrationStep::Verify,
        MigrationStep::SwitchTraffic,
        MigrationStep::Cleanup,
    ];

    /// The step's name as it appears in status, Events and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            MigrationStep::Preflight => "Preflight",
            MigrationStep::Snapshot => "Snapshot",
            MigrationStep::FreezeSource => "FreezeSource",
            MigrationStep::ProvisionTarget => "ProvisionTarget",
            MigrationStep::CopyData => "CopyData",
            MigrationStep::Replicate => "Replicate",
            MigrationStep::CatchUp => "CatchUp",
            MigrationStep::Verify => "Verify",
            MigrationStep::SwitchTraffic => "SwitchTraffic",
            MigrationStep::Cleanup => "Cleanup",
        }
    }
}

/// The state of one step.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepStatus {
    /// The step.
    pub name: MigrationStep,
    /// Pending, Running, Succeeded, Failed or Compensated.
    pub state: StepState,
    /// When the step started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the step finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// What the step did, or why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Attempts that ended in a retryable error; the step is rolled back once they reach
    /// the controller's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_attempts: Option<i32>,
}

/// The state of a step.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum StepState {
    Pending,
    Running,
    Succeeded,
    Failed,
    /// Its effects were undone by the rollback.
    Compensated,
}
