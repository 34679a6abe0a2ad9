//! The RoleBinding [`ROLE_BINDING`] of each tenant namespace, which grants this
//! installation's ServiceAccount the ClusterRole [`CLUSTER_ROLE`] there: what to do with
//! one ([`plan_binding`], pure), and [`Bindings`], which watches this installation's
//! RoleBindings and writes one only where it differs from what is wanted.

use dbops_api::reasons::DatabaseReason;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use dbops_shared::controller;
use futures::StreamExt;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::task::AbortHandle;

use super::service_account::ServiceAccount;
use crate::error::{Error, Result};
use dbops_api::names::label;

/// The ClusterRole holding exactly the Secret verbs the controller needs in a tenant
/// namespace (`deploy/database-controller/rbac.yaml`).
pub const CLUSTER_ROLE: &str = "dbops-database-controller-tenant-secrets";
/// The RoleBinding of [`CLUSTER_ROLE`] in each namespace that needs it (its only name the
/// controller may get, update or delete).
pub const ROLE_BINDING: &str = CLUSTER_ROLE;
/// Longest wait, after a RoleBinding was written, for the apiserver's authorizer to grant
/// what it binds (its RBAC cache follows the RoleBindings within moments).
const GRANT_WAIT: Duration = Duration::from_secs(10);
const GRANT_POLL: Duration = Duration::from_millis(100);
/// How long a RoleBinding this process created may be missing from its watch's cache
/// before it is written again.
const CREATED_GRACE: Duration = Duration::from_secs(30);

/// The labels of the RoleBindings this module writes (the ones it may delete carry the
/// first one).
const LABELS: [(&str, &str); 4] = [
    label::MANAGED_BY,
    label::PART_OF,
    label::COMPONENT,
    label::NAME,
];

/// What to do with a namespace's RoleBinding [`ROLE_BINDING`] so that it grants `me`
/// exactly when `wanted`.
#[derive(Debug, Clone, PartialEq)]
pub enum BindingChange {
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
    let (key, value) = label::MANAGED_BY;
    binding.labels().get(key).map(String::as_str) == Some(value)
        && binding.role_ref.kind == "ClusterRole"
        && binding.role_ref.name == CLUSTER_ROLE
}

pub fn plan_binding(
    existing: Option<&RoleBinding>,
    me: &ServiceAccount,
    wanted: bool,
) -> BindingChange {
    let Some(binding) = existing else {
        return if wanted {
            BindingChange::Create
        } else {
            BindingChange::Keep
        };
    };
    if !is_ours(binding) {
        return if wanted {
            BindingChange::Foreign(format!(
                "RoleBinding {}/{ROLE_BINDING} exists and was not made by dbops (it lacks the label {}={} or does not bind ClusterRole {CLUSTER_ROLE}); it is left untouched: delete or rename it",
                binding.namespace().unwrap_or_default(),
                label::MANAGED_BY.0,
                label::MANAGED_BY.1,
            ))
        } else {
            BindingChange::Keep
        };
    }
    let subjects = binding.subjects.clone().unwrap_or_default();
    let mine = subjects.iter().any(|s| me.is(s));
    match (wanted, mine) {
        (true, true) | (false, false) => BindingChange::Keep,
        (true, false) => {
            let mut more = subjects;
            more.push(me.subject());
            BindingChange::SetSubjects(more)
        }
        (false, true) => {
            let rest: Vec<Subject> = subjects.into_iter().filter(|s| !me.is(s)).collect();
            if rest.is_empty() {
                BindingChange::Delete
            } else {
                BindingChange::SetSubjects(rest)
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

/// This installation's RoleBindings: their cache (once [`Bindings::watch`] started it)
/// and their writes.
pub(super) struct Bindings {
    client: Client,
    /// `--watch-namespace`: the only namespace with Databases, when given.
    scope: Option<String>,
    store: OnceLock<Store<RoleBinding>>,
    task: Mutex<Option<AbortHandle>>,
    /// RoleBindings created and not seen in the cache yet, with when.
    created: Mutex<HashMap<String, Instant>>,
}

impl Drop for Bindings {
    /// The watch ends with the leadership, as the namespaces' watches do.
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

impl Bindings {
    pub(super) fn new(client: Client, scope: Option<String>) -> Self {
        Self {
            client,
            scope,
            store: OnceLock::new(),
            task: Mutex::new(None),
            created: Mutex::default(),
        }
    }

    /// Starts the watch of this installation's RoleBindings: by name (the only one it may
    /// list) and dbops' label, in `--watch-namespace` or everywhere.
    pub(super) fn watch(&self) {
        let (store, writer) = reflector::store();
        let (key, value) = label::MANAGED_BY;
        let events = reflector::reflector(
            writer,
            watcher(
                controller::scoped_api::<RoleBinding>(self.client.clone(), self.scope.as_deref()),
                watcher::Config::default()
                    .labels(&format!("{key}={value}"))
                    .fields(&format!("metadata.name={ROLE_BINDING}")),
            )
            .default_backoff()
            .modify(|b| dbops_shared::controller::slim(&mut b.metadata)),
        );
        let task = tokio::spawn(events.for_each(|event| {
            if let Err(error) = &event {
                tracing::warn!(%error, watch = "RoleBinding", "watch failed; retrying with backoff");
            }
            std::future::ready(())
        }));
        let _ = self.store.set(store);
        *self.task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task.abort_handle());
    }

    /// The cache, once the watch started.
    pub(super) fn store(&self) -> Result<&Store<RoleBinding>> {
        self.store
            .get()
            .ok_or_else(|| Error::Internal("the RoleBinding watch has not started".into()))
    }

    /// Whether this process created the namespace's RoleBinding moments ago (within
    /// [`CREATED_GRACE`]) and the cache does not show it yet.
    fn recently_created(&self, namespace: &str, cached: bool) -> bool {
        let mut created = self.created.lock().unwrap_or_else(PoisonError::into_inner);
        created.retain(|_, at| at.elapsed() < CREATED_GRACE);
        if cached {
            created.remove(namespace);
        }
        created.contains_key(namespace)
    }

    /// Makes the namespace's RoleBinding grant `me` exactly when `wanted`, writing only
    /// what differs from the cache (a conflict reads it afresh and plans once more); once
    /// written to grant, waits (bounded) until the apiserver's authorizer does.
    pub(super) async fn bind(
        &self,
        namespace: &str,
        me: &ServiceAccount,
        wanted: bool,
    ) -> Result<()> {
        let cached = self
            .store()?
            .get(&ObjectRef::new(ROLE_BINDING).within(namespace));
        if self.recently_created(namespace, cached.is_some()) && cached.is_none() && wanted {
            // Created moments ago; the watch has not shown it yet.
            return Ok(());
        }
        let api: Api<RoleBinding> = Api::namespaced(self.client.clone(), namespace);
        let mut existing = cached.map(|b| (*b).clone());
        // A second round only after a conflict, with what the API holds now.
        for round in 0..2 {
            let change = plan_binding(existing.as_ref(), me, wanted);
            match &change {
                BindingChange::Keep => return Ok(()),
                BindingChange::Foreign(message) => {
                    return Err(Error::Reported {
                        reason: DatabaseReason::RoleBindingConflict.into(),
                        message: message.clone(),
                    });
                }
                _ => {}
            }
            match write(&api, namespace, me, &change, existing.as_ref()).await {
                Ok(()) => {
                    tracing::info!(namespace, ?change, service_account = %me, "RoleBinding {ROLE_BINDING} written");
                    if change == BindingChange::Create {
                        self.created
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
                    return Err(Error::Reported {
                        reason: DatabaseReason::KubernetesApiError.into(),
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
        let reviews = Api::<SelfSubjectAccessReview>::all(self.client.clone());
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
        let (reviews, review) = (&reviews, &review);
        let granted = dbops_shared::poll::until(GRANT_WAIT, GRANT_POLL, || async move {
            let allowed = reviews
                .create(&PostParams::default(), review)
                .await
                .ok()
                .and_then(|r| r.status)
                .is_some_and(|s| s.allowed);
            Ok::<_, std::convert::Infallible>(allowed.then_some(()))
        })
        .await;
        if !matches!(granted, Ok(Some(()))) {
            tracing::warn!(
                namespace,
                "the RoleBinding {ROLE_BINDING} was written but the apiserver does not let this process list the namespace's Secrets after {GRANT_WAIT:?}: is --service-account the ServiceAccount of its credentials?"
            );
        }
    }
}

/// Writes one change of the namespace's RoleBinding (`existing`: as read).
async fn write(
    api: &Api<RoleBinding>,
    namespace: &str,
    me: &ServiceAccount,
    change: &BindingChange,
    existing: Option<&RoleBinding>,
) -> kube::Result<()> {
    match change {
        BindingChange::Keep | BindingChange::Foreign(_) => Ok(()),
        BindingChange::Create => api
            .create(&PostParams::default(), &desired_binding(namespace, me))
            .await
            .map(|_| ()),
        BindingChange::SetSubjects(subjects) => {
            let mut changed = existing.cloned().unwrap_or_default();
            changed.subjects = Some(subjects.clone());
            api.replace(ROLE_BINDING, &PostParams::default(), &changed)
                .await
                .map(|_| ())
        }
        BindingChange::Delete => {
            let found = existing.map(|b| &b.metadata);
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(plan_binding(None, &me(), true), BindingChange::Create);
        assert_eq!(plan_binding(None, &me(), false), BindingChange::Keep);
        let mine = binding(&[&me()]);
        assert_eq!(plan_binding(Some(&mine), &me(), true), BindingChange::Keep);
        assert_eq!(
            plan_binding(Some(&mine), &me(), false),
            BindingChange::Delete
        );
        // Another installation's ServiceAccount shares the namespace: added to, and left.
        let theirs = binding(&[&other()]);
        assert_eq!(
            plan_binding(Some(&theirs), &me(), true),
            BindingChange::SetSubjects(vec![other().subject(), me().subject()])
        );
        assert_eq!(
            plan_binding(Some(&theirs), &me(), false),
            BindingChange::Keep
        );
        let both = binding(&[&other(), &me()]);
        assert_eq!(
            plan_binding(Some(&both), &me(), false),
            BindingChange::SetSubjects(vec![other().subject()])
        );
        // One dbops did not make (no label, or another role): never written.
        let mut unlabelled = binding(&[&me()]);
        unlabelled.metadata.labels = None;
        assert!(matches!(
            plan_binding(Some(&unlabelled), &me(), true),
            BindingChange::Foreign(m) if m.contains("not made by dbops")
        ));
        assert_eq!(
            plan_binding(Some(&unlabelled), &me(), false),
            BindingChange::Keep
        );
        let mut admin = binding(&[&me()]);
        admin.role_ref.name = "cluster-admin".into();
        assert!(matches!(
            plan_binding(Some(&admin), &me(), false),
            BindingChange::Keep
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
}
