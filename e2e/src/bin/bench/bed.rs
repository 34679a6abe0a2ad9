//! The bed a bench builds: a control plane in a run directory, namespaces, DatabaseServers
//! (plain TCP, every namespace allowed, labelled for one run's `--server-selector`) with
//! their admin Secrets, Databases created many at a time, and the waits for them.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::{Database, DatabaseServer};
use dbops_e2e::controlplane::Options;
use dbops_e2e::{ControlPlane, ControllerProcess, PgServer};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};

/// A run's directory (a temporary one named `<prefix>…`), a control plane in its `cp/`
/// and a client of it. Dropped in reverse order: the client, the control plane, then the
/// directory.
pub(crate) async fn start_control_plane(
    prefix: &str,
) -> Result<(tempfile::TempDir, ControlPlane, kube::Client)> {
    let tmp = tempfile::Builder::new().prefix(prefix).tempdir()?;
    let cp = ControlPlane::start(Options {
        dir: tmp.path().join("cp"),
        apiserver_port: None,
    })
    .await?;
    let client = cp.client().await?;
    Ok((tmp, cp, client))
}

/// Creates Databases `0..count` on DatabaseServer `server`, Database `i` named `name(i)`
/// in `api(i)`'s namespace, `concurrency` at a time, while `ready` waits for them; fails
/// when either does; returns what `ready` returned.
pub(crate) async fn create_databases<T>(
    count: usize,
    concurrency: usize,
    server: &str,
    api: impl Fn(usize) -> Api<Database>,
    name: impl Fn(usize) -> String,
    ready: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let create = stream::iter(0..count)
        .map(|i| {
            let (dbs, name) = (api(i), name(i));
            async move {
                let db: Database = serde_json::from_value(serde_json::json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
                    "metadata": {"name": name},
                    "spec": {"serverRef": {"name": server}}
                }))?;
                dbs.create(&PostParams::default(), &db)
                    .await
                    .with_context(|| format!("creating Database {name}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>();
    let (created, ready) = tokio::join!(create, ready);
    created?;
    ready
}

/// [`create_databases`] of `count` Databases named `name(i)` on `server` in namespace `ns`,
/// 16 at a time, until all are Ready ([`wait_all_ready`]).
pub(crate) async fn create_all_ready(
    client: &kube::Client,
    ns: &str,
    server: &str,
    count: usize,
    name: impl Fn(usize) -> String,
) -> Result<()> {
    let dbs: Api<Database> = Api::namespaced(client.clone(), ns);
    let all_ready = wait_all_ready(dbs.clone(), count);
    create_databases(count, 16, server, |_| dbs.clone(), name, all_ready).await
}

/// Waits until Database `name` of `api` is Ready=True (Provisioned), polling, for at most
/// `limit`.
pub(crate) async fn wait_provisioned(
    api: &Api<Database>,
    name: &str,
    limit: Duration,
) -> Result<()> {
    dbops_e2e::wait::wait_for(
        &format!("Database {name} Ready"),
        limit,
        || async { Ok(api.get_opt(name).await?) },
        |db| {
            db.as_ref().is_some_and(|d| {
                dbops_e2e::wait::database_has(d, dbops_e2e::wait::Want::provisioned())
            })
        },
    )
    .await?;
    Ok(())
}

pub(crate) async fn namespace(client: &kube::Client, name: &str) -> Result<String> {
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.to_string());
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(name.to_string())
}

/// A bench's DatabaseServer: named like its tenant namespace, plain TCP, every namespace
/// allowed, labelled `dbops.dev/bench=<tenant namespace>`; its admin Secret `pg-admin` in
/// `<tenant namespace>-system`, the controllers' namespace.
pub(crate) struct BenchServer {
    pub name: String,
    pub controller_namespace: String,
    pub selector: String,
}

impl BenchServer {
    pub async fn create(client: &kube::Client, tenant: &str, pg: &PgServer) -> Result<Self> {
        Self::create_at(client, tenant, pg, pg.host(), pg.port()).await
    }

    /// [`BenchServer::create`] reached at `host:port` (a proxy in front of `pg`).
    pub async fn create_at(
        client: &kube::Client,
        tenant: &str,
        pg: &PgServer,
        host: &str,
        port: u16,
    ) -> Result<Self> {
        let controller_namespace = namespace(client, &format!("{tenant}-system")).await?;
        create_server_with_admin(
            client,
            &controller_namespace,
            "pg-admin",
            tenant,
            (host, port),
            pg,
            (BENCH_LABEL, tenant),
        )
        .await?;
        Ok(Self {
            name: tenant.to_string(),
            controller_namespace,
            selector: format!("{BENCH_LABEL}={tenant}"),
        })
    }

    /// A second DatabaseServer on `pg`, admitting no namespace (what `--verify-server`
    /// must name), with the same admin Secret; its name.
    pub async fn create_verify_server(
        &self,
        client: &kube::Client,
        pg: &PgServer,
    ) -> Result<String> {
        let name = format!("{}-verify", self.name);
        let server: DatabaseServer = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": name, "labels": {BENCH_LABEL: self.name}},
            "spec": {
                "host": pg.host(), "port": pg.port(),
                "adminSecretRef": {"name": "pg-admin"},
                "tls": {"mode": "disable"},
            }
        }))?;
        Api::<DatabaseServer>::all(client.clone())
            .create(&PostParams::default(), &server)
            .await
            .with_context(|| format!("creating DatabaseServer {name}"))?;
        Ok(name)
    }

    /// `--controller-namespace` and `--server-selector` for the controllers of this run.
    pub fn controller_args(&self) -> [String; 2] {
        [
            format!("--controller-namespace={}", self.controller_namespace),
            format!("--server-selector={}", self.selector),
        ]
    }
}

/// The label on a bench's DatabaseServer: its tenant namespace.
pub(crate) const BENCH_LABEL: &str = "dbops.dev/bench";

/// Waits until `count` Databases in the namespace have Ready=True (a watch, no polling).
pub(crate) async fn wait_all_ready(api: Api<Database>, count: usize) -> Result<()> {
    wait_ready(api, None, count, Duration::from_secs(1800)).await?;
    Ok(())
}

/// Waits until `count` Databases that `api` sees, in `namespaces` when given, have
/// Ready=True: one watch (over all namespaces, filtered here, when `api` is `Api::all`),
/// no polling; for at most `limit`. Returns when each was first seen Ready, in order.
pub(crate) async fn wait_ready(
    api: Api<Database>,
    namespaces: Option<&HashSet<String>>,
    count: usize,
    limit: Duration,
) -> Result<Vec<Instant>> {
    let mut ready = HashSet::new();
    let mut when = Vec::with_capacity(count);
    let mut watch = DatabaseWatch::new(api, limit);
    while let Some(db) = watch.next().await? {
        let ns = db.metadata.namespace.clone().unwrap_or_default();
        if namespaces.is_some_and(|set| !set.contains(&ns)) {
            continue;
        }
        if is_ready(&db) && ready.insert((ns, db.metadata.name.clone().unwrap_or_default())) {
            when.push(Instant::now());
            if ready.len() >= count {
                return Ok(when);
            }
        }
    }
    bail!("only {} of {count} Ready after {limit:?}", ready.len())
}

/// Whether the Database has Ready=True.
pub(crate) fn is_ready(db: &Database) -> bool {
    db.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

/// The Databases `api` sees, each change as it comes (one watch, no polling), until a
/// time limit.
pub(crate) struct DatabaseWatch {
    stream: futures::stream::BoxStream<'static, Result<Database, watcher::Error>>,
    deadline: tokio::time::Instant,
}

impl DatabaseWatch {
    pub(crate) fn new(api: Api<Database>, limit: Duration) -> Self {
        Self {
            stream: watcher(api, watcher::Config::default())
                .applied_objects()
                .boxed(),
            deadline: tokio::time::Instant::now() + limit,
        }
    }

    /// The next Database changed, or `None` once the time is up; an error when the watch
    /// fails or ends.
    pub(crate) async fn next(&mut self) -> Result<Option<Database>> {
        match tokio::time::timeout_at(self.deadline, self.stream.try_next()).await {
            Err(_) => Ok(None),
            Ok(next) => match next? {
                Some(db) => Ok(Some(db)),
                None => bail!("the watch ended"),
            },
        }
    }
}

/// A DatabaseServer for a bench run: plain TCP, every namespace allowed, its admin Secret
/// (the server's superuser) in the controllers' namespace `system`, labelled `label` for
/// the run's `--server-selector`.
pub(crate) async fn create_plain_server(
    client: &kube::Client,
    system: &str,
    name: &str,
    pg: &PgServer,
    label: (&str, &str),
) -> Result<()> {
    let admin = format!("{name}-admin");
    create_server_with_admin(
        client,
        system,
        &admin,
        name,
        (pg.host(), pg.port()),
        pg,
        label,
    )
    .await
}

/// The admin Secret `system/admin` (the superuser of `pg`) and the DatabaseServer `name`
/// with it, reached at `host:port`: plain TCP, every namespace allowed, labelled `label`.
async fn create_server_with_admin(
    client: &kube::Client,
    system: &str,
    admin: &str,
    name: &str,
    (host, port): (&str, u16),
    pg: &PgServer,
    label: (&str, &str),
) -> Result<()> {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": admin},
        "stringData": {"username": "postgres", "password": pg.superuser_password()}
    }))?;
    Api::<Secret>::namespaced(client.clone(), system)
        .create(&PostParams::default(), &secret)
        .await
        .context("creating an admin Secret")?;
    let server: DatabaseServer = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
        "metadata": {"name": name, "labels": {label.0: label.1}},
        "spec": {
            "host": host, "port": port,
            "adminSecretRef": {"name": admin},
            "tls": {"mode": "disable"},
            "allowedNamespaces": {},
        }
    }))?;
    Api::<DatabaseServer>::all(client.clone())
        .create(&PostParams::default(), &server)
        .await
        .with_context(|| format!("creating DatabaseServer {name}"))?;
    Ok(())
}

/// Starts the database-controller with `args`, its logs in `log_dir` (made here).
pub(crate) fn start_database_controller(
    kubeconfig: &std::path::Path,
    log_dir: &std::path::Path,
    args: &[String],
) -> Result<ControllerProcess> {
    std::fs::create_dir_all(log_dir)?;
    ControllerProcess::start("database-controller", kubeconfig, log_dir, args)
}

/// A random password (32 alphanumerics), as the controller makes them.
pub(crate) fn random_password() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    Alphanumeric.sample_string(&mut rand::rng(), 32)
}
