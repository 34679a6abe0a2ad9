//! `Database`: a PostgreSQL database and its owner role on a server.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::access::{LoginOptions, RotationStatus};
use crate::common::{DatabaseDeletionPolicy, LocalObjectReference, ServerReference};
use crate::patterns::{
    CRON_PATTERN, EXTENSION_NAME_PATTERN, IDENTIFIER_PATTERN, all_match, matches, value_matches,
};

/// Desired state of a Database.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "dbops.dev",
    version = "v1alpha1",
    kind = "Database",
    namespaced,
    status = "DatabaseStatus",
    derive = "PartialEq",
    shortname = "pgdb",
    category = "dbops",
    doc = "A PostgreSQL database and its owner role on a server, with a connection Secret `<name>-connection` for applications.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase", description = "Lifecycle phase"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status", description = "Ready condition"),
    printcolumn(name = "Server", type_ = "string", json_path = ".spec.serverRef.name", description = "DatabaseServer"),
    printcolumn(name = "Database", type_ = "string", json_path = ".status.databaseName", description = "Database name in PostgreSQL"),
    printcolumn(name = "Expires", type_ = "string", json_path = ".status.expiresAt", description = "When the Database is deleted (spec.expireAfter or spec.expiresAt), RFC 3339 in UTC"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new(format!("has(self.spec.databaseName) || {}", value_matches("self.metadata.name", EXTENSION_NAME_PATTERN))).message("spec.databaseName is required when metadata.name (with '-' read as '_') is not a PostgreSQL identifier of at most 63 characters").field_path(".spec.databaseName"),
    validation = Rule::new("!has(self.spec.cloneFrom) || !has(self.spec.cloneFrom.databaseRef) || self.spec.cloneFrom.databaseRef.name != self.metadata.name").message("cloneFrom.databaseRef names this Database itself").field_path(".spec.cloneFrom.databaseRef.name"),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.databaseName) == has(oldSelf.databaseName) && (!has(self.databaseName) || self.databaseName == oldSelf.databaseName)").message("databaseName is immutable").field_path(".databaseName"),
    validation = Rule::new("has(self.owner) == has(oldSelf.owner) && (!has(self.owner) || self.owner == oldSelf.owner)").message("owner is immutable").field_path(".owner"),
    validation = Rule::new("!has(self.restoreFrom) || (has(oldSelf.restoreFrom) && self.restoreFrom == oldSelf.restoreFrom)").message("restoreFrom can only be set when the Database is created").field_path(".restoreFrom"),
)]
#[x_kube(validation = Rule::new("!(has(self.expireAfter) && has(self.expiresAt))").message("set expireAfter or expiresAt, not both").field_path(".expiresAt"))]
#[x_kube(
    validation = Rule::new("!has(self.cloneFrom) || (has(oldSelf.cloneFrom) && self.cloneFrom == oldSelf.cloneFrom)").message("cloneFrom can only be set when the Database is created").field_path(".cloneFrom"),
    validation = Rule::new("!(has(self.cloneFrom) && has(self.restoreFrom))").message("set cloneFrom or restoreFrom, not both").field_path(".cloneFrom"),
)]
pub struct DatabaseSpec {
    /// The DatabaseServer that holds the database. It must allow this namespace. A
    /// Migration changes it at cutover.
    pub server_ref: ServerReference,

    /// Name of the database in PostgreSQL. Defaults to metadata.name with `-` replaced by
    /// `_`. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new(matches(IDENTIFIER_PATTERN)).message("databaseName must be a PostgreSQL identifier: 1 to 63 characters of a-z, 0-9 and _, not starting with a digit"))]
    pub database_name: Option<String>,

    /// Role created for this database and owning it. Defaults to the database name.
    /// Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(
        validation = Rule::new(matches(IDENTIFIER_PATTERN)).message("owner must be a PostgreSQL identifier: 1 to 63 characters of a-z, 0-9 and _, not starting with a digit"),
        validation = Rule::new("!self.startsWith('pg_')").message("owner must not start with pg_ (reserved by PostgreSQL)"),
    )]
    pub owner: Option<String>,

    /// Extensions to create in the database (`CREATE EXTENSION IF NOT EXISTS`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 63)), extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new(all_match(EXTENSION_NAME_PATTERN)).message("every extension must be an extension name: 1 to 63 characters of a-z, 0-9, _ and -"))]
    pub extensions: Vec<String>,

    /// Maximum concurrent connections to the database; -1 means no limit of its own (the
    /// DatabaseServer's `limits.connectionLimit` still applies).
    #[serde(default = "default_connection_limit")]
    #[schemars(range(min = -1))]
    pub connection_limit: i32,

    /// The owner's session settings, password rotation and extra Secret keys.
    #[serde(flatten)]
    pub login: LoginOptions,

    /// What deleting the Database does in PostgreSQL: Retain (default) leaves the database,
    /// Delete drops it and its role, Snapshot takes a final Backup and then drops.
    #[serde(default)]
    pub deletion_policy: DatabaseDeletionPolicy,

    /// Scheduled backups of this database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<BackupSchedule>,

    /// Create the database from a Backup's artifact. Only allowed when the Database is
    /// created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<RestoreSource>,

    /// Create the database as a copy of a live Database of this namespace (`databaseRef`:
    /// consistent at one instant, the source staying writable) or of a completed Backup
    /// (`backupRef`, as `restoreFrom`), with the columns of `mask` replaced in the copy.
    /// Only allowed when the Database is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_from: Option<CloneSource>,

    /// Delete the Database (with its own `deletionPolicy`) this long after it was created,
    /// for example `72h` or `90m` (units `s`, `m`, `h`); a Warning Event says so a tenth
    /// of its life before, at most an hour. Changing it extends or shortens the life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]{1,9}(s|m|h))+$')").message("expireAfter must be a duration such as 72h, 90m or 1h30m (units s, m, h)"))]
    pub expire_after: Option<String>,

    /// Delete the Database (with its own `deletionPolicy`) at this time (RFC 3339); the
    /// same as `expireAfter`, as an instant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

fn default_connection_limit() -> i32 {
    -1
}

/// Scheduled backups.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupSchedule {
    /// Standard five-field cron expression (minute hour day-of-month month day-of-week),
    /// in UTC, or one of @hourly, @daily, @midnight, @weekly, @monthly, @yearly, @annually.
    #[schemars(length(min = 1, max = 128))]
    #[x_kube(validation = Rule::new(matches(CRON_PATTERN)).message("schedule must be a five-field cron expression with each number in its field's range (minute 0-59, hour 0-23, day of month 1-31, month 1-12, day of week 0-7) such as \"0 3 * * *\", or a macro such as @daily"))]
    pub schedule: String,

    /// How many scheduled Backups to keep (pruned only while the Database exists).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Retention>,

    /// What deleting the Database does to its scheduled Backups: Retain (default) keeps
    /// them and their artifacts, the copies needed to recover from a mistaken delete;
    /// Delete deletes them (and their artifacts) with the Database.
    #[serde(default)]
    pub on_database_deletion: ScheduledBackupsOnDeletion,

    /// Verify each scheduled Backup (its `spec.verify`): restored on the
    /// backup-controller's verification server and checked against what its dump saw.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verify: bool,
}

/// What happens to a Database's scheduled Backups when the Database is deleted.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ScheduledBackupsOnDeletion {
    /// Keep the scheduled Backups and their artifacts; retention stops with the Database.
    #[default]
    Retain,
    /// Delete the scheduled Backups and their artifacts with the Database.
    Delete,
}

/// Retention of scheduled Backups.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// Keep this many of the newest completed scheduled Backups; older ones are deleted.
    #[schemars(range(min = 1, max = 10000))]
    pub keep_last: i32,
}

/// Where a restored Database takes its data from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestoreSource {
    /// A completed Backup in the same namespace.
    pub backup_ref: LocalObjectReference,
}

/// Where a cloned Database takes its data from, and what it masks.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.databaseRef) != has(self.backupRef)").message("cloneFrom names exactly one of databaseRef and backupRef"),
)]
pub struct CloneSource {
    /// A Ready Database in the same namespace, on any server (the copy's server must be of
    /// its major version or newer). It stays writable while it is copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_ref: Option<LocalObjectReference>,

    /// A completed Backup in the same namespace (what `restoreFrom` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_ref: Option<LocalObjectReference>,

    /// Columns whose values are replaced on the way into the copy: the original values
    /// never reach the copy's server. A table or column that does not exist in the source,
    /// or a value the column cannot hold, stops the clone before anything is copied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["table", "column"]))]
    pub mask: Vec<MaskRule>,
}

/// One masked column.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(self.with == 'fixed') == has(self.value)").message("value is given with `with: fixed`, and only then").field_path(".value"))]
pub struct MaskRule {
    /// `schema.table` as PostgreSQL names it (case matters, no quotes), for example
    /// `public.customers`. A partitioned table's partitions are masked with it.
    #[schemars(length(min = 3, max = 127))]
    #[x_kube(validation = Rule::new("self.matches('^[^.]{1,63}[.][^.]{1,63}$')").message("table must be schema.table, for example public.customers"))]
    pub table: String,

    /// The column's name as PostgreSQL names it (case matters, no quotes).
    #[schemars(length(min = 1, max = 63))]
    pub column: String,

    /// `hash`: a keyed hash (HMAC-SHA-256, a key of this clone's own that is never
    /// stored), so equal values stay equal and joins on the column still match (text
    /// columns get hex, cut to a `varchar(n)`'s length; integer columns a number of their
    /// range; uuid columns a uuid); `nullify`: NULL (the column must allow it); `fixed`:
    /// `value` in every row.
    pub with: MaskWith,

    /// The value of every row, with `with: fixed`, as PostgreSQL reads it for the
    /// column's type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub value: Option<String>,
}

/// How a masked column's values are replaced.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MaskWith {
    /// A keyed hash that keeps equal values equal.
    Hash,
    /// NULL.
    Nullify,
    /// A fixed value (`value`).
    Fixed,
}

/// What a clone copied, from where and as of when; progress while it runs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloneStatus {
    /// The source: `Database <name>` (with its server) or `Backup <name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,

    /// The instant the copy is consistent at: the source's snapshot (a Database), or the
    /// Backup's completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,

    /// When the copy began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// When the copy ended (committed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,

    /// Tables whose rows were copied so far, of `tablesTotal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables: Option<i32>,
    /// The tables of the source whose rows are copied (the tenant's, not an extension's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables_total: Option<i32>,

    /// Bytes of the dump copied so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<i64>,

    /// Values replaced by `mask`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masked_values: Option<i64>,
}

/// Observed state of a Database.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Lifecycle phase, a summary of the conditions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<DatabasePhase>,

    /// Ready, Progressing, Degraded and MigrationInProgress.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// The DatabaseServer the database was provisioned on: a Database already on its
    /// server keeps being served when its namespace stops matching the server's
    /// `allowedNamespaces` (new ones are refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,

    /// Identity of the database in PostgreSQL: `<host>:<port>/<database OID>`.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id: Option<String>,

    /// The database name in PostgreSQL (spec.databaseName or its default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_name: Option<String>,

    /// `host:port` applications connect to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,

    /// Name of the Secret with the connection details.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_secret: Option<String>,

    /// `server_version` reported by PostgreSQL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,

    /// The database's size on disk (`pg_database_size`) at the last full check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,

    /// The login the connection Secret names: the owner role, or after a password
    /// rotation one of its two logins (`<owner>-1`, `<owner>-2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub login: Option<String>,

    /// The login before the last rotation, while it still works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_login: Option<String>,

    /// The end of the previous login, the last rotation and the last `dbops.dev/rotate`
    /// acted on.
    #[serde(flatten)]
    pub rotation: RotationStatus,

    /// When the Database is deleted (`spec.expireAfter` from its creation, or
    /// `spec.expiresAt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,

    /// A clone's source, instant and progress (`spec.cloneFrom`).
    #[serde(default, rename = "clone", skip_serializing_if = "Option::is_none")]
    pub clone_status: Option<CloneStatus>,
}

impl Database {
    /// The Backup whose artifact fills the new database: `restoreFrom`, or
    /// `cloneFrom.backupRef`.
    pub fn backup_to_restore(&self) -> Option<&str> {
        let clone = self.spec.clone_from.as_ref();
        self.spec
            .restore_from
            .as_ref()
            .map(|r| r.backup_ref.name.as_str())
            .or_else(|| clone?.backup_ref.as_ref().map(|r| r.name.as_str()))
    }

    /// The live Database of the same namespace the new database is copied from
    /// (`cloneFrom.databaseRef`).
    pub fn database_to_clone(&self) -> Option<&str> {
        let clone = self.spec.clone_from.as_ref()?;
        clone.database_ref.as_ref().map(|r| r.name.as_str())
    }

    /// Whether the new database is filled at creation (`restoreFrom` or `cloneFrom`).
    pub fn filled_at_creation(&self) -> bool {
        self.spec.restore_from.is_some() || self.spec.clone_from.is_some()
    }

    /// The columns a clone masks.
    pub fn mask(&self) -> &[MaskRule] {
        self.spec
            .clone_from
            .as_ref()
            .map(|c| c.mask.as_slice())
            .unwrap_or_default()
    }

    /// When the Database expires (`spec.expiresAt`, or `spec.expireAfter` after its
    /// creation), if it does; `Err` names a duration the CRD's pattern let through but
    /// that does not fit.
    pub fn expires_at(&self) -> Result<Option<k8s_openapi::jiff::Timestamp>, String> {
        if let Some(at) = &self.spec.expires_at {
            return Ok(Some(at.0));
        }
        let Some(after) = &self.spec.expire_after else {
            return Ok(None);
        };
        let Some(created) = &self.metadata.creation_timestamp else {
            return Ok(None);
        };
        let seconds = duration_seconds(after).ok_or_else(|| {
            format!("spec.expireAfter {after:?} is not a duration such as 72h, 90m or 1h30m")
        })?;
        let after = k8s_openapi::jiff::SignedDuration::from_secs(seconds);
        created
            .0
            .checked_add(after)
            .map(Some)
            .map_err(|_| "spec.expireAfter is too long".to_string())
    }
}

/// Seconds of a duration written as `<integer><unit>` parts, units `s`, `m`, `h`.
fn duration_seconds(text: &str) -> Option<i64> {
    let mut total: i64 = 0;
    let mut number = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            _ => return None,
        };
        let n: i64 = number.parse().ok()?;
        total = total.checked_add(n.checked_mul(unit)?)?;
        number.clear();
    }
    (number.is_empty() && total > 0).then_some(total)
}

/// Lifecycle phase of a Database.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum DatabasePhase {
    /// Accepted, not yet worked on.
    Pending,
    /// The role, database, extensions or Secret are being created.
    Provisioning,
    /// Data is being restored from a Backup.
    Restoring,
    /// The database exists and the connection Secret is current.
    Ready,
    /// The database existed but something is wrong (server unreachable, database missing).
    Degraded,
    /// Provisioning cannot proceed until the spec or its references change.
    Failed,
    /// Deletion is in progress.
    Deleting,
}

impl Database {
    /// The database name in PostgreSQL: spec.databaseName, or metadata.name with `-` read
    /// as `_`.
    pub fn database_name(&self) -> String {
        match &self.spec.database_name {
            Some(name) => name.clone(),
            None => self
                .metadata
                .name
                .as_deref()
                .unwrap_or_default()
                .replace('-', "_"),
        }
    }

    /// The owner role: spec.owner, or the database name.
    pub fn owner_role(&self) -> String {
        self.spec
            .owner
            .clone()
            .unwrap_or_else(|| self.database_name())
    }

    /// Name of the connection Secret this Database owns.
    pub fn connection_secret_name(&self) -> String {
        format!(
            "{}-connection",
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }
}

#[cfg(test)]
mod expiry_tests {
    use super::duration_seconds;

    #[test]
    fn expiry_durations_read_as_the_pattern_allows() {
        assert_eq!(duration_seconds("72h"), Some(72 * 3600));
        assert_eq!(duration_seconds("1h30m"), Some(5400));
        assert_eq!(duration_seconds("45s"), Some(45));
        assert_eq!(duration_seconds("0s"), None);
        assert_eq!(duration_seconds("3d"), None);
        assert_eq!(duration_seconds("12"), None);
        assert_eq!(
            duration_seconds("999999999h999999999h"),
            Some(2 * 999_999_999 * 3600)
        );
    }
}
