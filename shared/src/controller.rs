//! The runner all three controllers share: startup checks, the kube-runtime `Controller`,
//! one instrumented span per reconcile, per-object backoff, health and metrics.
//!
//! [`run`] is the whole life of a controller process:
//! 1. install the SIGTERM/SIGINT handlers;
//! 2. build the rate-limited client and check that the CRD of `K` is served;
//! 3. serve /healthz, /readyz and /metrics on `--metrics-addr`;
//! 4. with a backup store ([`Options::backup_store`]), wait until it passes its startup
//!    check (see [`wait_for_backup_store`]), not ready meanwhile;
//! 5. run the `Controller` (only while leader with `--leader-elect`) until a signal;
//! 6. let in-flight reconciles finish, release the Lease, stop the health server.
//!
//! [`run_with`] does the same with [`Options`]: a backup store to check first (the
//! backup-controller and the database-controller), and companions for a process that
//! runs more controllers than one (the backup-controller's scheduler beside its Backup
//! controller): each [`Companion`] shares the signals, client, health server, `/metrics`
//! (under its own `controller` label), Lease and shutdown, and the process is ready once
//! every watch store has synced.

use std::{
    convert::Infallible,
    fmt::Debug,
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dbops_api::HasConditions;
use futures::{StreamExt, future::BoxFuture};
use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};
use kube::{
    Api, Client, Resource,
    api::ListParams,
    runtime::{
        WatchStreamExt,
        controller::{self, Action, Controller},
        events::Reporter,
        predicates,
        reflector::{self, ObjectRef, reflector},
        watcher::{self, watcher},
    },
};
use serde::{Serialize, de::DeserializeOwned};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, field};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    backoff::{Backoff, BackoffKey, BackoffTracker},
    backup_store::{BackupStore, registry},
    cli::{CliError, CommonArgs},
    client::{ClientError, rate_limited_client},
    health::{self, HealthError, HealthState},
    leader::{self, LeaderError, LeaseSettings},
    metrics::{Metrics, Outcome},
    shutdown::{self, ShutdownError},
    telemetry::{TRACEPARENT_ANNOTATION, current_trace_id, remote_parent},
    watch_health::{self, Stall, WatchHealth},
};

/// How long running reconciles may take to finish after SIGTERM/SIGINT.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long a process whose backup store failed its check waits before checking again.
const STORE_CHECK_RETRY: Duration = Duration::from_secs(10);

/// What the error policy does with a reconcile error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Retrying may help (server or API unavailable): requeue with per-object backoff.
    Transient,
    /// The spec cannot work as written: report it and wait for the object to change.
    InvalidSpec,
}

/// Implemented by each controller's reconcile error enum.
pub trait ReconcileError: std::error::Error + Send + Sync + 'static {
    fn kind(&self) -> ErrorKind;
    /// A short CamelCase label for metrics and traces, for example `ServerUnavailable`.
    fn reason(&self) -> &'static str;
}

/// A reconcile's own error, or the runner's bound on its duration.
#[derive(Debug, thiserror::Error)]
pub enum Bounded<E> {
    #[error(transparent)]
    Reconcile(E),
    #[error("the reconcile did not finish within {0:?} (--reconcile-timeout) and was abandoned")]
    TimedOut(Duration),
}

impl<E: ReconcileError> ReconcileError for Bounded<E> {
    fn kind(&self) -> ErrorKind {
        match self {
            Bounded::Reconcile(e) => e.kind(),
            Bounded::TimedOut(_) => ErrorKind::Transient,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Bounded::Reconcile(e) => e.reason(),
            Bounded::TimedOut(_) => "ReconcileTimeout",
        }
    }
}

/// `work` with a deadline: past `limit` it is dropped (a child program killed, a
/// session given back; every step resumes from what it recorded) and fails as
/// [`Bounded::TimedOut`], retried with backoff.
pub async fn bounded<E>(
    work: impl Future<Output = Result<Action, E>>,
    limit: Duration,
) -> Result<Action, Bounded<E>> {
    match tokio::time::timeout(limit, work).await {
        Ok(result) => result.map_err(Bounded::Reconcile),
        Err(_) => {
            tracing::warn!(?limit, "reconcile abandoned at its time limit");
            Err(Bounded::TimedOut(limit))
        }
    }
}

/// For reconcilers that cannot fail.
impl ReconcileError for Infallible {
    fn kind(&self) -> ErrorKind {
        match *self {}
    }

    fn reason(&self) -> &'static str {
        match *self {}
    }
}

/// Everything a reconcile gets besides the object; `state` is the controller's own.
pub struct Context<S> {
    /// For example `database-controller`: the metrics label and the Lease suffix.
    pub controller: &'static str,
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub backoff: BackoffTracker,
    pub health: HealthState,
    /// Who publishes this controller's Events.
    pub reporter: Reporter,
    /// How long a converged object waits before its next reconcile.
    pub resync_interval: Duration,
    pub state: S,
}

impl<S> Context<S> {
    /// Who publishes the Events of `controller`: `dbops-<controller>`, instance `POD_NAME`.
    pub fn reporter_for(controller: &str) -> Reporter {
        Reporter {
            controller: format!("dbops-{controller}"),
            instance: std::env::var("POD_NAME").ok(),
        }
    }

    pub fn new(
        controller: &'static str,
        client: Client,
        args: &CommonArgs,
        health: HealthState,
        metrics: Arc<Metrics>,
        state: S,
    ) -> Self {
        Self {
            controller,
            client,
            metrics,
            backoff: BackoffTracker::new(Backoff {
                base: args.backoff_base,
                max: args.backoff_max,
            }),
            health,
            reporter: Self::reporter_for(controller),
            resync_interval: args.resync_interval,
            state,
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
/// cluster-scoped.
pub trait Watched:
    Resource<DynamicType = (), Scope: ApiScope>
    + HasConditions
    + Clone
    + DeserializeOwned
    + Serialize
    + Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = (), Scope: ApiScope>
        + HasConditions
        + Clone
        + DeserializeOwned
        + Serialize
        + Debug
        + Send
        + Sync
        + 'static
{
}

/// `K`'s API as the runner lists it.
pub fn api_of<K: Watched>(client: Client, namespace: Option<&str>) -> Api<K> {
    <K::Scope as ApiScope>::api::<K>(client, namespace)
}

/// Which changes of the controller's own kind start a reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// Every change, status included.
    AnyChange,
    /// Only a new `metadata.generation` (spec changes and the start of deletion): the
    /// controller's own status writes then start no reconcile. Requeues, and the extra
    /// watches, still do.
    GenerationChange,
}

/// Adds a controller's own watches (owned children, related kinds) to its `Controller`.
pub type Configure<K, S> = Box<dyn FnOnce(Controller<K>, &Arc<Context<S>>) -> Controller<K> + Send>;

/// Runs the controller of kind `K` until SIGTERM or SIGINT; see the module documentation.
/// `configure` adds the controller's extra watches.
pub async fn run<K, S, F, Fut, E>(
    controller: &'static str,
    args: &CommonArgs,
    state: impl FnOnce(Client, Reporter) -> S,
    trigger: Trigger,
    configure: Configure<K, S>,
    reconcile: F,
) -> Result<(), ControllerError>
where
    K: Watched,
    S: Send + Sync + 'static,
    F: FnMut(Arc<K>, Arc<Context<S>>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: ReconcileError,
{
    run_with(
        controller,
        args,
        state,
        trigger,
        configure,
        reconcile,
        Options::default(),
    )
    .await
}

/// What [`run_with`] checks and runs besides the controller of `K`.
#[derive(Default)]
pub struct Options {
    /// Further controllers of the same process, started and stopped with the main one.
    pub companions: Vec<Companion>,
    /// The process's `--backup-store` (the backup-controller writes it, the
    /// database-controller reads it): checked before leader election and the
    /// controllers start, see [`wait_for_backup_store`].
    pub backup_store: Option<BackupStore>,
}

/// A further controller of the same process, run by [`run_with`] beside its main one.
/// Its reconciles are counted under its own `controller` label; its Events name it as
/// `dbops-<controller>`; the Lease stays the main controller's.
pub struct Companion {
    start: Box<dyn FnOnce(Shared) -> BoxFuture<'static, ()> + Send>,
    /// Its own `--concurrency`, when not the process's.
    concurrency: Option<u16>,
}

/// What the runner hands a companion when the controllers start.
struct Shared {
    client: Client,
    args: CommonArgs,
    health: HealthState,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    stop: CancellationToken,
}

impl Companion {
    /// A controller of kind `K`, configured like [`run`]'s; `config` selects which
    /// objects of `K` it watches.
    pub fn new<K, S, F, Fut, E>(
        controller: &'static str,
        config: watcher::Config,
        state: impl FnOnce(Client, Reporter) -> S + Send + 'static,
        trigger: Trigger,
        configure: Configure<K, S>,
        reconcile: F,
    ) -> Self
    where
        K: Watched,
        S: Send + Sync + 'static,
        F: FnMut(Arc<K>, Arc<Context<S>>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let start = move |shared: Shared| -> BoxFuture<'static, ()> {
            Box::pin(async move {
                let reporter = Context::<S>::reporter_for(controller);
                let state = state(shared.client.clone(), reporter);
                let ctx = Arc::new(Context::new(
                    controller,
                    shared.client,
                    &shared.args,
                    shared.health,
                    Arc::new(shared.metrics.for_controller(controller)),
                    state,
                ));
                run_controller(
                    ctx,
                    &shared.args,
                    config,
                    trigger,
                    configure,
                    reconcile,
                    shared.readiness,
                    shared.stop,
                )
                .await;
            })
        };
        Self {
            start: Box::new(start),
            concurrency: None,
        }
    }

    /// Reconciles at most `concurrency` objects at once (at least 1), whatever the
    /// process's `--concurrency` says.
    pub fn with_concurrency(self, concurrency: u16) -> Self {
        Self {
            concurrency: Some(concurrency.max(1)),
            ..self
        }
    }
}

/// Marks the process ready once each of its controllers has synced its watch store.
#[derive(Clone)]
struct Readiness {
    health: HealthState,
    pending: Arc<AtomicUsize>,
}

impl Readiness {
    fn new(health: HealthState, controllers: usize) -> Self {
        Self {
            health,
            pending: Arc::new(AtomicUsize::new(controllers)),
        }
    }

    /// One controller's store has synced.
    fn synced(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.health.set_ready(true);
        }
    }
}

/// [`run`], with `options`: the companions run beside the controller of `K` in the same
/// process, started and stopped with it (and only while leader with `--leader-elect`);
/// the backup store checked before any of them starts.
pub async fn run_with<K, S, F, Fut, E>(
    controller: &'static str,
    args: &CommonArgs,
    state: impl FnOnce(Client, Reporter) -> S,
    trigger: Trigger,
    configure: Configure<K, S>,
    reconcile: F,
    options: Options,
) -> Result<(), ControllerError>
where
    K: Watched,
    S: Send + Sync + 'static,
    F: FnMut(Arc<K>, Arc<Context<S>>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: ReconcileError,
{
    let Options {
        companions,
        backup_store,
    } = options;
    args.validate()?;
    let watch_health = WatchHealth::init_process(args.api_timeout);
    let shutdown = shutdown::on_signals()?;
    let listener = health::bind(args.metrics_addr).await?;
    let client = rate_limited_client(args.api_rate_limit, args.api_timeout).await?;
    ensure_crd_served::<K>(&client, args.watch_namespace.as_deref()).await?;

    let metrics = Arc::new(Metrics::new(controller));
    let health = HealthState::new(args.leader_elect);
    let reporter = Context::<S>::reporter_for(controller);
    let state = state(client.clone(), reporter);
    let ctx = Arc::new(Context::new(
        controller,
        client.clone(),
        args,
        health.clone(),
        metrics.clone(),
        state,
    ));

    // Every controller of the process, until `stop`.
    let controllers = |stop: CancellationToken| {
        let readiness = Readiness::new(health.clone(), 1 + companions.len());
        let others = companions.into_iter().map(|companion| {
            let mut args = args.clone();
            if let Some(concurrency) = companion.concurrency {
                args.concurrency = concurrency;
            }
            (companion.start)(Shared {
                client: client.clone(),
                args,
                health: health.clone(),
                metrics: metrics.clone(),
                readiness: readiness.clone(),
                stop: stop.clone(),
            })
        });
        let others = futures::future::join_all(others);
        let main = run_controller(
            ctx,
            args,
            watcher::Config::default(),
            trigger,
            configure,
            reconcile,
            readiness,
            stop,
        );
        async move {
            tokio::join!(main, others);
        }
    };

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
    let work = async {
        if let Some(store) = &backup_store {
            let namespace = &args.controller_namespace;
            if !wait_for_backup_store(&client, namespace, store, &health, &shutdown).await {
                tracing::info!("stopped while waiting for the backup store");
                shutdown.cancel();
                return Ok(());
            }
        }
        let result = if args.leader_elect {
            let lease = LeaseSettings::new(controller, &args.controller_namespace);
            leader::run_as_leader(
                client.clone(),
                lease,
                &health,
                shutdown.clone(),
                controllers,
            )
            .await
        } else {
            controllers(shutdown.clone()).await;
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
            stall = watch_health::watchdog(watch_health, args.watch_stall_timeout, &shutdown) => {
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
                let reason = error.reason();
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

/// The process exit code for what [`run`] returned; the error is logged.
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

/// Runs the kube-runtime `Controller` for `K` until `stop` is cancelled, then lets running
/// reconciles finish. Marks the health state ready once the watch store has synced.
///
/// `Controller::new` already applies kube's default backoff to its watch stream, so a
/// failing watch is retried with backoff rather than in a hot loop.
#[allow(clippy::too_many_arguments)]
async fn run_controller<K, S, F, Fut, E>(
    ctx: Arc<Context<S>>,
    args: &CommonArgs,
    config: watcher::Config,
    trigger: Trigger,
    configure: Configure<K, S>,
    mut reconcile: F,
    readiness: Readiness,
    stop: CancellationToken,
) where
    K: Watched,
    S: Send + Sync + 'static,
    F: FnMut(Arc<K>, Arc<Context<S>>) -> Fut,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: ReconcileError,
{
    let api: Api<K> = api_of(ctx.client.clone(), args.watch_namespace.as_deref());
    // The cache keeps no `managedFields`: nothing here reads them, and on a small object
    // they weigh more than the rest of it.
    let (reader, writer) = reflector::store();
    let objects = reflector(
        writer,
        watcher(api, config.page_size(LIST_PAGE_SIZE))
            .default_backoff()
            .modify(|o| o.meta_mut().managed_fields = None),
    )
    .applied_objects();
    let controller = match trigger {
        Trigger::AnyChange => Controller::for_stream(objects, reader),
        Trigger::GenerationChange => Controller::for_stream(
            objects.predicate_filter(predicates::generation, Default::default()),
            reader,
        ),
    };
    let controller = controller
        .with_config(controller::Config::default().concurrency(args.concurrency))
        .graceful_shutdown_on(stop.clone().cancelled_owned());
    let controller = configure(controller, &ctx);

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
        if store.wait_until_ready().await.is_ok() {
            tracing::info!("watch store synced; ready");
            synced.store(true, Ordering::Release);
            readiness.synced();
        }
    };

    let results_ctx = ctx.clone();
    let reconcile_timeout = args.reconcile_timeout;
    let reconciles = controller
        .run(
            move |obj, ctx| {
                let work = bounded(reconcile(obj.clone(), ctx.clone()), reconcile_timeout);
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
        kind = %K::kind(&()),
        namespace = args.watch_namespace.as_deref().unwrap_or("<all>"),
        concurrency = args.concurrency,
        "controller started"
    );
    // kube-runtime's graceful shutdown waits for in-flight reconciles, but never ends if it
    // starts before the first watch sync (the runner is held until the store is ready). So:
    // before the sync nothing runs and nothing is waited for; after it, reconciles get a
    // bounded grace period.
    let grace = async {
        stop.cancelled().await;
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

/// Runs one reconcile inside its span (`controller`, `kind`, `object.namespace`,
/// `object.name`, `object.generation`, `outcome`, `error`, `trace_id`), timing it and
/// counting its outcome. A success resets the object's backoff.
///
/// The object fields are `object.*`, not `name`: JSON logs already use `name` for the
/// span's own name.
///
/// An object created (or changed) by another controller carries that controller's trace
/// context in the `dbops.dev/traceparent` annotation
/// ([`crate::telemetry::trace_annotation`]). Until the object is settled (`Ready` or
/// `Failed` is `True` for its current generation), its reconciles continue that trace as
/// children of the annotating span; afterwards (resyncs, cleanup) each reconcile is a trace
/// of its own with a link to it, so one trace never grows without end.
pub async fn instrumented_reconcile<K, S, E>(
    obj: Arc<K>,
    ctx: Arc<Context<S>>,
    work: impl Future<Output = Result<Action, E>>,
) -> Result<Action, E>
where
    K: Resource<DynamicType = ()> + HasConditions,
    E: ReconcileError,
{
    let meta = obj.meta();
    let span = tracing::info_span!(
        "reconcile",
        otel.name = %format_args!("reconcile {}", K::kind(&())),
        otel.status_code = field::Empty,
        controller = ctx.controller,
        kind = %K::kind(&()),
        object.namespace = meta.namespace.as_deref(),
        object.name = meta.name.as_deref(),
        object.generation = meta.generation,
        outcome = field::Empty,
        error = field::Empty,
        trace_id = field::Empty,
        trace.continued = field::Empty,
    );
    // Before the span is first entered: a parent can only be set on a span not yet started.
    if let Some(parent) = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(TRACEPARENT_ANNOTATION))
        .and_then(|value| remote_parent(value))
    {
        use opentelemetry::trace::TraceContextExt;
        if is_settled(obj.as_ref()) {
            span.add_link(parent.span().span_context().clone());
            span.record("trace.continued", "link");
        } else if span.set_parent(parent).is_ok() {
            span.record("trace.continued", "parent");
        }
    }
    async move {
        let span = tracing::Span::current();
        if let Some(trace_id) = current_trace_id() {
            span.record("trace_id", trace_id.as_str());
        }
        let metrics = ctx.metrics.controller();
        let _timer = metrics.reconcile_timer();
        let result = work.await;
        match &result {
            Ok(_) => {
                ctx.backoff.reset(&BackoffKey::for_object(obj.as_ref()));
                metrics.record_outcome(Outcome::Success);
                span.record("outcome", Outcome::Success.as_str());
            }
            Err(error) => {
                metrics.record_outcome(Outcome::Error);
                metrics.record_error(error.reason());
                span.record("outcome", Outcome::Error.as_str());
                span.record("otel.status_code", "ERROR");
                span.record("error", error.reason());
            }
        }
        result
    }
    .instrument(span)
    .await
}

/// `(type, status)` of each condition in the object's `status.conditions`.
pub fn conditions_of<K: HasConditions>(obj: &K) -> Vec<(String, String)> {
    obj.conditions()
        .iter()
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect()
}

/// Whether an object has reached an end state its creator's trace should not follow past:
/// `Ready` or `Failed` is `True` for its current generation (a condition without
/// `observedGeneration` counts as current). A spec change (for example the
/// migration-controller switching a Database's server) makes it unsettled again.
fn is_settled<K: Resource + HasConditions>(obj: &K) -> bool {
    let generation = obj.meta().generation;
    obj.conditions().iter().any(|c| {
        matches!(c.type_.as_str(), "Ready" | "Failed")
            && c.status == "True"
            && (c.observed_generation.is_none() || c.observed_generation == generation)
    })
}

/// Transient errors are retried after the object's next backoff delay; an invalid spec
/// waits for the object to change.
pub fn error_policy<K, S, E>(obj: Arc<K>, error: &E, ctx: Arc<Context<S>>) -> Action
where
    K: Resource,
    E: ReconcileError,
{
    let key = BackoffKey::for_object(obj.as_ref());
    match error.kind() {
        ErrorKind::Transient => {
            let delay = ctx.backoff.next_delay(&key);
            tracing::debug!(object = ?key, ?delay, "retrying after backoff");
            Action::requeue(delay)
        }
        ErrorKind::InvalidSpec => {
            ctx.backoff.reset(&key);
            Action::await_change()
        }
    }
}

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
            tracing::warn!(%error, "watch failed; retrying with backoff");
            // One streak for every watch that triggers this controller: the stream does
            // not say which one failed.
            WatchHealth::process().failed(&format!("{} controller's", ctx.controller), &error);
        }
        Err(controller::Error::RunnerError(error)) => {
            tracing::error!(%error, "controller runner failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use http::{Request, Response};
    use kube::{api::ObjectMeta, client::Body};

    use super::*;

    #[derive(Parser)]
    struct TestCli {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[derive(Debug, thiserror::Error)]
    enum TestError {
        #[error("server unavailable")]
        Unavailable,
        #[error("bad spec")]
        BadSpec,
    }

    impl ReconcileError for TestError {
        fn kind(&self) -> ErrorKind {
            match self {
                Self::Unavailable => ErrorKind::Transient,
                Self::BadSpec => ErrorKind::InvalidSpec,
            }
        }

        fn reason(&self) -> &'static str {
            match self {
                Self::Unavailable => "ServerUnavailable",
                Self::BadSpec => "InvalidSpec",
            }
        }
    }

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn context() -> (Arc<Context<()>>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let args = TestCli::parse_from(["test"]).common;
        let ctx = Context::new(
            "test-controller",
            client,
            &args,
            HealthState::new(false),
            Arc::new(Metrics::new("test-controller")),
            (),
        );
        (Arc::new(ctx), handle)
    }

    fn an_object() -> Arc<dbops_api::Backup> {
        let mut backup: dbops_api::Backup = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
            "metadata": {"name": "orders", "namespace": "default", "uid": "uid-1", "generation": 1},
            "spec": {"databaseRef": {"name": "orders"}}
        }))
        .expect("a valid Backup");
        backup.metadata = ObjectMeta {
            name: Some("orders".into()),
            namespace: Some("default".into()),
            uid: Some("uid-1".into()),
            generation: Some(1),
            ..ObjectMeta::default()
        };
        Arc::new(backup)
    }

    /// Asserts that nothing was sent through the mock once every client is dropped.
    async fn assert_no_api_call(ctx: Arc<Context<()>>, mut handle: Handle) {
        drop(ctx);
        let next = tokio::time::timeout(Duration::from_secs(5), handle.next_request()).await;
        assert!(
            matches!(next, Ok(None)),
            "the reconcile wrapper called the API"
        );
    }

    #[tokio::test]
    async fn a_reconcile_past_its_time_limit_is_abandoned_and_retried() {
        let never = std::future::pending::<Result<Action, TestError>>();
        let e = bounded(never, Duration::from_millis(10))
            .await
            .expect_err("a reconcile that never ends is cut");
        assert_eq!(e.reason(), "ReconcileTimeout");
        assert_eq!(e.kind(), ErrorKind::Transient);
        let quick = async { Ok::<_, TestError>(Action::await_change()) };
        assert!(bounded(quick, Duration::from_secs(1)).await.is_ok());
    }

    #[tokio::test]
    async fn the_wrapper_makes_no_api_call_and_counts_a_success() {
        let (ctx, handle) = context();
        let resync = Action::requeue(ctx.resync_interval);
        let action = instrumented_reconcile(an_object(), ctx.clone(), async {
            Ok::<_, Infallible>(Action::requeue(Duration::from_secs(300)))
        })
        .await
        .unwrap();
        assert_eq!(action, resync);
        let text = ctx.metrics.encode().unwrap();
        assert!(text.contains(r#"outcome="success"} 1"#));
        assert_no_api_call(ctx, handle).await;
    }

    #[tokio::test]
    async fn transient_errors_back_off_and_a_success_resets() {
        let (ctx, _handle) = context();
        let obj = an_object();
        let failed = instrumented_reconcile(obj.clone(), ctx.clone(), async {
            Err::<Action, _>(TestError::Unavailable)
        })
        .await;
        let error = failed.unwrap_err();
        // A requeue after the jittered first delay (its value is covered by backoff's tests).
        assert_ne!(
            error_policy(obj.clone(), &error, ctx.clone()),
            Action::await_change()
        );
        assert_eq!(ctx.backoff.len(), 1);

        instrumented_reconcile(obj.clone(), ctx.clone(), async {
            Ok::<_, TestError>(Action::await_change())
        })
        .await
        .unwrap();
        assert!(ctx.backoff.is_empty());
        let text = ctx.metrics.encode().unwrap();
        assert!(text.contains(r#"reason="ServerUnavailable"} 1"#));
    }

    #[test]
    fn a_process_is_ready_once_every_controller_has_synced() {
        let health = HealthState::new(false);
        let readiness = Readiness::new(health.clone(), 2);
        readiness.clone().synced();
        assert!(!health.is_ready(), "one of two controllers synced");
        readiness.synced();
        assert!(health.is_ready());
    }

    #[tokio::test]
    async fn an_invalid_spec_waits_for_a_change() {
        let (ctx, _handle) = context();
        assert_eq!(
            error_policy(an_object(), &TestError::BadSpec, ctx.clone()),
            Action::await_change()
        );
        assert!(ctx.backoff.is_empty());
    }

    /// Spans of reconciles run under an in-memory OpenTelemetry exporter.
    fn otel_subscriber() -> (
        impl tracing::Subscriber + Send + Sync,
        opentelemetry_sdk::trace::InMemorySpanExporter,
        opentelemetry_sdk::trace::SdkTracerProvider,
    ) {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt;
        let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        (
            tracing_subscriber::registry().with(layer),
            exporter,
            provider,
        )
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn annotated(conditions: serde_json::Value) -> Arc<dbops_api::Backup> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "dbops.dev/v1alpha1",
                "kind": "Backup",
                "metadata": {
                    "name": "orders-final", "namespace": "default", "uid": "uid-2",
                    "generation": 1,
                    "annotations": {TRACEPARENT_ANNOTATION: PARENT},
                },
                "spec": {"databaseRef": {"name": "orders"}},
                "status": {"conditions": conditions},
            }))
            .unwrap(),
        )
    }

    #[tokio::test]
    async fn an_unsettled_object_continues_its_creators_trace_and_passes_it_on() {
        let (subscriber, exporter, provider) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);
        let (ctx, _handle) = context();
        let obj = annotated(serde_json::json!([]));
        let passed_on = Arc::new(std::sync::Mutex::new(None));
        let writer = passed_on.clone();
        instrumented_reconcile(obj, ctx, async move {
            *writer.lock().unwrap() = crate::telemetry::trace_annotation();
            Ok::<_, Infallible>(Action::await_change())
        })
        .await
        .unwrap();
        let passed_on = passed_on.lock().unwrap().take().unwrap();
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let reconcile = spans.iter().find(|s| s.name == "reconcile Backup").unwrap();
        assert_eq!(
            reconcile.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(reconcile.parent_span_id.to_string(), "00f067aa0ba902b7");
        // What this reconcile writes on an object it creates names the reconcile itself.
        assert_eq!(passed_on.0, TRACEPARENT_ANNOTATION);
        assert_eq!(
            passed_on.1,
            format!(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01",
                reconcile.span_context.span_id()
            )
        );
        let attribute = |key: &str| {
            reconcile
                .attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(attribute("controller").as_deref(), Some("test-controller"));
        assert_eq!(attribute("kind").as_deref(), Some("Backup"));
        assert_eq!(attribute("object.name").as_deref(), Some("orders-final"));
        assert_eq!(attribute("object.generation").as_deref(), Some("1"));
        assert_eq!(attribute("outcome").as_deref(), Some("success"));
        assert_eq!(attribute("trace.continued").as_deref(), Some("parent"));
    }

    #[test]
    fn an_object_is_settled_when_ready_or_failed_for_its_generation() {
        let condition = |type_: &str, status: &str, generation: i64| {
            serde_json::json!([{
                "type": type_, "status": status, "reason": "R", "message": "m",
                "observedGeneration": generation,
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }])
        };
        assert!(!is_settled(annotated(serde_json::json!([])).as_ref()));
        assert!(is_settled(
            annotated(condition("Ready", "True", 1)).as_ref()
        ));
        assert!(is_settled(
            annotated(condition("Failed", "True", 1)).as_ref()
        ));
        assert!(!is_settled(
            annotated(condition("Ready", "False", 1)).as_ref()
        ));
        // Ready for an older generation: a spec change is still being worked on.
        let mut changed = (*annotated(condition("Ready", "True", 1))).clone();
        changed.metadata.generation = Some(2);
        assert!(!is_settled(&changed));
    }

    #[tokio::test]
    async fn a_settled_object_starts_its_own_trace_linked_to_its_creator() {
        let (subscriber, exporter, provider) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);
        let (ctx, _handle) = context();
        let obj = annotated(serde_json::json!([{
            "type": "Ready", "status": "True", "reason": "Completed", "message": "done",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]));
        instrumented_reconcile(obj, ctx, async {
            Ok::<_, Infallible>(Action::await_change())
        })
        .await
        .unwrap();
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let reconcile = spans.iter().find(|s| s.name == "reconcile Backup").unwrap();
        assert_ne!(
            reconcile.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let links: Vec<String> = reconcile
            .links
            .iter()
            .map(|l| l.span_context.span_id().to_string())
            .collect();
        assert_eq!(links, ["00f067aa0ba902b7"]);
    }
}
