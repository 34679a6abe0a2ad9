//! The connection Secrets of tenant namespaces, reached only where a Database needs them.
//!
//! RBAC cannot grant Secrets by label, and the tenant namespaces are not known when dbops
//! is installed, so the controller's ServiceAccount holds no Secret verb outside its own
//! namespace. In each namespace where a Database needs its connection Secret, this module
//! binds the ClusterRole `dbops-database-controller-tenant-secrets` (get, list, watch,
//! create and patch on Secrets) to that ServiceAccount with a RoleBinding of that name
//! (`binding`), then watches the
//! namespace's connection Secrets (label `app.kubernetes.io/managed-by=dbops`) into a
//! cache of their own: a [`CompactStore`], each Secret kept as the JSON of what
//! [`secret::keep_in_cache`] keeps of it (one allocation of ~0.8 KB instead of ~3.4 KB
//! in 26 decoded), decoded when a reconcile reads it. Where no Database needs them any more, it stops that watch and
//! takes its ServiceAccount off the RoleBinding (deleting it when no other subject is
//! left: several installations, each with its own ServiceAccount, may share a namespace).
//!
//! A Database needs its namespace's Secrets (`tenancy`) while neither it nor its
//! namespace is being deleted and either its DatabaseServer (one this installation serves,
//! not being deleted) allows the namespace, or it is already provisioned on a served
//! server (such a Database stays admitted, see `admit`, and keeps its Secret current). A namespace no server allows, or where no Database is, has no RoleBinding:
//! `kubectl auth can-i get secrets -n <it> --as=<the ServiceAccount>` says no.
//!
//! It works while the process leads: [`TenantSecrets::follow`] brings the namespaces set
//! up to those needed every [`TICK`], and a reconcile that needs a namespace not set up
//! yet sets it up at once ([`TenantSecrets::secrets_for`], bounded). Each change of a
//! watched Secret goes to the Database controller ([`TenantSecrets::triggers`]), which
//! reconciles its owner. Each namespace's watch counts in the process's [`WatchHealth`]
//! like every other watch (its streak forgotten when it stops); a RoleBinding that cannot be written is
//! logged, and the reconciles of that namespace's Databases say why.
//!
//! The ServiceAccount (`service_account`) is `--service-account`, or, when that is not given, whoever the
//! apiserver says the process's credentials are (a SelfSubjectReview). Credentials that
//! are no ServiceAccount (a user's kubeconfig) get no RoleBinding: they read with what
//! they hold.

mod binding;
mod service_account;
mod tenancy;

use dbops_api::reasons::DatabaseReason;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use dbops_api::Database;
use dbops_shared::compact_store::CompactStore;
use dbops_shared::controller;
use dbops_shared::server::Directory;
use dbops_shared::watch_health::WatchHealth;
use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::error::{Error, Result};
use crate::secret;
use binding::{Bindings, ROLE_BINDING};
pub use service_account::{ServiceAccount, ServiceAccountArg};
use tenancy::{needed, needs_secrets};

/// How often the namespaces set up are compared with those needed.
pub const TICK: Duration = Duration::from_secs(5);
/// Longest a reconcile waits for a namespace's set-up and its watch's first list.
const SET_UP_WAIT: Duration = Duration::from_secs(15);
/// Secret changes queued for the Database controller at most (the watches wait beyond).
const TRIGGER_BUFFER: usize = 256;

/// The name of a namespace's Secret watch in the logs.
fn watch_name(namespace: &str) -> String {
    format!("Secret (connection) in {namespace}")
}

/// One namespace set up: its Secret cache and the task that fills it.
struct Tenant {
    secrets: CompactStore<Secret>,
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
    /// `--service-account`, when given.
    configured: Option<ServiceAccount>,
    identity: tokio::sync::OnceCell<Identity>,
    /// This installation's RoleBindings ([`ROLE_BINDING`], dbops' label), when it writes
    /// them.
    bindings: Bindings,
    tenants: Mutex<HashMap<String, Tenant>>,
    /// Set-ups and tear-downs, one at a time.
    changes: tokio::sync::Mutex<()>,
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
            WatchHealth::process().forget_namespace(&namespace);
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
                bindings: Bindings::new(client.clone(), scope.map(str::to_string)),
                client,
                directory,
                databases,
                configured,
                identity: tokio::sync::OnceCell::new(),
                tenants: Mutex::default(),
                changes: tokio::sync::Mutex::new(()),
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
    pub async fn secrets_for(&self, db: &Database) -> Result<CompactStore<Secret>> {
        let namespace = db.namespace().unwrap_or_default();
        let store = match self.running(&namespace) {
            Some(store) => store,
            None => {
                if !needs_secrets(db, &self.inner.directory) {
                    return Err(Error::Reported {
                        reason: DatabaseReason::NamespaceNotAllowed.into(),
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
        if store.ready_within(SET_UP_WAIT).await {
            Ok(store)
        } else {
            Err(not_synced(&namespace))
        }
    }

    /// The connection Secret `name` of `db`'s namespace to decide on, by the one re-read
    /// rule for the Databases' and the users' Secrets alike: the cached copy, unless the
    /// cache does not hold it (newer than the cache, or not made by dbops: the cache holds
    /// dbops' Secrets only) or it names another login than `latest_login`, the latest
    /// status's (the watch lags under load, and deciding on the stale copy gave the
    /// previous login out again and retired the new one at once): then a GET.
    pub async fn current(
        &self,
        db: &Database,
        name: &str,
        latest_login: Option<&str>,
    ) -> Result<Option<Arc<Secret>>> {
        let namespace = db.namespace().unwrap_or_default();
        let store = self.secrets_for(db).await?;
        let cached = store.get(Some(&namespace), name);
        if let Some(found) = cached
            && latest_login.is_none_or(|l| secret::username(&found).is_none_or(|u| u == l))
        {
            return Ok(Some(found));
        }
        let secrets: Api<Secret> = Api::namespaced(self.inner.client.clone(), &namespace);
        Ok(secrets.get_opt(name).await?.map(Arc::new))
    }

    /// The connection Secret `name` of `namespace` as the cache holds it (password,
    /// username and a digest of the rest), if that namespace is set up.
    pub fn cached(&self, namespace: &str, name: &str) -> Option<Arc<Secret>> {
        self.running(namespace)?.get(Some(namespace), name)
    }

    fn running(&self, namespace: &str) -> Option<CompactStore<Secret>> {
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
            wait_ready(inner.bindings.store()?, "RoleBinding").await?;
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
            let stale: Vec<String> = inner
                .bindings
                .store()?
                .state()
                .iter()
                .filter_map(|b| b.namespace())
                .filter(|ns| !wanted.contains(ns) && !inner.directory.namespace_terminating(ns))
                .collect();
            for namespace in stale {
                if let Err(error) = inner.bindings.bind(&namespace, me, false).await {
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
    async fn set_up(&self, namespace: &str) -> Result<CompactStore<Secret>> {
        if let Some(me) = self.identity().await? {
            self.inner.bindings.bind(namespace, &me, true).await?;
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
            WatchHealth::process().forget_namespace(namespace);
            tracing::info!(
                namespace,
                "no Database needs this namespace's connection Secrets any more: their watch stopped"
            );
        }
    }

    /// Starts the watch of the namespace's connection Secrets: its own cache, each change
    /// sent to the Database controller.
    fn watch(&self, namespace: &str) -> CompactStore<Secret> {
        let store = CompactStore::new();
        let cache = store.clone();
        let (key, value) = dbops_api::names::label::MANAGED_BY;
        let events = watcher(
            Api::<Secret>::namespaced(self.inner.client.clone(), namespace),
            watcher::Config::default()
                .labels(&format!("{key}={value}"))
                .page_size(controller::LIST_PAGE_SIZE),
        )
        .default_backoff()
        .modify(|s| {
            dbops_shared::controller::slim(&mut s.metadata);
            secret::keep_in_cache(s);
        })
        .inspect_ok(move |event| cache.apply(event));
        let name = watch_name(namespace);
        let triggers = self.inner.triggers.clone();
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
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
                    inner.bindings.watch();
                }
                Ok::<_, Error>(identity)
            })
            .await?;
        Ok(identity.clone())
    }
}

fn not_synced(namespace: &str) -> Error {
    Error::Reported {
        reason: DatabaseReason::CacheNotSynced.into(),
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
    if dbops_shared::store_ready::ready_within(store, SET_UP_WAIT).await {
        return Ok(());
    }
    Err(Error::Reported {
        reason: DatabaseReason::CacheNotSynced.into(),
        message: format!("the {what} cache has not synced yet"),
    })
}
