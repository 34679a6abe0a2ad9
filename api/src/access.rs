//! What Databases and DatabaseUsers share about access: session settings tenants may ask
//! for (within the server's `sessionLimits`), password rotation, and the templates of
//! extra connection Secret keys.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::patterns::{matches, when_all_match, when_matches};

/// The patterns of durations and amounts of memory, also under their first path here.
pub use crate::patterns::{DURATION_PATTERN, MEMORY_PATTERN};

/// The annotation that rotates a Database's or DatabaseUser's password on demand: any
/// new value (for example a timestamp) starts one rotation.
pub const ROTATE_ANNOTATION: &str = crate::names::annotation::ROTATE;

/// Session settings of a login role, applied with `ALTER ROLE ... SET` so every new session
/// of the role starts with them. Each must stay within the DatabaseServer's
/// `sessionLimits.<field>.max`; one left out takes the server's `default`, if any. The API
/// server also refuses what PostgreSQL would: a timeout over `INT_MAX` milliseconds
/// (596h31m23s647ms), a `work_mem` under 64kB or over `INT_MAX` kB.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionSettings {
    /// `statement_timeout`: the longest a statement may run, e.g. `30s`; `0s` for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = Rule::new(matches(DURATION_PATTERN)).message("statementTimeout must be a duration such as 30s, 5m or 1h30m (at most 5 digits before h, 7 before m, 9 before s or ms)"),
        validation = Rule::new(when_matches(DURATION_PATTERN, "duration(self) <= duration('596h31m23s647ms')")).message("statementTimeout must be at most 596h31m23s647ms, PostgreSQL's limit (0s means none)"),
    )]
    pub statement_timeout: Option<String>,

    /// `idle_in_transaction_session_timeout`: how long a session may sit idle inside a
    /// transaction (holding its locks) before the server ends it, e.g. `5m`; `0s` for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = Rule::new(matches(DURATION_PATTERN)).message("idleInTransactionSessionTimeout must be a duration such as 30s, 5m or 1h30m (at most 5 digits before h, 7 before m, 9 before s or ms)"),
        validation = Rule::new(when_matches(DURATION_PATTERN, "duration(self) <= duration('596h31m23s647ms')")).message("idleInTransactionSessionTimeout must be at most 596h31m23s647ms, PostgreSQL's limit (0s means none)"),
    )]
    pub idle_in_transaction_session_timeout: Option<String>,

    /// `lock_timeout`: the longest a statement waits for a lock, e.g. `10s`; `0s` for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = Rule::new(matches(DURATION_PATTERN)).message("lockTimeout must be a duration such as 30s, 5m or 1h30m (at most 5 digits before h, 7 before m, 9 before s or ms)"),
        validation = Rule::new(when_matches(DURATION_PATTERN, "duration(self) <= duration('596h31m23s647ms')")).message("lockTimeout must be at most 596h31m23s647ms, PostgreSQL's limit (0s means none)"),
    )]
    pub lock_timeout: Option<String>,

    /// `work_mem`: memory per sort or hash operation, e.g. `16MB` (`kB`, `MB`, `GB`, `TB`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(
        validation = Rule::new(matches(MEMORY_PATTERN)).message("workMem must be an amount of memory such as 4MB or 1GB (kB, MB, GB, TB)"),
        validation = Rule::new(when_matches(MEMORY_PATTERN, "(int(self.find('^[0-9]+')) * (self.endsWith('kB') ? 1 : self.endsWith('MB') ? 1024 : self.endsWith('GB') ? 1048576 : 1073741824) >= 64 && int(self.find('^[0-9]+')) * (self.endsWith('kB') ? 1 : self.endsWith('MB') ? 1024 : self.endsWith('GB') ? 1048576 : 1073741824) <= 2147483647)")).message("workMem must be from 64kB to 2147483647kB (just under 2TB), PostgreSQL's limits"),
    )]
    pub work_mem: Option<String>,
}

/// A default and a ceiling of one duration setting.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(format!("!has(self.default) || !has(self.max) || {}", when_all_match(&["self.default", "self.max"], DURATION_PATTERN, "duration(self.max) == duration('0s') || (duration(self.default) != duration('0s') && duration(self.default) <= duration(self.max))"))).message("default must not exceed max").field_path(".default"))]
pub struct DurationLimit {
    /// Applied to every login role that does not ask for a value of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = Rule::new(matches(DURATION_PATTERN)).message("default must be a duration such as 30s, 5m or 1h30m (at most 5 digits before h, 7 before m, 9 before s or ms)"),
        validation = Rule::new(when_matches(DURATION_PATTERN, "duration(self) <= duration('596h31m23s647ms')")).message("default must be at most 596h31m23s647ms, PostgreSQL's limit (0s means none)"),
    )]
    pub default: Option<String>,

    /// The most a Database or DatabaseUser may ask for; `0s` sets no ceiling. Asking for
    /// `0s` (no timeout) is more than any other ceiling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new(matches(DURATION_PATTERN)).message("max must be a duration such as 30s, 5m or 1h30m (at most 5 digits before h, 7 before m, 9 before s or ms)"))]
    pub max: Option<String>,
}

/// A default and a ceiling of one memory setting.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(format!("!has(self.default) || !has(self.max) || {}", when_all_match(&["self.default", "self.max"], MEMORY_PATTERN, "int(self.default.find('^[0-9]+')) * (self.default.endsWith('kB') ? 1 : self.default.endsWith('MB') ? 1024 : self.default.endsWith('GB') ? 1048576 : 1073741824) <= int(self.max.find('^[0-9]+')) * (self.max.endsWith('kB') ? 1 : self.max.endsWith('MB') ? 1024 : self.max.endsWith('GB') ? 1048576 : 1073741824)"))).message("default must not exceed max").field_path(".default"))]
pub struct MemoryLimit {
    /// Applied to every login role that does not ask for a value of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(
        validation = Rule::new(matches(MEMORY_PATTERN)).message("default must be an amount of memory such as 4MB or 1GB (kB, MB, GB, TB)"),
        validation = Rule::new(when_matches(MEMORY_PATTERN, "(int(self.find('^[0-9]+')) * (self.endsWith('kB') ? 1 : self.endsWith('MB') ? 1024 : self.endsWith('GB') ? 1048576 : 1073741824) >= 64 && int(self.find('^[0-9]+')) * (self.endsWith('kB') ? 1 : self.endsWith('MB') ? 1024 : self.endsWith('GB') ? 1048576 : 1073741824) <= 2147483647)")).message("default must be from 64kB to 2147483647kB (just under 2TB), PostgreSQL's limits"),
    )]
    pub default: Option<String>,

    /// The most a Database or DatabaseUser may ask for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new(matches(MEMORY_PATTERN)).message("max must be an amount of memory such as 4MB or 1GB (kB, MB, GB, TB)"))]
    pub max: Option<String>,
}

/// The DatabaseServer's defaults and ceilings of the session settings tenants may ask for.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionLimits {
    /// `statement_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statement_timeout: Option<DurationLimit>,
    /// `idle_in_transaction_session_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_in_transaction_session_timeout: Option<DurationLimit>,
    /// `lock_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_timeout: Option<DurationLimit>,
    /// `work_mem`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_mem: Option<MemoryLimit>,
}

/// Password rotation without downtime: a new login (and password) every `every`, or on
/// demand with the annotation `dbops.dev/rotate`; the previous login keeps working for
/// `keepPrevious`, then can no longer log in and its sessions are ended.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(format!("!has(self.every) || {}", when_all_match(&["self.every", "self.keepPrevious"], DURATION_PATTERN, "duration(self.keepPrevious) < duration(self.every)"))).message("keepPrevious must be shorter than every").field_path(".keepPrevious"))]
pub struct PasswordRotation {
    /// How often to rotate (at least `1m`), e.g. `720h`; absent: only on demand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = Rule::new(matches(DURATION_PATTERN)).message("every must be a duration such as 720h or 24h (at most 5 digits before h, 7 before m, 9 before s or ms)"),
        validation = Rule::new(when_matches(DURATION_PATTERN, "duration(self) >= duration('1m')")).message("every must be at least 1m"),
    )]
    pub every: Option<String>,

    /// How long the previous login keeps working after a rotation (default `1h`), for
    /// applications to pick up the new Secret; `0s` ends it at once.
    #[serde(default = "default_keep_previous")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new(matches(DURATION_PATTERN)).message("keepPrevious must be a duration such as 24h or 15m (at most 5 digits before h, 7 before m, 9 before s or ms)"))]
    pub keep_previous: String,
}

fn default_keep_previous() -> String {
    "1h".to_string()
}

/// What the last rotation left, in the status of a Database (its owner's logins) and of a
/// DatabaseUser: flattened into both, so the fields are `status.previousValidUntil`,
/// `status.lastRotation` and `status.rotateRequest` of each.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RotationStatus {
    /// Until when the login before the last rotation (`previousLogin` of a Database,
    /// `previousRole` of a DatabaseUser) may log in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_valid_until: Option<Time>,

    /// When the password last changed (the login was created or rotated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rotation: Option<Time>,

    /// The value of the annotation `dbops.dev/rotate` last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotate_request: Option<String>,
}

/// Extra keys of a connection Secret, each rendered from a template over `host`, `port`,
/// `database`, `user`, `password`, `sslmode` and `ca`, and the server's pooler's
/// `pooler_host`, `pooler_port` and `pooler_ca` (empty, 0 and empty without a pooler), e.g.
/// `DATABASE_URL: "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}"`.
/// In a template that is a URL (it begins with `scheme://`) every value is percent-encoded.
/// A template that does not render is refused (`InvalidSecretTemplate`) before anything
/// is written.
pub type SecretTemplate = BTreeMap<String, String>;

/// How the logins of a Database's owner or of a DatabaseUser behave, and what their
/// connection Secret holds besides its own keys: flattened into both specs, so the fields
/// are `spec.settings`, `spec.passwordRotation` and `spec.secretTemplate` of each.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoginOptions {
    /// Session settings of the logins (a Database's owner's, or a DatabaseUser's), within
    /// the DatabaseServer's `sessionLimits`; those left out take the server's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<SessionSettings>,

    /// Rotation of the password without downtime (a Database's owner's, or a
    /// DatabaseUser's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_rotation: Option<PasswordRotation>,

    /// Extra keys of the connection Secret, rendered from templates.
    #[serde(default, skip_serializing_if = "SecretTemplate::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.all(k, k.matches('^[-._a-zA-Z0-9]{1,253}$'))").message("every secretTemplate key must be a Secret key: 1 to 253 characters of a-z, A-Z, 0-9, -, _ and ."))]
    pub secret_template: SecretTemplate,

    /// Where the application mounts this connection Secret as a volume, an absolute path
    /// such as `/etc/dbops/orders`. When it is set and the server has a CA of its own,
    /// `uri`, `jdbc-url` (and `pooler-uri`, `pooler-jdbc-url`) name the CA file there
    /// (`sslrootcert=<path>/ca.crt`), the Secret gets `PGSSLROOTCERT`, and templates get
    /// `ca_file`: libpq, psycopg, pgx, node-postgres and pgjdbc then verify the server with
    /// the Secret as it is. Unset: the application points `PGSSLROOTCERT` (or its driver's
    /// option) at the mounted `ca.crt` itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 200))]
    #[x_kube(
        validation = Rule::new("self.matches('^(/[-_a-zA-Z0-9][-_.a-zA-Z0-9]*)+$')").message("secretMountPath must be an absolute path such as /etc/dbops/orders: segments of letters, digits, '-', '_' and '.' that do not begin with '.', no trailing '/'"),
    )]
    pub secret_mount_path: Option<String>,
}

/// Parses a duration of [`DURATION_PATTERN`] (the API server has checked the form).
pub fn parse_duration(text: &str) -> Option<std::time::Duration> {
    let mut total = std::time::Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let (unit, len) = if rest.starts_with("ms") {
            (std::time::Duration::from_millis(1), 2)
        } else if rest.starts_with('s') {
            (std::time::Duration::from_secs(1), 1)
        } else if rest.starts_with('m') {
            (std::time::Duration::from_secs(60), 1)
        } else if rest.starts_with('h') {
            (std::time::Duration::from_secs(3600), 1)
        } else {
            return None;
        };
        total = total.checked_add(unit.checked_mul(u32::try_from(n).ok()?)?)?;
        rest = &rest[len..];
    }
    (!text.is_empty()).then_some(total)
}

/// Parses an amount of memory of [`MEMORY_PATTERN`], in kB (PostgreSQL's units: 1 MB is
/// 1024 kB).
pub fn parse_memory_kb(text: &str) -> Option<u64> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let n: u64 = text.get(..digits)?.parse().ok()?;
    let factor = match &text[digits..] {
        "kB" => 1,
        "MB" => 1024,
        "GB" => 1024 * 1024,
        "TB" => 1024 * 1024 * 1024,
        _ => return None,
    };
    n.checked_mul(factor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn durations_and_memory_parse_as_the_api_writes_them() {
        assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        for bad in ["", "30", "s", "1d", "1h30", "-1s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
        assert_eq!(parse_memory_kb("64kB"), Some(64));
        assert_eq!(parse_memory_kb("4MB"), Some(4096));
        assert_eq!(parse_memory_kb("1GB"), Some(1024 * 1024));
        for bad in ["", "4", "4mb", "MB", "4 MB"] {
            assert_eq!(parse_memory_kb(bad), None, "{bad}");
        }
    }
}
