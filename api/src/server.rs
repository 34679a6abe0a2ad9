//! `DatabaseServer`: a PostgreSQL server the platform team offers to application teams.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::access::SessionLimits;
use crate::common::{SecretReference, TlsMode};
use crate::patterns::{EXTENSION_NAME_PATTERN, SIZE_PATTERN, all_match, matches};

/// The finalizer that keeps a DatabaseServer while Databases are on it (like PVC
/// protection): removed by the database-controller once none is left.
pub const IN_USE_FINALIZER: &str = crate::names::finalizer::SERVER_IN_USE;

/// Desired state of a DatabaseServer.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "dbops.dev",
    version = "v1alpha1",
    kind = "DatabaseServer",
    status = "DatabaseServerStatus",
    derive = "PartialEq",
    shortname = "dbserver",
    category = "dbops",
    doc = "A PostgreSQL server offered to application teams (cluster-scoped, written by the platform team). Its admin credentials stay in the controllers' namespace; Databases name it in spec.serverRef.",
    printcolumn(
        name = "Host",
        type_ = "string",
        json_path = ".spec.host",
        description = "PostgreSQL server host"
    ),
    printcolumn(
        name = "Port",
        type_ = "integer",
        json_path = ".spec.port",
        description = "PostgreSQL server port"
    ),
    printcolumn(
        name = "TLS",
        type_ = "string",
        json_path = ".status.tls.mode",
        description = "TLS mode in use"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "Reachable, authenticated, TLS as asked"
    ),
    printcolumn(
        name = "Superuser",
        type_ = "boolean",
        json_path = ".status.capabilities.superuser",
        description = "Whether the admin role is a superuser (status.capabilities says what it may do)"
    ),
    printcolumn(
        name = "Version",
        type_ = "string",
        json_path = ".status.serverVersion",
        description = "PostgreSQL server_version"
    ),
    printcolumn(
        name = "Databases",
        type_ = "integer",
        json_path = ".status.databases",
        description = "Databases on this server"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseServerSpec {
    /// Host name or IP address of the PostgreSQL server, for example
    /// `pg-main.databases.svc`. With `tls.mode: verify-full` the server's certificate must
    /// name it.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([-A-Za-z0-9.:]*[A-Za-z0-9])?$')").message("host must be a DNS name or an IP address"))]
    pub host: String,

    /// TCP port of the PostgreSQL server.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,

    /// A Secret in the controllers' own namespace (not a tenant's) with the keys `username`
    /// and `password` of a role that may create roles and databases on this server.
    pub admin_secret_ref: SecretReference,

    /// TLS to the server, for the controllers' sessions and in the Databases' connection
    /// Secrets. Default: `verify-full` against the system's trusted roots.
    #[serde(default)]
    pub tls: ServerTls,

    /// The namespaces whose Databases may use this server, by their labels: `{}` allows
    /// every namespace, absent allows none. A Database created in a namespace that does
    /// not match is refused (`NamespaceNotAllowed`); one already provisioned here keeps
    /// being served when its namespace stops matching.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_namespaces: Option<LabelSelector>,

    /// Limits on what the allowed namespaces may hold on this server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<ServerLimits>,

    /// Defaults and ceilings of the session settings Databases and DatabaseUsers may ask
    /// for (`settings`): a tenant may ask for less, never more (`LimitExceeded`, naming
    /// the field); a setting left out takes the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_limits: Option<SessionLimits>,

    /// The extensions a Database on this server may ask for (`spec.extensions`), and a
    /// Migration may bring here. Absent: only those PostgreSQL marks trusted
    /// (`pg_available_extension_versions.trusted`), which a database owner could create
    /// on its own. A listed extension that is not trusted is created by the admin, so
    /// list one only if its install script is safe to run as a superuser in a schema the
    /// tenant owns. An extension not allowed is refused (`ExtensionNotAllowed`, naming it)
    /// before anything runs on the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256), inner(length(max = 63)), extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new(all_match(EXTENSION_NAME_PATTERN)).message("every allowed extension must be an extension name: 1 to 63 characters of a-z, 0-9, _ and -"))]
    pub allowed_extensions: Option<Vec<String>>,

    /// PgBouncer in front of this server, run by dbops in the controllers' namespace (a
    /// Deployment, a Service `dbops-pooler-<server>` and a PodDisruptionBudget): every
    /// connection Secret of a Database on the server gains `pooler-*` keys, each login
    /// reaching only its own database through it. Absent: no pooler (one that was there
    /// is removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooler: Option<PoolerSpec>,
}

fn default_port() -> i32 {
    5432
}

/// PgBouncer in front of a DatabaseServer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.defaultPoolSize <= self.maxClientConnections").message("defaultPoolSize must not exceed maxClientConnections").field_path(".defaultPoolSize"))]
pub struct PoolerSpec {
    /// Pods of the pooler; with 2 or more a PodDisruptionBudget keeps all but one through
    /// a voluntary disruption.
    #[serde(default = "default_pooler_replicas")]
    #[schemars(range(min = 1, max = 10))]
    pub replicas: i32,

    /// When a server connection goes back to the pool: `transaction` (default; the most
    /// clients per server connection, but session state such as `SET`, `LISTEN`,
    /// advisory locks and `WITH HOLD` cursors does not carry over between
    /// transactions) or `session` (every feature; one server connection per client).
    #[serde(default)]
    pub pool_mode: PoolMode,

    /// Client connections each pooler Pod accepts.
    #[serde(default = "default_max_client_connections")]
    #[schemars(range(min = 10, max = 100000))]
    pub max_client_connections: i32,

    /// Server connections each pooler Pod opens per database and login.
    #[serde(default = "default_pool_size")]
    #[schemars(range(min = 1, max = 1000))]
    pub default_pool_size: i32,

    /// The pooler's serving certificate: a Secret in the controllers' namespace with
    /// `tls.crt` and `tls.key` (a `kubernetes.io/tls` Secret, for example one cert-manager
    /// keeps) and `ca.crt`, what clients verify it against (`tls.crt` itself when absent).
    /// Its certificate must name the pooler's Service
    /// (`dbops-pooler-<server>.<namespace>.svc`). A change of the Secret (a renewal)
    /// reaches the Pods without a restart and the connection Secrets' `pooler-ca.crt`.
    /// Absent: dbops makes a self-signed certificate for the Service's names once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate_secret_ref: Option<SecretReference>,
}

fn default_pooler_replicas() -> i32 {
    2
}

fn default_max_client_connections() -> i32 {
    2000
}

fn default_pool_size() -> i32 {
    10
}

/// When the pooler gives a server connection back to the pool.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    /// At the end of each transaction.
    #[default]
    Transaction,
    /// When the client disconnects.
    Session,
}

/// TLS settings of a DatabaseServer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.caSecretRef) || self.mode != 'disable'").message("caSecretRef needs a TLS mode other than disable").field_path(".caSecretRef"))]
pub struct ServerTls {
    /// `disable`, `require`, `verify-ca` or `verify-full` (libpq's `sslmode` meanings).
    #[serde(default)]
    pub mode: TlsMode,

    /// A Secret in the controllers' namespace whose key `ca.crt` holds the PEM
    /// certificate(s) the server's certificate must chain to; the system's trusted roots
    /// when absent. Copied into each connection Secret as `ca.crt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretReference>,
}

/// Limits of a DatabaseServer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerLimits {
    /// At most this many Databases per namespace on this server; the oldest ones (by
    /// creation time) are served, the rest get `QuotaExceeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100000))]
    pub databases_per_namespace: Option<i32>,

    /// The ceiling of a Database's and a DatabaseUser's `connectionLimit` (and what -1, no
    /// limit of their own, becomes on this server). One asking for more is refused
    /// (`LimitExceeded`, naming the field); nothing changes on the server for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub connection_limit: Option<i32>,

    /// The size a Database may grow to, e.g. `20Gi`: each Database reports its size
    /// (`status.sizeBytes`, metric `dbops_database_size_bytes`) and gets the condition
    /// `SizeExceeded` above it. Reported, not enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new(matches(SIZE_PATTERN)).message("databaseSize must be a size such as 500Mi, 20Gi or 1Ti"))]
    pub database_size: Option<String>,

    /// At most this many clones (`cloneFrom`) copy into this server at once; the others
    /// queue (`CloneQueued`) in the order they were created. Absent: 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub concurrent_clones: Option<i32>,

    /// The space all clones on this server may take together (their sizes as last read,
    /// and the source's size for one about to start), e.g. `50Gi`; a clone that would go
    /// over queues until clones are deleted or expire. Absent: no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new(matches(SIZE_PATTERN)).message("cloneSpace must be a size such as 500Mi, 20Gi or 1Ti"))]
    pub clone_space: Option<String>,
}

/// Observed state of a DatabaseServer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseServerStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Ready: reachable, authenticated as the admin Secret's role, TLS as asked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// `server_version` reported by PostgreSQL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,

    /// The TLS of the controllers' last session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTlsStatus>,

    /// How many Databases are on this server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub databases: Option<i32>,

    /// What the admin role may do, as the last probe found it. The admin need not be a
    /// superuser (nobody is on RDS, Cloud SQL or Azure): a Database, DatabaseUser, Backup
    /// or Migration that needs a right it lacks is refused naming it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<ServerCapabilities>,

    /// The pooler, while `spec.pooler` asks for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooler: Option<PoolerStatus>,
}

/// What the pooler serves.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolerStatus {
    /// The host applications connect to (the Service's cluster DNS name).
    pub host: String,
    /// Its port.
    pub port: i32,
    /// Pods ready.
    pub ready_replicas: i32,
    /// Databases routed through it.
    pub databases: i32,
    /// Logins it lets in.
    pub logins: i32,
}

/// What a DatabaseServer's admin role may do (its attributes and its memberships in
/// PostgreSQL's built-in roles).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerCapabilities {
    /// SUPERUSER: may do anything.
    pub superuser: bool,
    /// CREATEROLE: may create the owner and login roles (every Database and DatabaseUser
    /// needs it).
    pub create_role: bool,
    /// CREATEDB: may create databases (every Database needs it).
    pub create_database: bool,
    /// REPLICATION (or SUPERUSER): may replicate, as a Logical Migration's source needs.
    pub replication: bool,
    /// May create a role with REPLICATION (a superuser, or REPLICATION on PostgreSQL 16+).
    /// Without it a Logical Migration's subscription logs in as the admin itself.
    pub create_replication_role: bool,
    /// May CREATE SUBSCRIPTION (a superuser, or a member of `pg_create_subscription` on
    /// PostgreSQL 16+), as a Logical Migration's target needs.
    pub create_subscription: bool,
    /// Reads every table (`pg_read_all_data` on PostgreSQL 14+, or a superuser).
    pub read_all_data: bool,
    /// May end other roles' sessions (`pg_signal_backend`, or a superuser): deletions,
    /// rotations and a Migration's freeze end the sessions they must.
    pub signal_backend: bool,
    /// Sees every session's activity (`pg_monitor`, or a superuser).
    pub monitor: bool,
    /// Bypasses row-level security (BYPASSRLS, or a superuser).
    pub bypass_rls: bool,
}

/// TLS in use on a server.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerTlsStatus {
    /// The mode the session was set up with (`disable` when no TLS).
    pub mode: TlsMode,
    /// The protocol version, for example `TLSv1.3` (absent without TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// The cipher suite (absent without TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cipher: Option<String>,
}
