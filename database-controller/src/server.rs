//! The DatabaseServer controller (`server-controller`, in the database-controller's
//! process): one probe per server, not one per Database, and the finalizer that keeps a
//! server while Databases are on it.
//!
//! A reconcile: the finalizer (present while the server is not being deleted; removed
//! once no Database uses it) → the probe (admin Secret, CA Secret, a session as the admin
//! role with the TLS asked for, `server_version` and the TLS in use; every minute while
//! Ready, every 10 s while failing, at once when the server or one of its Secrets
//! changed, and never more often because its Databases changed) → the status,
//! written only when it differs, with an Event when Ready changes.
//!
//! Watches: DatabaseServers (generation changes), Secrets of the controllers' namespace
//! (mapped to the servers naming them) and Databases (mapped to their server: the count
//! and the finalizer follow them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use dbops_api::names::finalizer::SERVER_IN_USE as IN_USE_FINALIZER;
use dbops_api::{
    Database, DatabaseServer, DatabaseServerStatus, Migration, MigrationPhase, ServerTlsStatus,
    TlsMode, condition,
};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, set_condition};
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use dbops_shared::events::Recorder;
use dbops_shared::postgres::{PgError, Servers};
use dbops_shared::server::{Directory, ServerError};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

/// How soon a failing server is probed again.
const PROBE_RETRY: Duration = Duration::from_secs(10);
/// How often a Ready server is probed (at most; `--resync-interval` if shorter): an
/// outage shows on the server, and through it on its Databases, within this.
const PROBE_EVERY: Duration = Duration::from_secs(60);

/// How soon a server held by its Databases looks again whether they are gone.
const HELD_RECHECK: Duration = Duration::from_secs(5);

/// The server controller's name: metrics label and Event reporter `dbops-server-controller`.
pub const CONTROLLER: &str = "server-controller";

/// The server controller's own state.
pub struct State {
    pub directory: Directory,
    pub servers: Arc<Servers>,
    pub recorder: Recorder,
    /// The database-controller's caches of Databases and Migrations (set up with its
    /// watches).
    pub databases: Arc<OnceLock<Store<Database>>>,
    pub migrations: Arc<OnceLock<Store<Migration>>>,
    /// The last probe of each server (by uid), with what it depended on.
    probes: Mutex<HashMap<String, (Fingerprint, Instant, Probe)>>,
}

impl State {
    pub fn new(
        directory: Directory,
        servers: Arc<Servers>,
        recorder: Recorder,
        databases: Arc<OnceLock<Store<Database>>>,
        migrations: Arc<OnceLock<Store<Migration>>>,
    ) -> Self {
        Self {
            directory,
            servers,
            recorder,
            databases,
            migrations,
            probes: Mutex::new(HashMap::new()),
        }
    }
}

/// What a probe's result depends on: the server's generation and the resourceVersions of
/// its admin and CA Secrets.
type Fingerprint = (i64, Option<String>, Option<String>);

/// What a probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Probe {
    Ready {
        version: String,
        tls: ServerTlsStatus,
        user: String,
    },
    Failed {
        reason: &'static str,
        message: String,
        transient: bool,
    },
}

/// Why a server reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{reason}: {message}")]
    Probe {
        reason: &'static str,
        message: String,
    },
}

impl ReconcileError for Error {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Transient
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::Probe { reason, .. } => reason,
        }
    }
}

/// What holds `server`: Databases on it (spec) or still provisioned there (status), and
/// Migrations that have not ended and move a Database to it (their rollback may still
/// have to clean it).
pub fn users(
    databases: &[Arc<Database>],
    migrations: &[Arc<Migration>],
    server: &str,
) -> Vec<String> {
    let mut found: Vec<String> = databases
        .iter()
        .filter(|d| {
            d.spec.server_ref.name == server
                || d.status.as_ref().and_then(|s| s.server.as_deref()) == Some(server)
        })
        .map(|d| {
            format!(
                "Database {}/{}",
                d.namespace().unwrap_or_default(),
                d.name_any()
            )
        })
        .chain(
            migrations
                .iter()
                .filter(|m| {
                    m.spec.target.server_ref.name == server
                        && !m
                            .status
                            .as_ref()
                            .and_then(|s| s.phase)
                            .is_some_and(MigrationPhase::is_final)
                })
                .map(|m| {
                    format!(
                        "Migration {}/{}",
                        m.namespace().unwrap_or_default(),
                        m.name_any()
                    )
                }),
        )
        .collect();
    found.sort();
    found
}

pub async fn reconcile(
    server: Arc<DatabaseServer>,
    ctx: Arc<Context<State>>,
) -> Result<Action, Error> {
    let name = server.name_any();
    let api: Api<DatabaseServer> = Api::all(ctx.client.clone());
    let databases = match ctx.state.databases.get() {
        Some(store) => {
            match tokio::time::timeout(Duration::from_secs(30), store.wait_until_ready()).await {
                Ok(Ok(())) => store.state(),
                _ => {
                    return Err(Error::Probe {
                        reason: "CacheNotSynced",
                        message: "the Database cache has not synced yet".into(),
                    });
                }
            }
        }
        None => Vec::new(),
    };
    let migrations = ctx
        .state
        .migrations
        .get()
        .map(|store| store.state())
        .unwrap_or_default();
    let using = users(&databases, &migrations, &name);
    let on_it = using.iter().filter(|u| u.starts_with("Database ")).count();

    if server.metadata.deletion_timestamp.is_some() {
        if using.is_empty() {
            dbops_shared::finalizer::set(server.as_ref(), &api, IN_USE_FINALIZER, false).await?;
            ctx.state
                .probes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&server.uid().unwrap_or_default());
            return Ok(Action::await_change());
        }
        let shown: Vec<&str> = using.iter().take(10).map(String::as_str).collect();
        let more = using.len().saturating_sub(shown.len());
        let message = format!(
            "deletion waits for what still uses this server ({}): {}{}; existing Databases are still served, new ones are refused",
            using.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
        publish(&server, &ctx, &api, None, Some(message), on_it).await?;
        // Looked at again soon: the Database cache this reads may lag the event that
        // brought the reconcile here by a moment.
        return Ok(Action::requeue(ctx.resync_interval.min(HELD_RECHECK)));
    }
    dbops_shared::finalizer::set(server.as_ref(), &api, IN_USE_FINALIZER, true).await?;

    let probe = probe(&server, &ctx).await;
    publish(&server, &ctx, &api, Some(&probe), None, on_it).await?;
    match probe {
        // A failing server is probed on a fixed short interval, one connection per server
        // whatever the number of its Databases: its return is noticed within that interval
        // and wakes them all (Ready maps to them).
        Probe::Failed {
            transient: true, ..
        } => Ok(Action::requeue(ctx.resync_interval.min(PROBE_RETRY))),
        _ => Ok(Action::requeue(ctx.resync_interval.min(PROBE_EVERY))),
    }
}

/// The server's probe: reused while fresh and nothing it depends on changed.
async fn probe(server: &DatabaseServer, ctx: &Context<State>) -> Probe {
    let uid = server.uid().unwrap_or_default();
    let fingerprint = fingerprint(server, &ctx.state.directory);
    let fresh_for = ctx.resync_interval / 2;
    if let Some((seen, at, probe)) = ctx
        .state
        .probes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&uid)
        && *seen == fingerprint
        // A failure is not trusted as long: the server's return must be seen soon, but
        // the events of its many Databases must not each cost a connection attempt.
        && at.elapsed() < match probe {
            Probe::Ready { .. } => fresh_for.min(PROBE_EVERY / 2),
            Probe::Failed { .. } => PROBE_RETRY / 2,
        }
    {
        return probe.clone();
    }
    let probe = probe_now(server, ctx).await;
    ctx.state
        .probes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(uid, (fingerprint, Instant::now(), probe.clone()));
    probe
}

fn fingerprint(server: &DatabaseServer, directory: &Directory) -> Fingerprint {
    let version = |name: &str| directory.secret_version(name);
    (
        server.metadata.generation.unwrap_or_default(),
        version(&server.spec.admin_secret_ref.name),
        server
            .spec
            .tls
            .ca_secret_ref
            .as_ref()
            .and_then(|r| version(&r.name)),
    )
}

async fn probe_now(server: &DatabaseServer, ctx: &Context<State>) -> Probe {
    let directory = &ctx.state.directory;
    let failed = |e: ServerError| Probe::Failed {
        reason: e.reason(),
        message: e.to_string(),
        transient: e.is_transient(),
    };
    if let Err(e) = directory.synced().await {
        return failed(e);
    }
    let resolved = match directory.resolve_server(Arc::new(server.clone())) {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    let pg_failed = |e: PgError| Probe::Failed {
        reason: e.reason(),
        message: e.to_string(),
        transient: true,
    };
    let session = match ctx
        .state
        .servers
        .probe(&resolved.endpoint, &resolved.credentials, "postgres")
        .await
    {
        Ok(s) => s,
        Err(e) => return pg_failed(e),
    };
    let row = session
        .query_one(
            "SELECT current_setting('server_version'), s.ssl, s.version, s.cipher \
             FROM pg_stat_ssl s WHERE s.pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(PgError::sql("reading server_version and the session's TLS"));
    let row = match row {
        Ok(row) => row,
        Err(e) => return pg_failed(e),
    };
    let version: String = row.try_get(0).unwrap_or_default();
    let ssl: bool = row.try_get(1).unwrap_or(false);
    let protocol: Option<String> = row.try_get(2).ok().flatten();
    let cipher: Option<String> = row.try_get(3).ok().flatten();
    Probe::Ready {
        version,
        tls: ServerTlsStatus {
            mode: if ssl {
                server.spec.tls.mode
            } else {
                TlsMode::Disable
            },
            protocol,
            cipher,
        },
        user: resolved.credentials.username,
    }
}

/// Writes the status for a probe (or, while deletion waits, the `InUse` message), only
/// when it differs; an Event when Ready changes.
async fn publish(
    server: &DatabaseServer,
    ctx: &Context<State>,
    api: &Api<DatabaseServer>,
    probe: Option<&Probe>,
    deleting: Option<String>,
    databases: usize,
) -> Result<(), Error> {
    let old = server.status.clone().unwrap_or_default();
    let mut new = old.clone();
    let generation = server.metadata.generation;
    new.observed_generation = generation;
    new.databases = Some(i32::try_from(databases).unwrap_or(i32::MAX));
    let (status, reason, message) = match (probe, deleting) {
        (_, Some(message)) => (ConditionStatus::False, "InUse", message),
        (Some(Probe::Ready { version, tls, user }), None) => {
            new.server_version = Some(version.clone());
            new.tls = Some(tls.clone());
            let over = match &tls.protocol {
                Some(p) => format!("{p} ({})", tls.mode.as_str()),
                None => "plain TCP (tls.mode disable)".into(),
            };
            (
                ConditionStatus::True,
                "Reachable",
                format!("connected as {user} over {over}; PostgreSQL {version}"),
            )
        }
        (
            Some(Probe::Failed {
                reason,
                message,
                transient,
            }),
            None,
        ) => {
            // Written once per outage: while the reason stays, the first message stays
            // (the details of a failing connection vary from one probe to the next).
            let kept = dbops_shared::conditions::get(&old.conditions, condition::READY)
                .filter(|c| *transient && c.status == "False" && c.reason == *reason)
                .map(|c| c.message.clone());
            (
                ConditionStatus::False,
                *reason,
                kept.unwrap_or_else(|| message.clone()),
            )
        }
        (None, None) => return Ok(()),
    };
    let changed_ready = set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::READY,
            status,
            reason,
            message: message.clone(),
            observed_generation: generation,
        },
        Time(jiff::Timestamp::now()),
    );
    if new == old {
        return Ok(());
    }
    write_status(api, &server.name_any(), &new).await?;
    if changed_ready {
        dbops_shared::events::publish(
            &ctx.state.recorder,
            server,
            status == ConditionStatus::True,
            "Probe",
            reason,
            &message,
        )
        .await;
    }
    Ok(())
}

async fn write_status(
    api: &Api<DatabaseServer>,
    name: &str,
    status: &DatabaseServerStatus,
) -> Result<(), Error> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await?;
    Ok(())
}

/// Secrets of the controllers' namespace → the servers naming them; Databases → their
/// server (and the one they were provisioned on).
pub fn watches(
    c: kube::runtime::Controller<DatabaseServer>,
    ctx: &Arc<Context<State>>,
    directory: &Directory,
    namespace: Option<&str>,
) -> kube::runtime::Controller<DatabaseServer> {
    let client = ctx.client.clone();
    let by_secret = directory.clone();
    let secrets = watcher(
        Api::<Secret>::namespaced(client.clone(), directory.controller_namespace()),
        watcher::Config::default(),
    )
    .default_backoff()
    .touched_objects();
    c.watches_stream(secrets, move |secret: Secret| {
        by_secret
            .using_secret(&secret.name_any())
            .into_iter()
            .map(|name| ObjectRef::new(&name))
    })
    .watches(
        dbops_shared::controller::scoped_api::<Database>(client.clone(), namespace),
        watcher::Config::default(),
        |db: Database| servers_of(&db),
    )
    .watches(
        dbops_shared::controller::scoped_api::<Migration>(client, namespace),
        watcher::Config::default(),
        |m: Migration| {
            // Its target, and the server it moves the Database from (whose count drops
            // when it ends).
            let source = m
                .status
                .as_ref()
                .and_then(|s| s.source_server.as_ref())
                .map(|r| ObjectRef::new(&r.name));
            std::iter::once(ObjectRef::new(&m.spec.target.server_ref.name)).chain(source)
        },
    )
}

/// The servers a Database event concerns: the one it names and the one it is on.
fn servers_of(db: &Database) -> Vec<ObjectRef<DatabaseServer>> {
    let mut names = vec![db.spec.server_ref.name.clone()];
    if let Some(on) = db.status.as_ref().and_then(|s| s.server.clone())
        && on != names[0]
    {
        names.push(on);
    }
    names.iter().map(|n| ObjectRef::new(n)).collect()
}
