//! `Backup`: one logical dump of a Database in the backup store.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{BackupDeletionPolicy, DatabaseRef};

/// Desired state of a Backup.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "dbops.dev",
    version = "v1alpha1",
    kind = "Backup",
    namespaced,
    status = "BackupStatus",
    derive = "PartialEq",
    shortname = "pgbackup",
    category = "dbops",
    doc = "One logical dump (pg_dump custom format) of a Database, stored with a manifest and a SHA-256 checksum in the backup store.",
    printcolumn(
        name = "Database",
        type_ = "string",
        json_path = ".spec.databaseRef.name",
        description = "The Database backed up"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Pending, Running, Completed or Failed"
    ),
    printcolumn(
        name = "Size",
        type_ = "integer",
        json_path = ".status.sizeBytes",
        description = "Artifact size in bytes"
    ),
    printcolumn(
        name = "Verified",
        type_ = "string",
        json_path = ".status.verification.result",
        description = "Running, Passed, Failed or Error: the artifact restored and checked on the verification server"
    ),
    printcolumn(
        name = "Completed",
        type_ = "date",
        json_path = ".status.completedAt",
        description = "When the dump completed"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct BackupSpec {
    /// The Database to back up, in the same namespace. Immutable.
    pub database_ref: DatabaseRef,

    /// What deleting this Backup does to its artifact: Retain (default) keeps it, Delete
    /// removes the artifact and its manifest from the store.
    #[serde(default)]
    pub deletion_policy: BackupDeletionPolicy,

    /// How many times a transient failure (server or store unavailable) is retried before
    /// the Backup is Failed.
    #[serde(default = "default_max_retries")]
    #[schemars(range(min = 0, max = 100))]
    pub max_retries: i32,

    /// Verify the artifact once it is complete: restored into a scratch database on the
    /// backup-controller's `--verify-server` (never visible to the tenant, dropped
    /// afterwards) and checked against what the dump saw (row counts per table in the
    /// dump's snapshot, the schema's objects, the extensions). Setting it on a completed
    /// Backup verifies that Backup (once).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verify: bool,
}

fn default_max_retries() -> i32 {
    3
}

/// Observed state of a Backup.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<BackupPhase>,

    /// Ready, Progressing and Failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// When the current attempt started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,

    /// When the artifact and its manifest were complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,

    /// Attempts made so far, the current one included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<i32>,

    /// Size of the completed artifact in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,

    /// Bytes written so far by the running attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_bytes: Option<i64>,

    /// SHA-256 of the artifact, hex encoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,

    /// URL of the artifact in the backup store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,

    /// `server_version` of the PostgreSQL server the dump was taken from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,

    /// The metadata.uid of the Database that was dumped: which object of that name the
    /// artifact belongs to (a Database deleted and created again gets a new UID).
    #[serde(
        default,
        rename = "databaseUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub database_uid: Option<String>,

    /// How the artifact is encrypted, when it is (the store holds no plaintext of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<BackupEncryption>,

    /// The artifact's verification (`spec.verify`): restored on the verification server
    /// and checked against what the dump saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<BackupVerification>,

    /// The backup-controller replica running the current attempt, and when it last said
    /// it still is: another replica starts the attempt over only once this holder has
    /// stopped renewing (or is itself, restarted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<BackupRunner>,
}

/// Client-side encryption of a Backup's artifact.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupEncryption {
    /// The format: `age` (age-encryption.org/v1, X25519 recipients).
    pub format: String,
    /// The public keys (`age1…`) it was encrypted to: each one's identity opens it alone.
    #[serde(default)]
    pub recipients: Vec<String>,
}

/// A Backup's verification: its artifact restored into a scratch database and compared
/// with the inventory the dump took in its own snapshot.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupVerification {
    /// Running, Passed (it restored, with the same tables, rows, objects and extensions),
    /// Failed (it did not: the `Verified` condition says how) or Error (it could not be
    /// verified: no verification server, no key, too large, timed out).
    pub result: VerificationResult,
    /// When the verification started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_at: Option<Time>,
    /// The DatabaseServer it was restored on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// Tables compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables: Option<i64>,
    /// Rows in those tables, as restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<i64>,
    /// How long it took, for example `12.4s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    /// The replica running it, while it runs (another replica starts it over only once
    /// `--verify-timeout` has passed since `startedAt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<String>,
}

/// The outcome of a verification.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum VerificationResult {
    /// Restoring and checking.
    #[default]
    Running,
    /// Restored, with the same tables, rows, objects and extensions as the dump saw.
    Passed,
    /// The artifact did not restore, or not to what the dump saw.
    Failed,
    /// It could not be verified (says why); the artifact is not judged.
    Error,
}

impl VerificationResult {
    pub const fn as_str(self) -> &'static str {
        match self {
            VerificationResult::Running => "Running",
            VerificationResult::Passed => "Passed",
            VerificationResult::Failed => "Failed",
            VerificationResult::Error => "Error",
        }
    }
}

/// Who runs a Backup's attempt: a lease on the attempt, kept in the status.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupRunner {
    /// The replica's identity (`$POD_NAME`).
    pub identity: String,
    /// When the runner last renewed its hold on the attempt.
    pub renew_time: Time,
}

/// Lifecycle phase of a Backup.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum BackupPhase {
    /// Waiting for its Database or for a free dump slot.
    Pending,
    /// The dump is being written.
    Running,
    /// The artifact and its manifest are in the store.
    Completed,
    /// Retries are exhausted or the failure is permanent.
    Failed,
}
