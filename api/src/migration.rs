//! `Migration`: move a Database to another server as a resumable saga.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{LocalObjectReference, ServerReference};

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
    doc = "Moves a Database to another PostgreSQL server without losing a committed write: Preflight, Snapshot, FreezeSource, ProvisionTarget, CopyData, Verify, SwitchTraffic, Cleanup.",
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
        description = "Lifecycle phase"
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
    #[x_kube(validation = Rule::new("self == oldSelf").message("databaseRef is immutable"))]
    pub database_ref: LocalObjectReference,

    /// Where the Database goes. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("target is immutable"))]
    pub target: MigrationTarget,

    /// Automatic switches traffic after Verify; Manual waits in AwaitingApproval until
    /// `approved` is true.
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

/// When traffic is switched.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Cutover {
    /// Switch as soon as Verify succeeds.
    #[default]
    Automatic,
    /// Wait for `spec.approved: true` after Verify.
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

/// A step of the migration saga, in order.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum MigrationStep {
    Preflight,
    Snapshot,
    FreezeSource,
    ProvisionTarget,
    CopyData,
    Verify,
    SwitchTraffic,
    Cleanup,
}

impl MigrationStep {
    /// Every step in saga order.
    pub const ALL: [MigrationStep; 8] = [
        MigrationStep::Preflight,
        MigrationStep::Snapshot,
        MigrationStep::FreezeSource,
        MigrationStep::ProvisionTarget,
        MigrationStep::CopyData,
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
