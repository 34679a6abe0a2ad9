//! `DatabaseUser`: one more login to a Database, read-only or read-write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::access::{LoginOptions, RotationStatus};
use crate::common::DatabaseRef;
use crate::patterns::{IDENTIFIER_PATTERN, value_matches};

/// Desired state of a DatabaseUser.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "dbops.dev",
    version = "v1alpha1",
    kind = "DatabaseUser",
    namespaced,
    status = "DatabaseUserStatus",
    derive = "PartialEq",
    shortname = "dbuser",
    category = "dbops",
    doc = "One more login to a Database in the same namespace (ReadOnly or ReadWrite), with its own connection Secret `<name>-connection`, limits and password rotation. It follows its Database through a Migration.",
    printcolumn(
        name = "Database",
        type_ = "string",
        json_path = ".spec.databaseRef.name",
        description = "The Database"
    ),
    printcolumn(
        name = "Access",
        type_ = "string",
        json_path = ".spec.access",
        description = "ReadOnly or ReadWrite"
    ),
    printcolumn(
        name = "Role",
        type_ = "string",
        json_path = ".status.role",
        description = "The login role in the connection Secret"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "Ready condition"
    ),
    printcolumn(
        name = "Rotated",
        type_ = "date",
        json_path = ".status.lastRotation",
        description = "When the password last changed"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseUserSpec {
    /// The Database, in the same namespace. Immutable.
    pub database_ref: DatabaseRef,

    /// ReadOnly (default): SELECT on tables, views and sequences. ReadWrite: also INSERT,
    /// UPDATE, DELETE and TRUNCATE on tables and USAGE of sequences; never DDL. Both hold
    /// for objects the Database's owner creates later.
    #[serde(default)]
    pub access: Access,

    /// The schemas the access covers; empty (default): every schema of the database but
    /// PostgreSQL's own, including schemas the owner creates later.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 63)), extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new(format!("self.all(s, {} && !s.startsWith('pg_') && s != 'information_schema')", value_matches("s", IDENTIFIER_PATTERN))).message("every schema must be a PostgreSQL identifier (1 to 63 characters of a-z, 0-9 and _, not starting with a digit), not pg_* nor information_schema"))]
    pub schemas: Vec<String>,

    /// Maximum concurrent connections of this user; -1 means no limit of its own (the
    /// DatabaseServer's `limits.connectionLimit` still applies).
    #[serde(default = "default_connection_limit")]
    #[schemars(range(min = -1))]
    pub connection_limit: i32,

    /// This user's session settings, password rotation and extra Secret keys.
    #[serde(flatten)]
    pub login: LoginOptions,
}

fn default_connection_limit() -> i32 {
    -1
}

/// What a DatabaseUser may do in its Database.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Access {
    /// Read tables, views and sequences.
    #[default]
    ReadOnly,
    /// Read and write rows (INSERT, UPDATE, DELETE, TRUNCATE) and use sequences; no DDL.
    ReadWrite,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::ReadOnly => "ReadOnly",
            Access::ReadWrite => "ReadWrite",
        }
    }
}

/// Observed state of a DatabaseUser.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseUserStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Ready: the role, its privileges and the connection Secret are current.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// The role that holds the privileges (NOLOGIN); the logins are its members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_role: Option<String>,

    /// The login role the connection Secret names now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,

    /// The login role before the last rotation, while it still works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_role: Option<String>,

    /// The end of the previous login, the last rotation and the last `dbops.dev/rotate`
    /// acted on.
    #[serde(flatten)]
    pub rotation: RotationStatus,

    /// The DatabaseServer the user is on (its Database's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,

    /// The DatabaseServer the user was on before its Database moved, while its roles
    /// there are not dropped yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub former_server: Option<String>,

    /// Name of the Secret with the connection details.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_secret: Option<String>,
}

impl DatabaseUser {
    /// Name of the connection Secret this DatabaseUser owns.
    pub fn connection_secret_name(&self) -> String {
        format!(
            "{}-connection",
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }
}
