//! How a dbops controller process runs; each binary's `main.rs` wires its controllers
//! with it in one screen, as the migration-controller does:
//!
//! ```ignore
//! let process = Process::start::<Migration>(CONTROLLER, &args.common).await?;
//! process
//!     .run(None, |run| async move {
//!         let ctx = run.context(CONTROLLER, State::new(run.client(), ..));
//!         let migrations = run
//!             .controller::<Migration>(watcher::Config::default(), Trigger::GenerationChange)
//!             .owns_stream(controller::trigger(backups, snapshots))
//!             .watches_stream(controller::trigger(servers, server_config), |server| {
//!                 migrations_using(&server)
//!             });
//!         run.drive(migrations, ctx, saga::reconcile).await;
//!     })
//!     .await
//! ```
//!
//! 1. [`Process::start`]: checks the flags, installs the SIGTERM/SIGINT handlers, binds
//!    /healthz, /readyz and /metrics on `--metrics-addr`, builds the rate-limited client
//!    and checks that the CRD of the process's main kind is served.
//! 2. [`Process::run`]: serves health and metrics; with a backup store, waits until it
//!    passes its check ([`wait_for_backup_store`]), not ready meanwhile; with
//!    `--leader-elect`, takes the Lease; then calls the wiring with a [`Running`] and, on
//!    a signal (or a watch stalled past `--watch-stall-timeout`), stops it, lets running
//!    reconciles finish, releases the Lease and stops the health server.
//! 3. The wiring builds each kube-runtime `Controller` with [`Running::controller`] (its
//!    watch store without `managedFields`, pages of [`LIST_PAGE_SIZE`], `--concurrency`,
//!    the [`Trigger`]), adds the kind's own watches with kube's `owns_stream` and
//!    `watches_stream`, each watch made by [`trigger`] with a backoff of its own, and runs
//!    it with [`Running::drive`]: each reconcile bounded by `--reconcile-timeout`, in one
//!    span ([`instrumented_reconcile`]), its errors through [`error_policy`]. The process
//!    is ready once every controller's store has synced.
//!
//! A process may run more controllers than one (the database-controller's server
//! controller, the backup-controller's scheduler): each has its own [`Context`] (its
//! `controller` metrics label, its Events' reporter, its backoff); they share the client,
//! the health server, `/metrics`, the Lease and the shutdown, and one watch of each kind
//! that more than one of them follows ([`Running::shared_watch`], then
//! [`Running::controller_on`] for the kind's own controller and
//! [`crate::shared_watch::SharedWatch::touched`] for the others).

mod reconcile;

use std::{
    fmt::Debug,
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dbops_api::HasConditions;
use futures::StreamExt;
use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};
use kube::{
    Api, Client, Resource,
    api::ListParams,
    runtime::{
        Predicate, WatchStreamExt,
        controller::{self, Action, Controller},
        predicates,
        reflector::{self, ObjectRef, reflector},
        watcher::{self, watcher},
    },
};
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use self::reconcile::{
    Bounded, Context, ErrorKind, ReconcileError, bounded, conditions_of, error_policy,
    instrumented_reconcile, reporter, retry_of,
};
pub use crate::shared_watch::Trigger;
use crate::{
    backoff::BackoffKey,
    backup_store::{BackupStore, registry},
    cli::{CliError, CommonArgs},
    client::{ClientError, rate_limited_client},
    health::{self, HealthError, HealthState},
    leader::{self, LeaderError, LeaseSettings},
    metrics::Metrics,
    shared_watch::SharedWatch,
    shutdown::{self, ShutdownError},
    watch_health::{self, Stall, WatchHealth},
};

/// How long running reconciles may take to finish after SIGTERM/SIGINT.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long a process whose backup store failed its check waits before checking again.
const STORE_CHECK_RETRY: Duration = Duration::from_secs(10);

/// A controller process that has started (see the module documentation).
pub struct Process {
    controller: &'static str,
    args: CommonArgs,
    client: Client,
    health: HealthState,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    listener: TcpListener,
}

impl Process {
    /// Step 1: flags, signal handlers, the health listener, the client, and the CRD of
    /// `K` (the process's main kind) served. `controller` names the process: its metrics,
    /// its Lease `dbops-<controller>`.
    pub async fn start<K: Watched>(
        controller: &'static str,
        args: &CommonArgs,
    ) -> Result<Self, ControllerError> {
        args.validate()?;
        WatchHealth::init_process(args.api_timeout);
        let shutdown = shutdown::on_signals()?;
        let listener = health::bind(args.metrics_addr).await?;
        let client = rate_limited_client(args.api_rate_limit, args.api_timeout).await?;
        ensure_crd_served::<K>(&client, args.watch_namespace.as_deref()).await?;
        Ok(Self {
            controller,
            args: args.clone(),
            client,
            health: HealthState::new(args.leader_elect),
            metrics: Arc::new(Metrics::new(controller)),
            shutdown,
            listener,
        })
    }

    /// The process's metrics, on which each controller registers the families only it has
    /// (`Metrics::register`) before the Lease, so every replica shows them.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The process's rate-limited client, for what starts before the controllers (the
    /// DatabaseServer directory: its caches fill while the backup store is checked and the
    /// Lease is taken, as the first reconciles read them).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Steps 2 and 3: runs `controllers` (only while leader with `--leader-elect`, and
    /// after `backup_store` passed its check) until SIGTERM or SIGINT.
    pub async fn run<F, Fut>(
        self,
        backup_store: Option<&BackupStore>,
        controllers: F,
    ) -> Result<(), ControllerError>
    where
        F: FnOnce(Running) -> Fut,
        Fut: Future<Output = ()>,
    {
        let Self {
            controller,
            args,
            client,
            health,
            metrics,
            shutdown,
            listener,
        } = self;
        // Whichever of the two ends first stops the other.
        let server = async {
            let served = health::serve_on(
                listener,
                health.clone(),
                metrics.clone(),
                shutdown.clone().cancelled_owned(),
            )
            .await;
            shutdown.cancel();
            served
        };
        let running = |stop: CancellationToken| Running {
            client: client.clone(),
            args: Arc::new(args.clone()),
            health: health.clone(),
            metrics: metrics.clone(),
            unsynced: Arc::default(),
            stop,
        };
        let work = async {
            if let Some(store) = backup_store {
                let namespace = &args.controller_namespace;
                if !wait_for_backup_store(&client, namespace, store, &health, &shutdown).await {
                    tracing::info!("stopped while waiting for the backup store");
                    shutdown.cancel();
                    return Ok(());
                }
            }
            let result = if args.leader_elect {
                let lease = LeaseSettings::new(controller, &args.controller_namespace);
                let lead = |stop| controllers(running(stop));
                leader::run_as_leader(client.clone(), lease, &health, shutdown.clone(), lead).await
            } else {
                controllers(running(shutdown.clone())).await;
                Ok(())
            };
            shutdown.cancel();
            result
        };
        // A watch that keeps failing ends the process (see `watch_health`).
        let work = async {
            let mut work = std::pin::pin!(work);
            tokio::select! {
                worked = &mut work => worked.map_err(ControllerError::from),
                stall = watch_health::watchdog(
                    WatchHealth::process(), args.watch_stall_timeout, &shutdown,
                ) => {
                    // Stopped like on SIGTERM (running reconciles get their grace period).
                    shutdown.cancel();
                    let _ = work.await;
                    Err(ControllerError::WatchStalled(stall))
                }
            }
        };
        let (served, worked) = tokio::join!(server, work);
        served?;
        worked?;
        tracing::info!("stopped");
        Ok(())
    }
}

/// What the wiring of a running process builds its controllers with.
#[derive(Clone)]
pub struct Running {
    client: Client,
    args: Arc<CommonArgs>,
    health: HealthState,
    metrics: Arc<Metrics>,
    /// Controllers built whose store has not synced yet: ready at none.
    unsynced: Arc<AtomicUsize>,
    /// Cancelled on SIGTERM/SIGINT, a lost Lease or a stalled watch.
    stop: CancellationToken,
}

impl Running {
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// `--watch-namespace`: where the namespaced kinds are watched (all namespaces when
    /// `None`).
    pub fn namespace(&self) -> Option<&str> {
        self.args.watch_namespace.as_deref()
    }

    /// The process's flags.
    pub fn args(&self) -> &CommonArgs {
        &self.args
    }

    /// The context of the controller `controller` (for example `server-controller`): its
    /// own `controller` metrics label, Events reporter `dbops-<controller>` and backoff.
    pub fn context<S>(&self, controller: &'static str, state: S) -> Arc<Context<S>> {
        Arc::new(Context::new(
            controller,
            self.client.clone(),
            &self.args,
            self.health.clone(),
            Arc::new(self.metrics.for_controller(controller)),
            state,
        ))
    }

    /// A kube-runtime `Controller` of the `K`s `config` selects: its store keeps no
    /// `managedFields` and no last-applied copy ([`slim`]), lists pages of
    /// [`LIST_PAGE_SIZE`], runs `--concurrency` reconciles at once
    /// (kube's `with_config` sets another), stops on SIGTERM, and starts a reconcile on
    /// what `trigger` says. Build every controller of the process before driving any: the
    /// process is ready once all of them have synced.
    pub fn controller<K: Watched>(
        &self,
        config: watcher::Config,
        trigger: Trigger,
    ) -> Controller<K> {
        self.unsynced.fetch_add(1, Ordering::AcqRel);
        let api: Api<K> = api_of(self.client.clone(), self.namespace());
        let (reader, writer) = reflector::store();
        let objects = reflector(
            writer,
            watcher(api, config.page_size(LIST_PAGE_SIZE))
                .default_backoff()
                .modify(|o| slim(o.meta_mut())),
        )
        .applied_objects();
        let controller = match trigger {
            Trigger::AnyChange => Controller::for_stream(objects, reader),
            Trigger::GenerationChange => Controller::for_stream(
                objects.predicate_filter(predicates::generation, Default::default()),
                reader,
            ),
            Trigger::GenerationOrAnnotations => Controller::for_stream(
                objects.predicate_filter(
                    predicates::generation.combine(predicates::annotations),
                    Default::default(),
                ),
                reader,
            ),
        };
        self.configured(controller)
    }

    /// One watch of `K` ([`SharedWatch`]) for the controllers of the process: pages of
    /// [`LIST_PAGE_SIZE`], no `managedFields` nor last-applied copy in its store ([`slim`]),
    /// its own backoff. Subscribe, build the controller on it ([`Running::controller_on`]),
    /// then start it and hold its task while the controllers run.
    pub fn shared_watch<K: Watched>(&self, config: watcher::Config) -> SharedWatch<K> {
        let api: Api<K> = api_of(self.client.clone(), self.namespace());
        let events = watcher(api, config.page_size(LIST_PAGE_SIZE))
            .default_backoff()
            .modify(|o| slim(o.meta_mut()));
        SharedWatch::new(K::kind(&()).into_owned(), events)
    }

    /// [`Running::controller`] over a [`SharedWatch`] of `K`: its store, and the changes
    /// `trigger` selects.
    pub fn controller_on<K: Watched>(
        &self,
        watch: &SharedWatch<K>,
        trigger: Trigger,
    ) -> Controller<K> {
        self.unsynced.fetch_add(1, Ordering::AcqRel);
        let controller = Controller::for_shared_stream(watch.applied(trigger), watch.store());
        self.configured(controller)
    }

    /// `--concurrency` (or the kind's default), each watch its own backoff, stopped with
    /// the process.
    fn configured<K: Watched>(&self, controller: Controller<K>) -> Controller<K> {
        controller
            .with_config(
                controller::Config::default().concurrency(
                    self.args
                        .concurrency
                        .unwrap_or_else(|| default_concurrency(&K::kind(&()))),
                ),
            )
            // Each watch backs off on its own (`default_backoff` above, [`trigger`] for the
            // others). kube's default puts one backoff around all of a controller's
            // watches together: after a kube-apiserver restart, each watch's error in turn
            // paused every other watch, up to 30 s at a time, and as long as some watch
            // erred the pauses did not reset, so a controller's own watch went minutes
            // without a request (issue 35).
            .trigger_backoff(EachWatchItsOwn)
            .graceful_shutdown_on(self.stop.clone().cancelled_owned())
    }

    /// One controller's store has synced: the process is ready once all have.
    fn store_synced(&self) {
        if self.unsynced.fetch_sub(1, Ordering::AcqRel) == 1 {
            tracing::info!("every watch store synced; ready");
            self.health.set_ready(true);
        }
    }

    /// Runs `controller` until the process stops, then lets running reconciles finish
    /// (for at most [`SHUTDOWN_GRACE`]). Each reconcile is bounded by
    /// `--reconcile-timeout` and instrumented ([`instrumented_reconcile`]); errors go
    /// through [`error_policy`]; what the stream reports is logged ([`log_result`]).
    pub async fn drive<K, S, F, Fut, E>(
        &self,
        controller: Controller<K>,
        ctx: Arc<Context<S>>,
        mut reconcile: F,
    ) where
        K: Watched,
        S: Send + Sync + 'static,
        F: FnMut(Arc<K>, Arc<Context<S>>) -> Fut,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let store = controller.store();
        let counted = store.clone();
        ctx.metrics.count_resources(&K::kind(&()), move || {
            counted
                .state()
                .iter()
                .flat_map(|obj| conditions_of(obj.as_ref()))
                .collect()
        });
        let synced = AtomicBool::new(false);
        let readiness = async {
            if crate::store_ready::until_ready(&store).await.is_ok() {
                tracing::info!(controller = ctx.controller, "watch store synced");
                synced.store(true, Ordering::Release);
                self.store_synced();
            }
        };
        let results_ctx = ctx.clone();
        let limit = self.args.reconcile_timeout;
        let reconciles = controller
            .run(
                move |obj, ctx| {
                    // The reconcile's future on the heap, once: passed by value, the span's
                    // wrapper would hold a copy of its state beside its own, and the task
                    // the runner spawns per reconcile was 121 KB for the
                    // database-controller's 20 KB reconcile.
                    let work = Box::pin(bounded(reconcile(obj.clone(), ctx.clone()), limit));
                    instrumented_reconcile(obj, ctx, work)
                },
                error_policy,
                ctx.clone(),
            )
            .for_each(move |result| {
                log_result(&results_ctx, result);
                std::future::ready(())
            });
        tracing::info!(
            controller = ctx.controller,
            kind = %K::kind(&()),
            namespace = self.namespace().unwrap_or("<all>"),
            "controller started"
        );
        // kube-runtime's graceful shutdown waits for in-flight reconciles, but never ends
        // if it starts before the first watch sync (the runner is held until the store is
        // ready). So: before the sync nothing runs and nothing is waited for; after it,
        // reconciles get a bounded grace period.
        let grace = async {
            self.stop.cancelled().await;
            if synced.load(Ordering::Acquire) {
                tokio::time::sleep(SHUTDOWN_GRACE).await;
                tracing::warn!(
                    grace = ?SHUTDOWN_GRACE,
                    "reconciles did not finish in time; abandoning them"
                );
            } else {
                tracing::info!("stopping before the first watch sync");
            }
        };
        tokio::select! {
            _ = async { tokio::join!(readiness, reconciles) } => {}
            () = grace => {}
        }
    }
}

/// Why a controller process stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Flags(#[from] CliError),
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("CRD {crd} is not installed")]
    CrdNotInstalled { crd: String },
    #[error("cannot list {crd}: {source}")]
    CrdCheck { crd: String, source: kube::Error },
    #[error(transparent)]
    Health(#[from] HealthError),
    #[error(transparent)]
    Leader(#[from] LeaderError),
    #[error(
        "the {} watch has failed without a break for {:.0} s ({} failures, the last: {}); exiting so that a fresh process lists everything anew",
        .0.watch, .0.failing_for.as_secs_f64(), .0.failures, .0.last_error
    )]
    WatchStalled(Stall),
}

/// How the runner lists a kind: namespaced kinds in `--watch-namespace` (or all
/// namespaces), cluster-scoped kinds everywhere.
pub trait ApiScope {
    fn api<K>(client: Client, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = Self>;
}

impl ApiScope for NamespaceResourceScope {
    fn api<K>(client: Client, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = Self>,
    {
        scoped_api(client, namespace)
    }
}

impl ApiScope for ClusterResourceScope {
    fn api<K>(client: Client, _namespace: Option<&str>) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = Self>,
    {
        Api::all(client)
    }
}

/// What the runner needs of a controller's kind: typed and watchable, namespaced or
/// cluster-scoped, and [`Stored`].
pub trait Watched: Resource<DynamicType = (), Scope: ApiScope> + HasConditions + Stored {}

impl<K: Resource<DynamicType = (), Scope: ApiScope> + HasConditions + Stored> Watched for K {}

/// What an object kept in a watch store must be: decoded, cloned, shown and shared
/// between tasks.
pub trait Stored: Clone + DeserializeOwned + Debug + Send + Sync + 'static {}

impl<K: Clone + DeserializeOwned + Debug + Send + Sync + 'static> Stored for K {}

/// The objects a watch of `api` sees change, for a controller's `owns_stream` or
/// `watches_stream`: retried with its own backoff, as every watch of a [`Running::controller`]
/// must be (kube's `owns` and `watches` leave the backoff to the controller, which
/// [`EachWatchItsOwn`] does not do).
pub fn trigger<K: Resource + Stored>(
    api: Api<K>,
    config: watcher::Config,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    watcher(api, config).default_backoff().touched_objects()
}

/// `--concurrency` when not given, by kind: 16 where a reconcile is a few SQL statements
/// and API requests (a Database: 1,000 created at once are Ready about twice as fast as
/// with 4, see docs/benchmarks.md), 4 where one may stream a dump or run a migration
/// step (Backup, Migration) or probe a server.
fn default_concurrency(kind: &str) -> u16 {
    match kind {
        "Database" | "DatabaseUser" => 16,
        _ => 4,
    }
}

/// The backoff of a controller's watches taken together: none, since each watch has its
/// own (see [`Running::controller`]).
#[derive(Clone, Copy, Debug)]
struct EachWatchItsOwn;

impl Iterator for EachWatchItsOwn {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl kube::runtime::utils::Backoff for EachWatchItsOwn {
    fn reset(&mut self) {}
}

/// The annotation client-side `kubectl apply` leaves on what it applied: a copy of the
/// whole object as applied.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// What a watch store keeps of an object's metadata: neither its `managedFields` nor the
/// copy of the object `kubectl apply` left in [`LAST_APPLIED`]. Nothing reads them, and
/// on a small object they weigh more than the rest (issue 35: memory per object).
pub fn slim(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    meta.managed_fields = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

/// `K`'s API as the runner lists it.
pub fn api_of<K: Watched>(client: Client, namespace: Option<&str>) -> Api<K> {
    <K::Scope as ApiScope>::api::<K>(client, namespace)
}

/// Checks the backup store ([`registry::check`]: writable, and the store registered in
/// the ConfigMap `dbops-backup-store` of the controllers' namespace) until it passes,
/// then returns `true`; `false` when `stop` is cancelled first (SIGTERM ends a wait at
/// once, even inside a check). While it fails: the reason is logged at warn, `/readyz`
/// answers 503 with it (`/healthz` stays 200), and it is checked again every
/// [`STORE_CHECK_RETRY`]; each store operation and API call of a check is bounded.
pub async fn wait_for_backup_store(
    client: &Client,
    namespace: &str,
    store: &BackupStore,
    health: &HealthState,
    stop: &CancellationToken,
) -> bool {
    health.set_blocked(Some(format!(
        "checking the backup store {store} (the first check has not finished)"
    )));
    loop {
        let checked = tokio::select! {
            checked = registry::check(client, namespace, store) => checked,
            () = stop.cancelled() => return false,
        };
        match checked {
            Ok(registered) => {
                health.set_blocked(None);
                tracing::info!(
                    backup_store = %store,
                    identity = %registered.identity,
                    registration = %format_args!("{namespace}/{}", registry::CONFIG_MAP),
                    registered_now = registered.created,
                    "backup store checked: writable and the registered one"
                );
                return true;
            }
            Err(error) => {
                let reason = error.reason().as_str();
                tracing::warn!(
                    reason,
                    backup_store = %store,
                    retry_in = ?STORE_CHECK_RETRY,
                    "not starting the controllers: {error}"
                );
                health.set_blocked(Some(format!("{reason}: {error}")));
            }
        }
        tokio::select! {
            () = tokio::time::sleep(STORE_CHECK_RETRY) => {}
            () = stop.cancelled() => return false,
        }
    }
}

/// The process exit code for what [`Process::start`] or [`Process::run`] returned; the error is logged.
pub fn exit_code(result: Result<(), ControllerError>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Fails with [`ControllerError::CrdNotInstalled`] when the API server does not serve `K`.
pub async fn ensure_crd_served<K>(
    client: &Client,
    namespace: Option<&str>,
) -> Result<(), ControllerError>
where
    K: Watched,
{
    let crd = format!("{}.{}", K::plural(&()), K::group(&()));
    let api: Api<K> = api_of(client.clone(), namespace);
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            Err(ControllerError::CrdNotInstalled { crd })
        }
        Err(source) => Err(ControllerError::CrdCheck { crd, source }),
    }
}

/// `K` in one namespace (`--watch-namespace`), or in all of them.
pub fn scoped_api<K>(client: Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    match namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::all(client),
    }
}

/// Objects per page of a watch's list (kube's default is 500). A page is held twice while
/// it is read (the response and the objects made of it), and what a start-up reads in
/// large pages stays as the process's resident size long after: 100 keeps that small
/// at the cost of more list requests (100 for 10,000 objects).
pub const LIST_PAGE_SIZE: u32 = 100;

/// Logs what the controller stream reports; nothing is dropped silently.
fn log_result<K, S, E>(
    ctx: &Context<S>,
    result: Result<(ObjectRef<K>, Action), controller::Error<E, watcher::Error>>,
) where
    K: Resource<DynamicType = ()>,
    E: ReconcileError,
{
    match result {
        Ok((object, action)) => tracing::debug!(%object, ?action, "reconciled"),
        // Expected after a deletion (kube-rs/kube#1167): the requeue outlived the object.
        Err(controller::Error::ObjectNotFound(object)) => {
            tracing::debug!(%object, "object is gone; forgetting its backoff");
            ctx.backoff
                .forget(&BackoffKey::for_object_ref(object.as_ref()));
        }
        Err(controller::Error::ReconcilerFailed(error, object)) => {
            tracing::warn!(%object, reason = error.reason(), error = %error, "reconcile failed");
        }
        Err(controller::Error::QueueError(error)) => {
            // Its health is the client's to tell (watch_health.rs): the request that failed
            // names the watch, which this stream does not.
            tracing::warn!(%error, "watch failed; retrying with backoff");
        }
        Err(controller::Error::RunnerError(error)) => {
            tracing::error!(%error, "controller runner failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{Request, Response};
    use kube::client::Body;

    use super::*;

    #[test]
    fn a_stored_object_keeps_its_own_annotations_only() {
        let mut meta = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            annotations: Some(
                [
                    (LAST_APPLIED.to_string(), "{\"spec\":{}}".to_string()),
                    ("dbops.dev/rotate".to_string(), "1".to_string()),
                ]
                .into(),
            ),
            managed_fields: Some(vec![Default::default()]),
            ..Default::default()
        };
        slim(&mut meta);
        assert_eq!(meta.managed_fields, None);
        let annotations = meta.annotations.unwrap_or_default();
        assert_eq!(annotations.keys().collect::<Vec<_>>(), ["dbops.dev/rotate"]);
    }

    #[tokio::test]
    async fn a_process_is_ready_once_every_controller_has_synced() {
        let (service, _handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let args = <CommonArgs as clap::FromArgMatches>::from_arg_matches(
            &<CommonArgs as clap::Args>::augment_args(clap::Command::new("test"))
                .get_matches_from(["test"]),
        )
        .expect("the default flags");
        let health = HealthState::new(false);
        let running = Running {
            client: Client::new(service, "default"),
            args: Arc::new(args),
            health: health.clone(),
            metrics: Arc::new(Metrics::new("test-controller")),
            unsynced: Arc::default(),
            stop: CancellationToken::new(),
        };
        let _backups =
            running.controller::<dbops_api::Backup>(watcher::Config::default(), Trigger::AnyChange);
        let _databases = running.controller::<dbops_api::Database>(
            watcher::Config::default(),
            Trigger::GenerationChange,
        );
        running.store_synced();
        assert!(!health.is_ready(), "one of two controllers synced");
        running.store_synced();
        assert!(health.is_ready());
    }
}
