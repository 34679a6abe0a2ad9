//! The connection Secrets of tenant namespaces, reached only where a Database needs them.
//!
//! RBAC cannot grant Secrets by label, and the tenant namespaces are not known when dbops
//! is installed, so the controller's ServiceAccount holds no Secret verb outside its own
//! namespace. In each namespace where a Database needs its connection Secret, this module
//! binds the ClusterRole [`CLUSTER_ROLE`] (get, list, watch, create and patch on Secrets)
//! to that ServiceAccount with the RoleBinding [`ROLE_BINDING`], then watches the
//! namespace's connection Secrets (label `app.kubernetes.io/managed-by=dbops`) into a
//! cache of their own. Where no Database needs them any more, it stops that watch and
//! takes its ServiceAccount off the RoleBinding (deleting it when no other subject is
//! left: several installations, each with its own ServiceAccount, may share a namespace).
//!
//! A Database needs its namespace's Secrets ([`needs_secrets`]) while neither it nor its
//! namespace is being deleted and either its DatabaseServer (one this installation serves,
//! not being deleted) allows the namespace, or it is already provisioned on a served
//! server (such a Database stays admitted, see `reconcile::admit`, and keeps its Secret
//! current). A namespace no server allows, or where no Database is, has no RoleBinding:
//! `kubectl auth can-i get secrets -n <it> --as=<the ServiceAccount>` says no.
//!
//! It works while the process leads: [`TenantSecrets::follow`] brings the namespaces set
//! up to those needed every [`TICK`], and a reconcile that needs a namespace not set up
//! yet sets it up at once ([`TenantSecrets::secrets_for`], bounded). Each change of a
//! watched Secret goes to the Database controller ([`TenantSecrets::triggers`]), which
//! reconciles its owner. Each namespace's watch reports to the process's
//! [`WatchHealth`] like every other watch; a RoleBinding that cannot be written is
//! logged, and the reconciles of that namespace's Databases say why.
//!
//! The ServiceAccount is `--service-account`, or, when that is not given, whoever the
//! apiserver says the process's credentials are (a SelfSubjectReview). Credentials that
//! are no ServiceAccount (a user's kubeconfig) get no RoleBinding: they read with what
//! they hold.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use dbops_api::Database;
use dbops_shared::controller;
use dbops_shared::server::Directory;
use dbops_shared::watch_health::WatchHealth;
use futures::{Stream, StreamExt};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::error::{Error, Result};
use crate::secret;

/// The ClusterRole holding exactly the Secret verbs the controller needs in a tenant
/// namespace (`deploy/database-controller/rbac.yaml`).
pub const CLUSTER_ROLE: &str = "dbops-database-controller-tenant-secrets";
/// The RoleBinding of [`CLUSTER_ROLE`] in each namespace that needs it (its only name the
/// controller may get, update or delete).
pub const ROLE_BINDING: &str = CLUSTER_ROLE;
/// How often the namespaces set up are compared with those needed.
pub const TICK: Duration = Duration::from_secs(5);
/// Longest a reconcile waits for a namespace's set-up and its watch's first list.
const SET_UP_WAIT: Duration = Duration::from_secs(15);
/// Longest wait, after a RoleBinding was written, for the apiserver's authorizer to grant
/// what it binds (its RBAC cache follows the RoleBindings within moments).
const GRANT_WAIT: Duration = Duration::from_secs(10);
const GRANT_POLL: Duration = Duration::from_millis(100);
/// How long a RoleBinding this process created may be missing from its watch's cache
/// before it is written again.
const CREATED_GRACE: Duration = Duration::from_secs(30);
/// Secret changes queued for the Database controller at most (the watches wait beyond).
const TRIGGER_BUFFER: usize = 256;

/// The labels of the RoleBindings this module writes (the ones it may delete carry the
/// first one).
const LABELS: [(&str, &str); 4] = [
    secret::MANAGED_BY,
    ("app.kubernetes.io/part-of", "dbops"),
    ("app.kubernetes.io/component", "database-controller"),
    ("app.kubernetes.io/name", "dbops-database-controller"),
];

/// A ServiceAccount: the subject of the RoleBindings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

/// `--service-account` as given: `<namespace>/<name>`, or `<name>` (then in
/// `--controller-namespace`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccountArg {
    namespace: Option<String>,
    name: String,
}

impl ServiceAccountArg {
    /// clap's parser of `--service-account`.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        let valid = |part: &str| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        };
        let (namespace, name) = match value.split_once('/') {
            Some((namespace, name)) => (Some(namespace), name),
            None => (None, value),
        };
        if !valid(name) || namespace.is_some_and(|ns| !valid(ns)) {
            return Err(format!(
                "{value:?} is not <namespace>/<name> or <name> of a ServiceAccount"
            ));
        }
        Ok(Self {
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        })
    }

    /// The ServiceAccount, a bare name being in `controller_namespace`.
    pub fn in_namespace(&self, controller_namespace: &str) -> ServiceAccount {
        ServiceAccount {
            namespace: self
                .namespace
                .clone()
                .unwrap_or_else(|| controller_namespace.to_string()),
            name: self.name.clone(),
        }
    }
}

impl ServiceAccount {
    /// The ServiceAccount a username `system:serviceaccount:<namespace>:<name>` is.
    pub fn from_username(username: &str) -> Option<Self> {
        let rest = username.strip_prefix("system:serviceaccount:")?;
        let (namespace, name) = rest.split_once(':')?;
        (!namespace.is_empty() && !name.is_empty() && !name.contains(':')).then(|| Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
        })
    }

    fn subject(&self) -> Subject {
        Subject {
            api_group: None,
            kind: "ServiceAccount".into(),
            name: self.name.clone(),
            namespace: Some(self.namespace.clone()),
        }
    }

    fn is(&self, subject: &Subject) -> bool {
        subject.kind == "ServiceAccount"
            && subject.name == self.name
            && subject.namespace.as_deref() == Some(self.namespace.as_str())
    }
}

impl std::fmt::Display for ServiceAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What decides whether a Database needs its namespace's Secrets: the DatabaseServers
/// this installation serves and the namespaces (the [`Directory`]; a table in tests).
pub trait Tenancy {
    /// Whether this installation serves DatabaseServer `server`.
    fn serves(&self, server: &str) -> bool;
    /// Whether `server` is served, not being deleted, and allows `namespace`.
    fn allows(&self, server: &str, namespace: &str) -> bool;
    /// Whether `namespace` is being deleted, or gone.
    fn namespace_terminating(&self, namespace: &str) -> bool;
}

impl Tenancy for Directory {
    fn serves(&self, server: &str) -> bool {
        self.get(server).is_some()
    }

    fn allows(&self, server: &str, namespace: &str) -> bool {
        self.get(server).is_some_and(|s| {
            s.metadata.deletion_timestamp.is_none() && self.admits(&s, namespace).is_ok()
        })
    }

    fn namespace_terminating(&self, namespace: &str) -> bool {
        Directory::namespace_terminating(self, namespace)
    }
}

/// Whether `db` needs the connection Secrets of its namespace (see the module's
/// documentation).
pub fn needs_secrets(db: &Database, tenancy: &impl Tenancy) -> bool {
    let Some(namespace) = db.metadata.namespace.as_deref() else {
        return false;
    };
    if db.metadata.deletion_timestamp.is_some() || tenancy.namespace_terminating(namespace) {
        return false;
    }
    let provisioned_on = db
        .status
        .as_ref()
        .filter(|s| s.provider_id.is_some())
        .and_then(|s| s.server.as_deref());
    provisioned_on.is_some_and(|server| tenancy.serves(server))
        || tenancy.allows(&db.spec.server_ref.name, namespace)
}

/// The namespaces whose connection Secrets some of `databases` need.
pub fn needed(databases: &[Arc<Database>], tenancy: &impl Tenancy) -> BTreeSet<String> {
    databases
        .iter()
        .filter(|db| needs_secrets(db, tenancy))
        .filter_map(|db| db.metadata.namespace.clone())
        .collect()
}

/// What to do with a namespace's RoleBinding [`ROLE_BINDING`] so that it grants `me`
/// exactly when `wanted`.
#[derive(Debug, Clone, PartialEq)]
pub enum BindingStep {
    Keep,
    Create,
    /// Write these subjects (the RoleBinding's others kept; an update, with its
    /// resourceVersion).
    SetSubjects(Vec<Subject>),
    /// Delete it (`me` was its only subject), if still at this uid and resourceVersion.
    Delete,
    /// A RoleBinding of that name that dbops did not make: never written.
    Foreign(String),
}

/// Whether `binding` is one this module writes: dbops' label, and the ClusterRole.
fn is_ours(binding: &RoleBinding) -> bool {
    let (key, value) = secret::MANAGED_BY;
    binding.labels().get(key).map(String::as_str) == Some(value)
        && binding.role_ref.kind == "ClusterRole"
        && binding.role_ref.name == CLUSTER_ROLE
}

pub fn plan_binding(
    existing: Option<&RoleBinding>,
    me: &ServiceAccount,
    wanted: bool,
) -> BindingStep {
    let Some(binding) = existing else {
        return if wanted {
            BindingStep::Create
        } else {
            BindingStep::Keep
        };
    };
    if !is_ours(binding) {
        return if wanted {
            BindingStep::Foreign(format!(
                "RoleBinding {}/{ROLE_BINDING} exists and was not made by dbops (it lacks the label {}={} or does not bind ClusterRole {CLUSTER_ROLE}); it is left untouched: delete or rename it",
                binding.namespace().unwrap_or_default(),
                secret::MANAGED_BY.0,
                secret::MANAGED_BY.1,
            ))
        } else {
            BindingStep::Keep
        };
    }
    let subjects = binding.subjects.clone().unwrap_or_default();
    let mine = subjects.iter().any(|s| me.is(s));
    match (wanted, mine) {
        (true, true) | (false, false) => BindingStep::Keep,
        (true, false) => {
            let mut more = subjects;
            more.push(me.subject());
            BindingStep::SetSubjects(more)
        }
        (false, true) => {
            let rest: Vec<Subject> = subjects.into_iter().filter(|s| !me.is(s)).collect();
            if rest.is_empty() {
                BindingStep::Delete
            } else {
                BindingStep::SetSubjects(rest)
            }
        }
    }
}

/// The RoleBinding granting `me` [`CLUSTER_ROLE`] in `namespace`.
fn desired_binding(namespace: &str, me: &ServiceAccount) -> RoleBinding {
    RoleBinding {
        metadata: ObjectMeta {
            name: Some(ROLE_BINDING.into()),
            namespace: Some(namespace.into()),
            labels: Some(
                LABELS
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: CLUSTER_ROLE.into(),
        },
        subjects: Some(vec![me.subject()]),
    }
}

/// The name of a namespace's Secret watch in the process's [`WatchHealth`] and logs.
fn watch_name(namespace: &str) -> String {
    format!("Secret (connection) in {namespace}")
}

/// One namespace set up: its Secret cache and the task that fills it.
struct Tenant {
    secrets: Store<Secret>,
    task: AbortHandle,
}

/// The RoleBindings' subject, once known: `None` when the credentials are no
/// ServiceAccount (no RoleBinding is written then).
type Identity = Option<ServiceAccount>;

/// The set-ups of the tenant namespaces (see the module's documentation); clones share it.
#[derive(Clone)]
pub struct TenantSecrets {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    directory: Directory,
    /// The Database controller's cache (set up with its watches).
    databases: Arc<OnceLock<Store<Database>>>,
    /// `--watch-namespace`: the only namespace with Databases, when given.
    scope: Option<String>,
    /// `--service-account`, when given.
    configured: Option<ServiceAccount>,
    identity: tokio::sync::OnceCell<Identity>,
    /// This installation's RoleBindings ([`ROLE_BINDING`], dbops' label), when it writes
    /// them; filled by `bindings_task`.
    bindings: OnceLock<Store<RoleBinding>>,
    bindings_task: Mutex<Option<AbortHandle>>,
    tenants: Mutex<HashMap<String, Tenant>>,
    /// Set-ups and tear-downs, one at a time.
    changes: tokio::sync::Mutex<()>,
    /// RoleBindings created and not seen in `bindings` yet, with when.
    created: Mutex<HashMap<String, Instant>>,
    triggers: mpsc::Sender<Secret>,
    receiver: Mutex<Option<mpsc::Receiver<Secret>>>,
}

impl Drop for Inner {
    /// The watches end with the leadership (the controllers' closure drops its state).
    fn drop(&mut self) {
        let tenants = self
            .tenants
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for (namespace, tenant) in tenants.drain() {
            tenant.task.abort();
            WatchHealth::process().succeeded(&watch_name(&namespace));
        }
        if let Some(task) = self
            .bindings_task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

impl TenantSecrets {
    pub fn new(
        client: Client,
        directory: Directory,
        databases: Arc<OnceLock<Store<Database>>>,
        scope: Option<&str>,
        configured: Option<ServiceAccount>,
    ) -> Self {
        let (triggers, receiver) = mpsc::channel(TRIGGER_BUFFER);
        Self {
            inner: Arc::new(Inner {
                client,
                directory,
                databases,
                scope: scope.map(str::to_string),
                configured,
                identity: tokio::sync::OnceCell::new(),
                bindings: OnceLock::new(),
                bindings_task: Mutex::new(None),
                tenants: Mutex::default(),
                changes: tokio::sync::Mutex::new(()),
                created: Mutex::default(),
                triggers,
                receiver: Mutex::new(Some(receiver)),
            }),
        }
    }

    /// Every change of a watched connection Secret, for `Controller::owns_stream` (which
    /// reconciles its owner Database). The first call takes the stream; later ones get an
    /// empty one.
    pub fn triggers(&self) -> impl Stream<Item = Result<Secret, watcher::Error>> + Send + 'static {
        let receiver = self
            .inner
            .receiver
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        futures::stream::unfold(receiver, |receiver| async move {
            let mut receiver = receiver?;
            let secret = receiver.recv().await?;
            Some((Ok(secret), Some(receiver)))
        })
    }

    /// Keeps the namespaces set up equal to those needed, every [`TICK`], for as long as
    /// it is polled (the process's controllers run beside it and it ends with them).
    pub async fn follow(&self) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(error) = self.sync().await {
                tracing::warn!(%error, "following the namespaces whose connection Secrets are needed; again in {TICK:?}");
            }
        }
    }

    /// The cache of `db`'s namespace's connection Secrets, once its first list is in: set
    /// up at once if needed and not yet done (bounded by [`SET_UP_WAIT`]).
    pub async fn secrets_for(&self, db: &Database) -> Result<Store<Secret>> {
        let namespace = db.namespace().unwrap_or_default();
        let store = match self.running(&namespace) {
            Some(store) => store,
            None => {
                if !needs_secrets(db, &self.inner.directory) {
                    return Err(Error::Retry {
                        reason: "NamespaceNotAllowed",
                        message: format!(
                            "no DatabaseServer this controller serves allows namespace {namespace:?}: its connection Secrets are out of this controller's reach"
                        ),
                    });
                }
                let set_up = async {
                    let _one = self.inner.changes.lock().await;
                    self.set_up(&namespace).await
                };
                match tokio::time::timeout(SET_UP_WAIT, set_up).await {
                    Ok(result) => result?,
                    Err(_) => return Err(not_synced(&namespace)),
                }
            }
        };
        match tokio::time::timeout(SET_UP_WAIT, store.wait_until_ready()).await {
            Ok(Ok(())) => Ok(store),
            _ => Err(not_synced(&namespace)),
        }
    }

    fn running(&self, namespace: &str) -> Option<Store<Secret>> {
        self.inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(namespace)
            .map(|t| t.secrets.clone())
    }

    fn running_namespaces(&self) -> BTreeSet<String> {
        self.inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    /// One comparison of the namespaces set up with those needed, and what follows from it.
    async fn sync(&self) -> Result<()> {
        let inner = &self.inner;
        // Before every cache is in, "not needed" would be a guess (and would unbind
        // everything at a start).
        inner
            .directory
            .synced()
            .await
            .map_err(crate::server_access::server_error)?;
        let Some(databases) = inner.databases.get() else {
            return Ok(());
        };
        wait_ready(databases, "Database").await?;
        let identity = self.identity().await?;
        if identity.is_some() {
            wait_ready(self.bindings()?, "RoleBinding").await?;
        }
        // Under the lock: a reconcile's set-up before it was for a Database already in the
        // cache read here, so it is never undone as unneeded.
        let _one = inner.changes.lock().await;
        let wanted = needed(&databases.state(), &inner.directory);
        for namespace in self.running_namespaces().difference(&wanted) {
            self.tear_down(namespace);
        }
        if let Some(me) = &identity {
            // Ours where nothing needs them (a Database that went while this process did
            // not lead, or a namespace a server no longer allows).
            let stale: Vec<String> = self
                .bindings()?
                .state()
                .iter()
                .filter_map(|b| b.namespace())
                .filter(|ns| !wanted.contains(ns) && !inner.directory.namespace_terminating(ns))
                .collect();
            for namespace in stale {
                if let Err(error) = self.bind(&namespace, me, false).await {
                    tracing::warn!(%error, namespace, "removing this controller from a RoleBinding it no longer needs");
                }
            }
        }
        for namespace in &wanted {
            if let Err(error) = self.set_up(namespace).await {
                tracing::warn!(%error, namespace, "setting up the watch of a namespace's connection Secrets");
                // Without its RoleBinding the watch would only fail.
                self.tear_down(namespace);
            }
        }
        Ok(())
    }

    /// Grants this process the namespace's Secrets (its RoleBinding: checked against the
    /// cache, written only when it differs) and starts its watch unless running.
    async fn set_up(&self, namespace: &str) -> Result<Store<Secret>> {
        if let Some(me) = self.identity().await? {
            self.bind(namespace, &me, true).await?;
        }
        if let Some(store) = self.running(namespace) {
            return Ok(store);
        }
        Ok(self.watch(namespace))
    }

    /// Stops the namespace's watch (its RoleBinding is left to the caller).
    fn tear_down(&self, namespace: &str) {
        let removed = self
            .inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(namespace);
        if let Some(tenant) = removed {
            tenant.task.abort();
            WatchHealth::process().succeeded(&watch_name(namespace));
            tracing::info!(
                namespace,
                "no Database needs this namespace's connection Secrets any more: their watch stopped"
            );
        }
    }

    /// Starts the watch of the namespace's connection Secrets: its own cache, each change
    /// sent to the Database controller.
    fn watch(&self, namespace: &str) -> Store<Secret> {
        let (store, writer) = reflector::store();
        let (key, value) = secret::MANAGED_BY;
        let events = watcher(
            Api::<Secret>::namespaced(self.inner.client.clone(), namespace),
            watcher::Config::default()
                .labels(&format!("{key}={value}"))
                .page_size(controller::LIST_PAGE_SIZE),
        )
        .default_backoff()
        .modify(|s| {
            s.managed_fields_mut().clear();
            secret::keep_in_cache(s);
        })
        .reflect(writer);
        let name = watch_name(namespace);
        let triggers = self.inner.triggers.clone();
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                WatchHealth::process().observe(&name, &event);
                let touched = match event {
                    Err(error) => {
                        tracing::warn!(%error, watch = name, "watch failed; retrying with backoff");
                        continue;
                    }
                    Ok(
                        watcher::Event::Apply(s)
                        | watcher::Event::Delete(s)
                        | watcher::Event::InitApply(s),
                    ) => s,
                    Ok(_) => continue,
                };
                if triggers.send(touched).await.is_err() {
                    break;
                }
            }
        });
        tracing::info!(namespace, "watching this namespace's connection Secrets");
        self.inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                namespace.to_string(),
                Tenant {
                    secrets: store.clone(),
                    task: task.abort_handle(),
                },
            );
        store
    }

    /// The RoleBindings' subject: `--service-account`, else what the apiserver says the
    /// credentials are. Asked once; the RoleBinding watch starts with the answer.
    async fn identity(&self) -> Result<Identity> {
        let inner = &self.inner;
        let identity = inner
            .identity
            .get_or_try_init(|| async {
                let identity = match &inner.configured {
                    Some(configured) => Some(configured.clone()),
                    None => {
                        let review = Api::<SelfSubjectReview>::all(inner.client.clone())
                            .create(&PostParams::default(), &SelfSubjectReview::default())
                            .await?;
                        let username = review
                            .status
                            .and_then(|s| s.user_info)
                            .and_then(|u| u.username)
                            .unwrap_or_default();
                        let account = ServiceAccount::from_username(&username);
                        if account.is_none() {
                            tracing::info!(
                                username,
                                "the credentials are no ServiceAccount: no RoleBinding is written, tenant Secrets are read with what they hold"
                            );
                        }
                        account
                    }
                };
                if let Some(me) = &identity {
                    tracing::info!(service_account = %me, "tenant namespaces' connection Secrets are reached through RoleBindings {ROLE_BINDING} naming this ServiceAccount");
                    self.watch_bindings();
                }
                Ok::<_, Error>(identity)
            })
            .await?;
        Ok(identity.clone())
    }

    /// Starts the watch of this installation's RoleBindings: by name (the only one it may
    /// list) and dbops' label, in `--watch-namespace` or everywhere.
    fn watch_bindings(&self) {
        let inner = &self.inner;
        let (store, writer) = reflector::store();
        let (key, value) = secret::MANAGED_BY;
        let events = reflector::reflector(
            writer,
            watcher(
                controller::scoped_api::<RoleBinding>(inner.client.clone(), inner.scope.as_deref()),
                watcher::Config::default()
                    .labels(&format!("{key}={value}"))
                    .fields(&format!("metadata.name={ROLE_BINDING}")),
            )
            .default_backoff()
            .modify(|b| b.metadata.managed_fields = None),
        );
        let task = tokio::spawn(events.for_each(|event| {
            if let Err(error) = &event {
                tracing::warn!(%error, watch = "RoleBinding", "watch failed; retrying with backoff");
            }
            WatchHealth::process().observe("RoleBinding", &event);
            std::future::ready(())
        }));
        let _ = inner.bindings.set(store);
        *inner
            .bindings_task
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(task.abort_handle());
    }

    fn bindings(&self) -> Result<&Store<RoleBinding>> {
        self.inner
            .bindings
            .get()
            .ok_or_else(|| Error::Internal("the RoleBinding watch has not started".into()))
    }

    /// Makes the namespace's RoleBinding grant `me` exactly when `wanted`, writing only
    /// what differs from the cache (a conflict reads it afresh and plans once more); once
    /// written to grant, waits (bounded) until the apiserver's authorizer does.
    async fn bind(&self, namespace: &str, me: &ServiceAccount, wanted: bool) -> Result<()> {
        let cached = self
            .bindings()?
            .get(&ObjectRef::new(ROLE_BINDING).within(namespace));
        let recently_created = {
            let mut created = self
                .inner
                .created
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            created.retain(|_, at| at.elapsed() < CREATED_GRACE);
            if cached.is_some() {
                created.remove(namespace);
            }
            created.contains_key(namespace)
        };
        if cached.is_none() && wanted && recently_created {
            // Created moments ago; the watch has not shown it yet.
            return Ok(());
        }
        let api: Api<RoleBinding> = Api::namespaced(self.inner.client.clone(), namespace);
        let mut existing = cached.map(|b| (*b).clone());
        // A second round only after a conflict, with what the API holds now.
        for round in 0..2 {
            let step = plan_binding(existing.as_ref(), me, wanted);
            let written = match &step {
                BindingStep::Keep => return Ok(()),
                BindingStep::Foreign(message) => {
                    return Err(Error::Retry {
                        reason: "RoleBindingConflict",
                        message: message.clone(),
                    });
                }
                BindingStep::Create => api
                    .create(&PostParams::default(), &desired_binding(namespace, me))
                    .await
                    .map(|_| ()),
                BindingStep::SetSubjects(subjects) => {
                    let mut changed = existing.clone().unwrap_or_default();
                    changed.subjects = Some(subjects.clone());
                    api.replace(ROLE_BINDING, &PostParams::default(), &changed)
                        .await
                        .map(|_| ())
                }
                BindingStep::Delete => {
                    let found = existing.as_ref().map(|b| &b.metadata);
                    let params = DeleteParams {
                        preconditions: Some(Preconditions {
                            uid: found.and_then(|m| m.uid.clone()),
                            resource_version: found.and_then(|m| m.resource_version.clone()),
                        }),
                        ..DeleteParams::default()
                    };
                    match api.delete(ROLE_BINDING, &params).await {
                        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                        other => other.map(|_| ()),
                    }
                }
            };
            match written {
                Ok(()) => {
                    tracing::info!(namespace, ?step, service_account = %me, "RoleBinding {ROLE_BINDING} written");
                    if step == BindingStep::Create {
                        self.inner
                            .created
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(namespace.to_string(), Instant::now());
                    }
                    if wanted {
                        self.wait_granted(namespace).await;
                    }
                    return Ok(());
                }
                Err(kube::Error::Api(e)) if e.code == 409 && round == 0 => {
                    existing = api.get_opt(ROLE_BINDING).await?;
                }
                Err(e) => {
                    return Err(Error::Retry {
                        reason: "KubernetesApiError",
                        message: format!(
                            "RoleBinding {namespace}/{ROLE_BINDING}, which grants ServiceAccount {me} the connection Secrets there: {e}"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Waits (bounded by [`GRANT_WAIT`]) until the apiserver lets this process list the
    /// namespace's Secrets, so that the watch started next does not begin with a refusal.
    async fn wait_granted(&self, namespace: &str) {
        let reviews = Api::<SelfSubjectAccessReview>::all(self.inner.client.clone());
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_string()),
                    verb: Some("list".into()),
                    resource: Some("secrets".into()),
                    version: Some("v1".into()),
                    ..ResourceAttributes::default()
                }),
                non_resource_attributes: None,
            },
            ..SelfSubjectAccessReview::default()
        };
        let granted = async {
            loop {
                let allowed = reviews
                    .create(&PostParams::default(), &review)
                    .await
                    .ok()
                    .and_then(|r| r.status)
                    .is_some_and(|s| s.allowed);
                if allowed {
                    return;
                }
                tokio::time::sleep(GRANT_POLL).await;
            }
        };
        if tokio::time::timeout(GRANT_WAIT, granted).await.is_err() {
            tracing::warn!(
                namespace,
                "the RoleBinding {ROLE_BINDING} was written but the apiserver does not let this process list the namespace's Secrets after {GRANT_WAIT:?}: is --service-account the ServiceAccount of its credentials?"
            );
        }
    }
}

fn not_synced(namespace: &str) -> Error {
    Error::Retry {
        reason: "CacheNotSynced",
        message: format!(
            "the watch of namespace {namespace:?}'s connection Secrets has not listed them yet"
        ),
    }
}

/// Waits (bounded) for a cache's first list.
async fn wait_ready<K>(store: &Store<K>, what: &str) -> Result<()>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    match tokio::time::timeout(SET_UP_WAIT, store.wait_until_ready()).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(Error::Retry {
            reason: "CacheNotSynced",
            message: format!("the {what} cache has not synced yet"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Served servers with the namespaces each allows; namespaces being deleted.
    #[derive(Default)]
    struct Table {
        allows: HashMap<&'static str, HashSet<&'static str>>,
        terminating: HashSet<&'static str>,
    }

    impl Tenancy for Table {
        fn serves(&self, server: &str) -> bool {
            self.allows.contains_key(server)
        }
        fn allows(&self, server: &str, namespace: &str) -> bool {
            self.allows
                .get(server)
                .is_some_and(|namespaces| namespaces.contains(namespace))
        }
        fn namespace_terminating(&self, namespace: &str) -> bool {
            self.terminating.contains(namespace)
        }
    }

    fn database(namespace: &str, name: &str, server: &str, on: Option<&str>) -> Arc<Database> {
        let mut db: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"serverRef": {"name": server}}
        }))
        .unwrap();
        if let Some(on) = on {
            db.status = Some(dbops_api::DatabaseStatus {
                server: Some(on.into()),
                provider_id: Some("h:5432/1".into()),
                ..Default::default()
            });
        }
        Arc::new(db)
    }

    #[test]
    fn a_namespace_is_needed_where_a_served_server_allows_a_database_or_one_is_provisioned() {
        let table = Table {
            allows: HashMap::from([
                ("pg-main", HashSet::from(["shop", "billing", "leaving"])),
                ("pg-closed", HashSet::new()),
            ]),
            terminating: HashSet::from(["leaving"]),
        };
        let mut deleting = (*database("gone", "db", "pg-main", None)).clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let databases = vec![
            // Allowed: needed.
            database("shop", "orders", "pg-main", None),
            // No longer allowed, but provisioned on a served server: still needed.
            database("legacy", "kept", "pg-closed", Some("pg-closed")),
            // Not allowed, not provisioned: not needed.
            database("stranger", "refused", "pg-closed", None),
            // A server this installation does not serve.
            database("elsewhere", "theirs", "pg-other", None),
            database("elsewhere", "was-theirs", "pg-other", Some("pg-other")),
            // Allowed, but the namespace is being deleted.
            database("leaving", "db", "pg-main", None),
            // Allowed (by name), but the Database is being deleted.
            Arc::new(deleting),
        ];
        assert_eq!(
            needed(&databases, &table),
            BTreeSet::from(["legacy".to_string(), "shop".to_string()])
        );
        // A namespace a server allows but where no Database is: not needed.
        assert!(!needed(&databases, &table).contains("billing"));
    }

    fn me() -> ServiceAccount {
        ServiceAccount {
            namespace: "dbops-system".into(),
            name: "dbops-database-controller".into(),
        }
    }

    fn other() -> ServiceAccount {
        ServiceAccount {
            namespace: "dbops-blue".into(),
            name: "dbops-database-controller".into(),
        }
    }

    fn binding(subjects: &[&ServiceAccount]) -> RoleBinding {
        let mut b = desired_binding("shop", &me());
        b.subjects = Some(subjects.iter().map(|s| s.subject()).collect());
        b
    }

    #[test]
    fn the_role_binding_grants_this_service_account_exactly_when_wanted_and_keeps_others() {
        assert_eq!(plan_binding(None, &me(), true), BindingStep::Create);
        assert_eq!(plan_binding(None, &me(), false), BindingStep::Keep);
        let mine = binding(&[&me()]);
        assert_eq!(plan_binding(Some(&mine), &me(), true), BindingStep::Keep);
        assert_eq!(plan_binding(Some(&mine), &me(), false), BindingStep::Delete);
        // Another installation's ServiceAccount shares the namespace: added to, and left.
        let theirs = binding(&[&other()]);
        assert_eq!(
            plan_binding(Some(&theirs), &me(), true),
            BindingStep::SetSubjects(vec![other().subject(), me().subject()])
        );
        assert_eq!(plan_binding(Some(&theirs), &me(), false), BindingStep::Keep);
        let both = binding(&[&other(), &me()]);
        assert_eq!(
            plan_binding(Some(&both), &me(), false),
            BindingStep::SetSubjects(vec![other().subject()])
        );
        // One dbops did not make (no label, or another role): never written.
        let mut unlabelled = binding(&[&me()]);
        unlabelled.metadata.labels = None;
        assert!(matches!(
            plan_binding(Some(&unlabelled), &me(), true),
            BindingStep::Foreign(m) if m.contains("not made by dbops")
        ));
        assert_eq!(
            plan_binding(Some(&unlabelled), &me(), false),
            BindingStep::Keep
        );
        let mut admin = binding(&[&me()]);
        admin.role_ref.name = "cluster-admin".into();
        assert!(matches!(
            plan_binding(Some(&admin), &me(), false),
            BindingStep::Keep
        ));
    }

    #[test]
    fn the_desired_role_binding_binds_the_tenant_cluster_role_to_the_service_account() {
        let b = desired_binding("shop", &me());
        assert_eq!(b.metadata.name.as_deref(), Some(ROLE_BINDING));
        assert_eq!(b.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(b.role_ref.kind, "ClusterRole");
        assert_eq!(b.role_ref.name, CLUSTER_ROLE);
        let subjects = b.subjects.clone().unwrap();
        assert_eq!(subjects.len(), 1);
        assert_eq!(subjects[0].kind, "ServiceAccount");
        assert_eq!(subjects[0].namespace.as_deref(), Some("dbops-system"));
        assert!(is_ours(&b));
        assert_eq!(
            b.labels()
                .get("app.kubernetes.io/component")
                .map(String::as_str),
            Some("database-controller")
        );
    }

    #[test]
    fn the_service_account_comes_from_the_flag_or_the_username() {
        let bare = ServiceAccountArg::parse("dbops-database-controller").unwrap();
        assert_eq!(bare.in_namespace("dbops-system"), me());
        let full = ServiceAccountArg::parse("dbops-blue/dbops-database-controller").unwrap();
        assert_eq!(full.in_namespace("dbops-system"), other());
        for bad in ["", "/x", "x/", "a/b/c", "Upper", "a b"] {
            assert!(ServiceAccountArg::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            ServiceAccount::from_username(
                "system:serviceaccount:dbops-system:dbops-database-controller"
            ),
            Some(me())
        );
        for not_one in [
            "kubernetes-admin",
            "system:serviceaccount:x",
            "system:node:a",
        ] {
            assert_eq!(ServiceAccount::from_username(not_one), None, "{not_one}");
        }
    }
}
