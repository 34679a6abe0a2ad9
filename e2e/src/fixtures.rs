//! Objects many tests create the same way.
//!
//! DatabaseServers are cluster-scoped, and every test's controllers would see every test's
//! servers: each test's carry the label [`TEST_NAMESPACE_LABEL`] with the test's namespace,
//! the only ones its controllers serve (`controllers::SERVER_SELECTOR`) and the ones its
//! namespace's cleanup deletes (`TestNamespace`). Their admin and CA Secrets live in the
//! test's namespace, which stands in for the controllers' own (`dbops-system`).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use dbops_api::DatabaseServer;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use crate::postgres::PgServer;
use crate::postgres::admin::AdminKind;
use crate::wait::Want;

/// The label on a test's DatabaseServers: the test's namespace.
pub const TEST_NAMESPACE_LABEL: &str = "dbops.dev/test-namespace";

/// The name of the DatabaseServer of test namespace `ns` whose admin Secret is `admin`:
/// `<ns>-<admin>`, unique in the cluster as long as the namespace is. Panics when that is
/// not a DNS subdomain of at most 253 characters (a test's own constants at fault).
pub fn server_name(ns: &str, admin: &str) -> String {
    let name = format!("{ns}-{admin}");
    assert!(
        is_dns_subdomain(&name),
        "DatabaseServer name {name:?} is not a lower case DNS subdomain of at most 253 characters"
    );
    name
}

/// RFC 1123 subdomain, as the apiserver checks object names.
fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes[0].is_ascii_alphanumeric()
                && bytes[bytes.len() - 1].is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        })
}

/// The spec of a DatabaseServer for `pg` with admin Secret `admin`: plain TCP (the test
/// servers speak TLS only when a test asks, see [`create_tls_server`]) and every namespace
/// allowed. Tests merge their own fields into it.
pub fn server_spec(pg: &PgServer, admin: &str) -> serde_json::Value {
    serde_json::json!({
        "host": pg.host(),
        "port": pg.port(),
        "adminSecretRef": {"name": admin},
        "tls": {"mode": "disable"},
        "allowedNamespaces": {},
    })
}

/// [`server_spec`] admitting no namespace: what a verification server (`--verify-server`)
/// must be.
pub fn verify_server_spec(pg: &PgServer, admin: &str) -> serde_json::Value {
    let mut spec = server_spec(pg, admin);
    if let Some(spec) = spec.as_object_mut() {
        spec.remove("allowedNamespaces");
    }
    spec
}

/// Creates the DatabaseServer `name` with `spec`, labelled as test namespace `ns`'s.
pub async fn create_server(
    client: &kube::Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<DatabaseServer> {
    let server: DatabaseServer = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "DatabaseServer",
        "metadata": {"name": name, "labels": {TEST_NAMESPACE_LABEL: ns}},
        "spec": spec,
    }))
    .with_context(|| format!("building DatabaseServer {name}"))?;
    Api::<DatabaseServer>::all(client.clone())
        .create(&PostParams::default(), &server)
        .await
        .with_context(|| format!("creating DatabaseServer {name}"))
}

/// Creates Secret `ns/name` with these (string) keys and values.
pub async fn create_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    data: &[(&str, &str)],
) -> Result<Secret> {
    let mut secret = Secret::default();
    secret.metadata.name = Some(name.to_string());
    secret.string_data = Some(
        data.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
    );
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .with_context(|| format!("creating Secret {ns}/{name}"))
}

/// Creates the admin Secret `ns/name` for `pg` (the admin [`AdminKind::for_tests`] names:
/// a managed service's admin with replication rights unless `DBOPS_TEST_ADMIN` says
/// otherwise; `ns` is the controllers' namespace in tests) and the DatabaseServer
/// [`server_name`]`(ns, name)` for `pg` with it: plain TCP, every namespace allowed
/// ([`server_spec`]).
pub async fn create_admin_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pg: &PgServer,
) -> Result<Secret> {
    create_admin_secret_of(client, ns, name, pg, AdminKind::for_tests()).await
}

/// [`create_admin_secret`] for the admin `kind`.
pub async fn create_admin_secret_of(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pg: &PgServer,
    kind: AdminKind,
) -> Result<Secret> {
    let secret = create_admin_login_secret(client, ns, name, pg, kind).await?;
    create_server(client, ns, &server_name(ns, name), server_spec(pg, name)).await?;
    Ok(secret)
}

/// The admin Secret alone: the login of the admin `kind` on `pg` (made on first use).
pub async fn create_admin_login_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pg: &PgServer,
    kind: AdminKind,
) -> Result<Secret> {
    let (username, password) = pg.admin_login(kind).await?;
    create_secret(
        client,
        ns,
        name,
        &[("username", &username), ("password", &password)],
    )
    .await
    .context("creating an admin Secret")
}

/// Creates the CA Secret `ns/name` holding `ca_pem` as `ca.crt`.
pub async fn create_ca_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    ca_pem: &str,
) -> Result<Secret> {
    create_secret(client, ns, name, &[("ca.crt", ca_pem)])
        .await
        .context("creating a CA Secret")
}

/// Creates, for `pg` reached as `host`, the admin Secret `ns/name`, the CA Secret
/// `ns/<name>-ca` with `ca_pem` when given, and the DatabaseServer
/// [`server_name`]`(ns, name)` with `tls: {mode, caSecretRef}` (every namespace allowed).
pub async fn create_tls_server(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pg: &PgServer,
    host: &str,
    mode: &str,
    ca_pem: Option<&str>,
) -> Result<DatabaseServer> {
    create_admin_login_secret(client, ns, name, pg, AdminKind::for_tests()).await?;
    let mut tls = serde_json::json!({"mode": mode});
    if let Some(pem) = ca_pem {
        let ca = format!("{name}-ca");
        create_ca_secret(client, ns, &ca, pem).await?;
        tls["caSecretRef"] = serde_json::json!({"name": ca});
    }
    let mut spec = server_spec(pg, name);
    spec["host"] = host.into();
    spec["tls"] = tls;
    create_server(client, ns, &server_name(ns, name), spec).await
}

/// Whether the DatabaseServer has the condition (in a status that describes its current
/// generation, unless `want` says any generation will do).
pub fn server_has(server: &DatabaseServer, want: Want<'_>) -> bool {
    want.holds_on(server)
}

/// Polls DatabaseServer `name` until it has the condition `want` (see [`server_has`]);
/// returns it. On timeout the error shows its last status.
pub async fn server_condition(
    client: &kube::Client,
    name: &str,
    want: Want<'_>,
    timeout: Duration,
) -> Result<DatabaseServer> {
    let api = Api::<DatabaseServer>::all(client.clone());
    let found = crate::wait::wait_for(
        &format!("DatabaseServer {name} to reach {want}"),
        timeout,
        || async { Ok(api.get_opt(name).await?.map(ServerView)) },
        |s| s.as_ref().is_some_and(|s| server_has(&s.0, want)),
    )
    .await?;
    found
        .map(|s| s.0)
        .with_context(|| format!("DatabaseServer {name} is gone"))
}

/// A DatabaseServer shown by its generation, finalizers and status, for failure messages.
struct ServerView(DatabaseServer);

impl std::fmt::Debug for ServerView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "generation {:?}, finalizers {:?}, status {:?}",
            self.0.metadata.generation, self.0.metadata.finalizers, self.0.status
        )
    }
}

/// Creates Database `ns/name` on the DatabaseServer [`server_name`]`(ns, admin)` (as made
/// by [`create_admin_secret`] or [`create_tls_server`]) with the further spec fields in
/// `extra_spec` (a JSON object: deletionPolicy, extensions, restoreFrom, …). Not waited for.
pub async fn create_database(
    client: &kube::Client,
    ns: &str,
    name: &str,
    admin: &str,
    extra_spec: serde_json::Value,
) -> Result<dbops_api::Database> {
    let spec = serde_json::json!({
        "serverRef": {"name": server_name(ns, admin)},
    });
    create_namespaced(client, ns, name, merged(spec, extra_spec)).await
}

/// [`create_database`], then waits up to `timeout` until the Database is provisioned
/// (Ready=True, Provisioned); on timeout panics with `log()`, the database-controller's
/// log: for tests.
pub async fn create_provisioned_database(
    client: &kube::Client,
    ns: &str,
    name: &str,
    admin: &str,
    extra_spec: serde_json::Value,
    timeout: std::time::Duration,
    log: impl FnOnce() -> String,
) -> dbops_api::Database {
    if let Err(e) = create_database(client, ns, name, admin, extra_spec).await {
        panic!("creating Database {ns}/{name}: {e:#}");
    }
    crate::wait::database_condition_or_log(client, ns, name, Want::provisioned(), timeout, log)
        .await
}

/// Creates Backup `ns/name` of Database `db` with the further spec fields in `extra_spec`
/// (a JSON object: storage, …). Not waited for.
pub async fn create_backup(
    client: &kube::Client,
    ns: &str,
    name: &str,
    db: &str,
    extra_spec: serde_json::Value,
) -> Result<dbops_api::Backup> {
    let spec = serde_json::json!({"databaseRef": {"name": db}});
    create_namespaced(client, ns, name, merged(spec, extra_spec)).await
}

/// Creates Migration `ns/name` of Database `db` to the DatabaseServer
/// [`server_name`]`(ns, target_admin)` with the further spec fields in `extra_spec` (a
/// JSON object: mode, cutover, …). Not waited for.
pub async fn create_migration(
    client: &kube::Client,
    ns: &str,
    name: &str,
    db: &str,
    target_admin: &str,
    extra_spec: serde_json::Value,
) -> Result<dbops_api::Migration> {
    let spec = serde_json::json!({
        "databaseRef": {"name": db},
        "target": {"serverRef": {"name": server_name(ns, target_admin)}},
    });
    create_namespaced(client, ns, name, merged(spec, extra_spec)).await
}

/// `base` with the fields of `extra` (when both are JSON objects) put over its own.
fn merged(mut base: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(base), Some(extra)) = (base.as_object_mut(), extra.as_object()) {
        base.extend(extra.clone());
    }
    base
}

/// The object `K` named `name` with `spec`, as its manifest is written (the apiVersion
/// and kind of `K`).
pub fn manifest<K>(name: &str, spec: serde_json::Value) -> Result<K>
where
    K: kube::Resource + serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    let kind = K::kind(&Default::default()).to_string();
    serde_json::from_value(serde_json::json!({
        "apiVersion": K::api_version(&Default::default()),
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }))
    .with_context(|| format!("building a {kind}"))
}

/// Creates the dbops object `ns/name` of kind `K` with `spec`.
async fn create_namespaced<K>(
    client: &kube::Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let object: K = manifest(name, spec)?;
    let kind = K::kind(&Default::default()).to_string();
    Api::<K>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &object)
        .await
        .with_context(|| format!("creating {kind} {ns}/{name}"))
}

/// Merge-patches the object `name` with `patch` (`{"spec": {...}}`, …).
pub async fn merge_patch<K>(api: &Api<K>, name: &str, patch: serde_json::Value) -> Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(patch),
    )
    .await
    .with_context(|| format!("patching {name}"))
}

/// Merge-patches the spec of the object `name` with `spec` (`{"connectionLimit": 5}`, …).
pub async fn merge_patch_spec<K>(api: &Api<K>, name: &str, spec: serde_json::Value) -> Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    merge_patch(api, name, serde_json::json!({ "spec": spec })).await
}

/// Approves the Migration `name` waiting for a manual cutover (`spec.approved: true`).
pub async fn approve_migration(
    api: &Api<dbops_api::Migration>,
    name: &str,
) -> Result<dbops_api::Migration> {
    merge_patch(api, name, serde_json::json!({"spec": {"approved": true}})).await
}

/// What a Database's connection Secret says: the libpq keys.
#[derive(Clone)]
pub struct Connection {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: String,
    pub dbname: String,
    /// `PGSSLMODE`, when the Secret has it.
    pub sslmode: Option<String>,
}

impl Connection {
    /// Reads the connection Secret `ns/<db>-connection` of Database `db`.
    pub async fn of_database(client: &kube::Client, ns: &str, db: &str) -> Result<Self> {
        Self::read(
            &Api::namespaced(client.clone(), ns),
            &format!("{db}-connection"),
        )
        .await
    }

    /// Reads Secret `name`.
    pub async fn read(secrets: &Api<Secret>, name: &str) -> Result<Self> {
        let secret = secrets
            .get(name)
            .await
            .with_context(|| format!("reading Secret {name}"))?;
        let data = secret.data.unwrap_or_default();
        let value = |k: &str| -> Result<String> {
            Ok(String::from_utf8(
                data.get(k)
                    .with_context(|| format!("Secret {name} has no {k}"))?
                    .0
                    .clone(),
            )?)
        };
        Ok(Self {
            host: value("PGHOST")?,
            port: value("PGPORT")?.parse().context("PGPORT")?,
            user: value("PGUSER")?,
            password: value("PGPASSWORD")?,
            dbname: value("PGDATABASE")?,
            sslmode: value("PGSSLMODE").ok(),
        })
    }

    /// A client configuration with these keys (no TLS asked for here).
    pub fn config(&self) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host(&self.host)
            .port(self.port)
            .user(&self.user)
            .password(&self.password)
            .dbname(&self.dbname);
        config
    }

    /// A session with these keys, without TLS (5 s at most to connect); its connection
    /// runs on a task of its own.
    pub async fn connect(&self) -> Result<tokio_postgres::Client> {
        let (client, connection) = self
            .config()
            .connect_timeout(Duration::from_secs(5))
            .connect(tokio_postgres::NoTls)
            .await?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// `pgbench -i -q -s <scale>` with the pgbench of `bin_dir`, as this role; `PGSSLMODE`
    /// set when `sslmode` is given (libpq's default, `prefer`, otherwise). Fails with
    /// pgbench's stderr when it does.
    pub fn pgbench_init(
        &self,
        bin_dir: &std::path::Path,
        scale: u32,
        sslmode: Option<&str>,
    ) -> Result<()> {
        let mut command = std::process::Command::new(bin_dir.join("pgbench"));
        command
            .args(["-i", "-q", "-s", &scale.to_string()])
            .env("PGHOST", &self.host)
            .env("PGPORT", self.port.to_string())
            .env("PGUSER", &self.user)
            .env("PGPASSWORD", &self.password)
            .env("PGDATABASE", &self.dbname);
        if let Some(mode) = sslmode {
            command.env("PGSSLMODE", mode);
        }
        let out = command.output().context("running pgbench")?;
        anyhow::ensure!(
            out.status.success(),
            "pgbench -i failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

/// [`Connection::pgbench_init`] into Database `ns/db` as its own role (its connection
/// Secret), with the pgbench of [`crate::paths::postgres_bin_dir`].
pub async fn pgbench_database(
    client: &kube::Client,
    ns: &str,
    db: &str,
    scale: u32,
    sslmode: Option<&str>,
) -> Result<()> {
    Connection::of_database(client, ns, db).await?.pgbench_init(
        &crate::paths::postgres_bin_dir()?,
        scale,
        sslmode,
    )
}

/// The name of the final snapshot Backup made for the Database with `db_uid`
/// (`deletionPolicy: Snapshot`), found by its label once the database-controller made it.
pub async fn wait_final_snapshot(
    client: &kube::Client,
    ns: &str,
    db_uid: &str,
    timeout: std::time::Duration,
) -> Result<String> {
    let api = Api::<dbops_api::Backup>::namespaced(client.clone(), ns);
    let selector = format!("{}={db_uid}", dbops_api::marks::FINAL_SNAPSHOT_OF);
    let found = crate::wait::wait_for(
        &format!("the final snapshot Backup of the Database with UID {db_uid}"),
        timeout,
        || async {
            let list = api
                .list(&kube::api::ListParams::default().labels(&selector))
                .await?;
            Ok(list
                .items
                .into_iter()
                .filter_map(|b| b.metadata.name)
                .collect::<Vec<_>>())
        },
        |names| !names.is_empty(),
    )
    .await?;
    found.into_iter().next().context("no final snapshot Backup")
}

/// Deletes Database `db` (`deletionPolicy: Snapshot`) and returns the name of its final
/// snapshot Backup once the database-controller made it ([`wait_final_snapshot`]).
pub async fn delete_for_final_snapshot(
    client: &kube::Client,
    db: &dbops_api::Database,
    timeout: std::time::Duration,
) -> Result<String> {
    let (ns, name) = (db.namespace().unwrap_or_default(), db.name_any());
    let uid = db.uid().context("a Database without a uid")?;
    Api::<dbops_api::Database>::namespaced(client.clone(), &ns)
        .delete(&name, &kube::api::DeleteParams::default())
        .await
        .with_context(|| format!("deleting Database {ns}/{name}"))?;
    wait_final_snapshot(client, &ns, &uid, timeout).await
}

/// The core/v1 Events of namespace `ns` about the object `kind`/`name`.
pub async fn events_about(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    name: &str,
) -> Result<Vec<k8s_openapi::api::core::v1::Event>> {
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), ns)
        .list(&kube::api::ListParams::default())
        .await
        .with_context(|| format!("listing the Events of {ns}"))?;
    Ok(events
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some(kind)
                && e.involved_object.name.as_deref() == Some(name)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_are_the_namespace_and_the_admin_secret() {
        assert_eq!(
            server_name("db-ready-x1y2z3", "pg-admin"),
            "db-ready-x1y2z3-pg-admin"
        );
        assert!(is_dns_subdomain("a.b-c.d9"));
        for bad in ["", "-a", "a-", "a..b", "A", "a_b", "a b", &"a".repeat(254)] {
            assert!(!is_dns_subdomain(bad), "{bad:?}");
        }
    }

    #[test]
    #[should_panic(expected = "not a lower case DNS subdomain")]
    fn a_server_name_that_is_no_dns_subdomain_is_refused() {
        server_name("ns", "Admin_Secret");
    }
}
