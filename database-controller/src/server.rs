//! The DatabaseServer controller (`server-controller`, in the database-controller's
//! process): one probe per server, not one per Database, and the finalizer that keeps a
//! server while Databases are on it.
//!
//! A reconcile: the finalizer (present while the server is not being deleted; removed
//! once no Database uses it) → the probe (admin Secret, CA Secret, a session as the admin
//! role with the TLS asked for, `server_version` and the TLS in use; every minute while
//! Ready, every 10 s while failing, at once when the server or one of its Secrets
//! changed, and never more often because its Databases changed) → the pooler, when
//! `spec.pooler` asks for one (`crate::pooler`) → the status (a pure `desired`, with
//! `status.pooler` and `PoolerReady`), written through the shared path only when it
//! differs, with an Event when Ready or PoolerReady changes.
//!
//! Watches: DatabaseServers (generation changes), Secrets of the controllers' namespace
//! (mapped to the servers naming them, and a pooler's Secret to its server), DatabaseUsers
//! (to their server: their logins are in its pooler) and Databases (mapped to their server: the count
//! and the finalizer follow them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use dbops_api::names::finalizer::SERVER_IN_USE as IN_USE_FINALIZER;
use dbops_api::reasons::DatabaseServerReason;
use dbops_api::{
    Database, DatabaseServer, DatabaseUser, Migration, MigrationPhase, ServerTlsStatus, TlsMode,
};
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use dbops_shared::events::Recorder;
use dbops_shared::postgres::{PgError, Servers};
use dbops_shared::server::{Directory, ServerError};
use dbops_shared::status::{Guard, StatusWriter};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};

mod report;

use report::{Probe, Report, desired, server_reason};

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
    /// The DatabaseServer status writes (the shared path).
    statuses: StatusWriter<DatabaseServer>,
    /// The poolers of servers with `spec.pooler`, and the connection Secrets they serve.
    poolers: Option<(crate::pooler::Poolers, crate::tenant_secrets::TenantSecrets)>,
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
            statuses: StatusWriter::default(),
            poolers: None,
        }
    }

    /// Keeps the poolers of servers that ask for one.
    pub fn with_poolers(
        mut self,
        poolers: crate::pooler::Poolers,
        tenants: crate::tenant_secrets::TenantSecrets,
    ) -> Self {
        self.poolers = Some((poolers, tenants));
        self
    }
}

/// What a probe's result depends on: the server's generation and the resourceVersions of
/// its admin and CA Secrets.
type Fingerprint = (i64, Option<String>, Option<String>);

/// Why a server reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{reason}: {message}")]
    Probe {
        reason: DatabaseServerReason,
        message: String,
    },
}

impl ReconcileError for Error {
    /// An API error is retried; a probe's by its reason's class (the one the server
    /// raises, `CacheNotSynced`, is `Retried`).
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kube(_) => ErrorKind::Transient,
            Error::Probe { reason, .. } => dbops_shared::controller::retry_of(reason.class()),
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApiError",
            Error::Probe { reason, .. } => reason.as_str(),
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
            if !dbops_shared::store_ready::ready_within(store, Duration::from_secs(30)).await {
                return Err(Error::Probe {
                    reason: DatabaseServerReason::CacheNotSynced,
                    message: "the Database cache has not synced yet".into(),
                });
            }
            store.state()
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
            let uid = server.uid().unwrap_or_default();
            ctx.state
                .probes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&uid);
            ctx.state.statuses.forget(&uid);
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
        publish(&server, &ctx, &api, Report::InUse(message), on_it, None).await?;
        // Looked at again soon: the Database cache this reads may lag the event that
        // brought the reconcile here by a moment.
        return Ok(Action::requeue(ctx.resync_interval.min(HELD_RECHECK)));
    }
    dbops_shared::finalizer::set(server.as_ref(), &api, IN_USE_FINALIZER, true).await?;

    let probe = probe(&server, &ctx).await;
    let pooler = keep_pooler(&server, &ctx, &databases, &migrations).await?;
    publish(
        &server,
        &ctx,
        &api,
        Report::Probe(&probe),
        on_it,
        pooler.as_ref(),
    )
    .await?;
    Ok(Action::requeue(
        ctx.resync_interval.min(next_look(&probe, pooler.as_ref())),
    ))
}

/// When the server is looked at again: soon while it fails or its pooler starts.
fn next_look(probe: &Probe, pooler: Option<&crate::pooler::Report>) -> Duration {
    // The pooler Pods' readiness is read, not watched: looked at again soon while they
    // start.
    let starting = pooler.is_some_and(|p| !matches!(p.outcome, crate::pooler::Outcome::Running));
    match probe {
        // A failing server is probed on a fixed short interval, one connection per server
        // whatever the number of its Databases: its return is noticed within that interval
        // and wakes them all (Ready maps to them).
        p if p.failed_transiently() => PROBE_RETRY,
        _ if starting => PROBE_RETRY,
        _ => PROBE_EVERY,
    }
}

/// The server's pooler, as `spec.pooler` asks (`crate::pooler`).
async fn keep_pooler(
    server: &DatabaseServer,
    ctx: &Context<State>,
    databases: &[Arc<Database>],
    migrations: &[Arc<Migration>],
) -> Result<Option<crate::pooler::Report>, Error> {
    let Some((poolers, tenants)) = &ctx.state.poolers else {
        return Ok(None);
    };
    let on = crate::pooler::On {
        client: &ctx.client,
        namespace: ctx.state.directory.controller_namespace(),
        directory: &ctx.state.directory,
        tenants,
        migrations,
    };
    Ok(crate::pooler::sync(&on, poolers, server, databases).await?)
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
    let failed = |e: ServerError| Probe::failed(server_reason(e.reason()), e.to_string());
    if let Err(e) = directory.synced().await {
        return failed(e);
    }
    let resolved = match directory.resolve_server(Arc::new(server.clone())) {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    let pg_failed = |e: PgError| Probe::failed(server_reason(e.reason()), e.to_string());
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
    let capabilities = match dbops_shared::postgres::ddl::capabilities(&session).await {
        Ok(c) => c,
        Err(e) => return pg_failed(e),
    };
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
        capabilities,
    }
}

/// Writes the status for a report through the shared path (only when it differs from the
/// latest one, the uid a precondition, the Event once written). The status is recomputed
/// from the probe each time: the last write wins ([`Guard::Uid`]); a server gone since is
/// left to its deletion.
async fn publish(
    server: &DatabaseServer,
    ctx: &Context<State>,
    api: &Api<DatabaseServer>,
    report: Report<'_>,
    databases: usize,
    pooler: Option<&crate::pooler::Report>,
) -> Result<(), Error> {
    let state = &ctx.state;
    let old = state.statuses.latest(server);
    let desired = desired(
        server,
        &old,
        report,
        databases,
        pooler,
        Time(jiff::Timestamp::now()),
    );
    state
        .statuses
        .write(api, server, desired, Guard::Uid, &state.recorder, None)
        .await?;
    Ok(())
}

/// Secrets of the controllers' namespace → the servers naming them; Databases → their
/// server (and the one they were provisioned on).
pub fn watches(
    c: kube::runtime::Controller<DatabaseServer>,
    directory: &Directory,
    followed: Followed,
) -> kube::runtime::Controller<DatabaseServer> {
    let by_secret = directory.clone();
    let secrets = directory.secrets_watch().touched();
    let Followed {
        databases,
        users,
        migrations,
        migrations_by_database,
    } = followed;
    c.watches_shared_stream(secrets, move |secret: Arc<Secret>| {
        // A server's admin or CA Secret, or its pooler's (changed or deleted by someone
        // else: made again).
        let pooler = secret
            .annotations()
            .get(crate::pooler::SERVER_ANNOTATION)
            .cloned();
        by_secret
            .using_secret(&secret.name_any())
            .into_iter()
            .chain(pooler)
            .map(|name| ObjectRef::new(&name))
    })
    .watches_shared_stream(databases, move |db: Arc<Database>| {
        let mut servers = servers_of(&db);
        // A Database moved away by a Migration: its route in the source's pooler
        // follows it there.
        let key = format!("{}/{}", db.namespace().unwrap_or_default(), db.name_any());
        servers.extend(moved_from(&db, &migrations_by_database.get(&key)));
        servers
    })
    // A DatabaseUser's login is in its server's pooler.
    .watches_shared_stream(users, |u: Arc<DatabaseUser>| {
        u.status
            .as_ref()
            .and_then(|s| s.server.as_ref())
            .map(|name| ObjectRef::new(name))
    })
    .watches_shared_stream(migrations, |m: Arc<Migration>| {
        // Its target, and the server it moves the Database from (whose count drops
        // when it ends).
        let source = m
            .status
            .as_ref()
            .and_then(|s| s.source_server.as_ref())
            .map(|r| ObjectRef::new(&r.name));
        std::iter::once(ObjectRef::new(&m.spec.target.server_ref.name)).chain(source)
    })
}

/// What the server controller follows of the process's shared watches: every change of
/// Databases, DatabaseUsers and Migrations, and the Migrations by `<namespace>/<database>`.
pub struct Followed {
    pub databases: futures::stream::BoxStream<'static, Arc<Database>>,
    pub users: futures::stream::BoxStream<'static, Arc<DatabaseUser>>,
    pub migrations: futures::stream::BoxStream<'static, Arc<Migration>>,
    pub migrations_by_database: dbops_shared::shared_watch::Index<Migration>,
}

/// The servers the Migrations of `db` moved it from, when their source's pooler held it.
fn moved_from(db: &Database, migrations: &[Arc<Migration>]) -> Vec<ObjectRef<DatabaseServer>> {
    let namespace = db.namespace();
    migrations
        .iter()
        .filter(|m| m.namespace() == namespace && m.spec.database_ref.name == db.name_any())
        .filter_map(|m| m.status.as_ref()?.pooler.as_ref().filter(|p| p.held))
        .map(|p| ObjectRef::new(&p.server))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_api::{DatabaseServerStatus, ServerCapabilities, condition};
    use dbops_shared::conditions::now;

    fn pg_main() -> DatabaseServer {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": "pg-main", "uid": "s-1", "generation": 3},
            "spec": {"host": "pg.example", "adminSecretRef": {"name": "pg-main-admin"}}
        }))
        .unwrap()
    }

    /// Every reason a probe meets (the server directory's, PostgreSQL's, TLS's) is a
    /// DatabaseServer reason, and a probe is repeated soon exactly when its class is
    /// `Retried`: the admin and CA Secrets wait for a change.
    #[test]
    fn a_probes_reasons_are_the_servers_and_their_class_says_when_to_look_again() {
        use dbops_api::SharedReason as S;
        let met = [
            S::AdminSecretNotFound,
            S::AdminSecretInvalid,
            S::CASecretNotFound,
            S::CASecretInvalid,
            S::CacheNotSynced,
            S::ServerUnreachable,
            S::AuthenticationFailed,
            S::CertificateNotTrusted,
            S::HostnameMismatch,
            S::ServerWithoutTLS,
            S::LockTimeout,
            S::StatementTimeout,
            S::AdminLacksPrivilege,
            S::SqlError,
        ];
        for r in met {
            assert_eq!(server_reason(r).as_str(), r.as_str());
            let probe = Probe::failed(server_reason(r), "m");
            let waits =
                r.as_str().ends_with("SecretNotFound") || r.as_str().ends_with("SecretInvalid");
            assert_eq!(probe.failed_transiently(), !waits, "{r}");
            assert_eq!(next_look(&probe, None) == PROBE_RETRY, !waits, "{r}");
        }
    }

    fn ready_reason(s: &DatabaseServerStatus) -> (&str, &str, &str) {
        let c = dbops_shared::conditions::get(&s.conditions, condition::READY).unwrap();
        (c.status.as_str(), c.reason.as_str(), c.message.as_str())
    }

    #[test]
    fn a_probe_is_told_once_and_an_outage_keeps_its_first_message() {
        let server = pg_main();
        let ready = Probe::Ready {
            version: "17.2".into(),
            tls: ServerTlsStatus {
                mode: TlsMode::Disable,
                protocol: None,
                cipher: None,
            },
            user: "postgres".into(),
            capabilities: ServerCapabilities {
                create_role: true,
                create_database: true,
                signal_backend: true,
                ..Default::default()
            },
        };
        let first = desired(
            &server,
            &Default::default(),
            Report::Probe(&ready),
            2,
            None,
            now(),
        );
        assert_eq!(first.status.databases, Some(2));
        assert_eq!(first.status.observed_generation, Some(3));
        assert_eq!(ready_reason(&first.status).1, "Reachable");
        assert_eq!(first.notes.len(), 1);
        assert!(first.notes[0].normal);
        assert_eq!(
            first.status.capabilities.as_ref().map(|c| c.superuser),
            Some(false)
        );
        let said = ready_reason(&first.status).2;
        assert!(
            said.contains("not a superuser; lacks replication, createSubscription"),
            "{said}"
        );
        let again = desired(
            &server,
            &first.status,
            Report::Probe(&ready),
            2,
            None,
            now(),
        );
        assert_eq!(again.status, first.status);
        assert!(again.notes.is_empty(), "nothing changed, nothing told");
        let down = |detail: &str| {
            Probe::failed(
                DatabaseServerReason::ServerUnreachable,
                format!("server pg.example:5432 is unreachable: {detail}"),
            )
        };
        let refused = down("refused");
        let outage = desired(
            &server,
            &first.status,
            Report::Probe(&refused),
            2,
            None,
            now(),
        );
        assert_eq!(ready_reason(&outage.status).0, "False");
        assert!(!outage.notes[0].normal);
        let reset = down("reset");
        let later = desired(
            &server,
            &outage.status,
            Report::Probe(&reset),
            2,
            None,
            now(),
        );
        assert!(ready_reason(&later.status).2.ends_with("refused"));
        assert!(later.notes.is_empty());
        let in_use = desired(
            &server,
            &later.status,
            Report::InUse("deletion waits for Database shop/orders".into()),
            1,
            None,
            now(),
        );
        assert_eq!(ready_reason(&in_use.status).1, "InUse");
    }
}
