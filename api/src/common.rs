//! Types shared by the three kinds.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::patterns::{OBJECT_NAME_PATTERN, matches};

/// The pattern of PostgreSQL identifiers, also under its first path here.
pub use crate::patterns::IDENTIFIER_PATTERN;

/// The names of the conditions the controllers set, and of their common reasons.
pub mod condition {
    pub const READY: &str = "Ready";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
    pub const FAILED: &str = "Failed";
    pub const MIGRATION_IN_PROGRESS: &str = "MigrationInProgress";
    /// A DatabaseServer's pooler: its Pods serve (`spec.pooler`).
    pub const POOLER_READY: &str = "PoolerReady";
    /// A Backup's artifact restored and checked (`spec.verify`).
    pub const VERIFIED: &str = "Verified";
}

/// Labels and annotations the controllers put on the objects they create for each other
/// (the same consts as in [`crate::names`], which has them all).
pub mod marks {
    use crate::names::{annotation, label};

    /// [`annotation::DATABASE_UID`].
    pub const DATABASE_UID: &str = annotation::DATABASE_UID;
    /// [`label::FINAL_SNAPSHOT_OF`].
    pub const FINAL_SNAPSHOT_OF: &str = label::FINAL_SNAPSHOT_OF;
}

/// A reference to a cluster-scoped `DatabaseServer` by name.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, KubeSchema)]
pub struct ServerReference {
    /// Name of the DatabaseServer (cluster-scoped, written by the platform team).
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(matches(OBJECT_NAME_PATTERN)).message("name must be a valid DatabaseServer name (lower case DNS subdomain)"))]
    pub name: String,
}

/// The name of a Secret in a namespace the referring field names.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, KubeSchema)]
pub struct SecretReference {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(matches(OBJECT_NAME_PATTERN)).message("name must be a valid Secret name (lower case DNS subdomain)"))]
    pub name: String,
}

/// The Database a Backup, Migration or DatabaseUser is about, in the same namespace: an
/// object reference that cannot change once set (`databaseRef is immutable`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, KubeSchema)]
#[x_kube(validation = Rule::new("self == oldSelf").message("databaseRef is immutable"))]
pub struct DatabaseRef {
    /// The reference (`name`), as any other in the same namespace.
    #[serde(flatten)]
    pub reference: LocalObjectReference,
}

impl DatabaseRef {
    /// A reference to the Database `name`.
    pub fn to(name: impl Into<String>) -> Self {
        Self {
            reference: LocalObjectReference { name: name.into() },
        }
    }
}

impl std::ops::Deref for DatabaseRef {
    type Target = LocalObjectReference;
    fn deref(&self) -> &LocalObjectReference {
        &self.reference
    }
}

/// The name of an object of a known kind in the referring object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, KubeSchema)]
pub struct LocalObjectReference {
    /// Name of the object, in the same namespace as the referring object.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(matches(OBJECT_NAME_PATTERN)).message("name must be a valid object name (lower case DNS subdomain)"))]
    pub name: String,
}

/// TLS to a PostgreSQL server, with libpq's `sslmode` meanings.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// Plain TCP only: passwords and data cross the network readable.
    Disable,
    /// TLS always, without verifying the server's certificate.
    Require,
    /// TLS always; the certificate must chain to a trusted root (any host name).
    VerifyCa,
    /// TLS always; the certificate must chain to a trusted root and name the host.
    #[default]
    VerifyFull,
}

impl TlsMode {
    /// The value libpq and connection URIs use (`sslmode`).
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Disable => "disable",
            TlsMode::Require => "require",
            TlsMode::VerifyCa => "verify-ca",
            TlsMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the server's certificate is checked against trusted roots.
    pub fn verifies(self) -> bool {
        matches!(self, TlsMode::VerifyCa | TlsMode::VerifyFull)
    }
}

/// What deleting a Database does inside PostgreSQL.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DatabaseDeletionPolicy {
    /// Leave the database and its role in PostgreSQL.
    #[default]
    Retain,
    /// Terminate sessions, then drop the database and its role.
    Delete,
    /// Take a final Backup, and drop the database and role once it is Ready.
    Snapshot,
}

/// What deleting a Backup does to its artifact in the backup store.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum BackupDeletionPolicy {
    /// Keep the artifact and its manifest in the store.
    #[default]
    Retain,
    /// Delete the artifact and its manifest from the store.
    Delete,
}
