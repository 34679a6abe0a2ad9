//! The pooler of each DatabaseServer that asks for one (`spec.pooler`, issue 36):
//! PgBouncer in the controllers' namespace, kept by the server controller.
//!
//! Each server reconcile renders the pooler's configuration from the caches (`render`:
//! one route per database provisioned on the server, one userlist entry per login with
//! the verifier of the password its connection Secret holds, the login before a rotation
//! while the last userlist still has it) and makes its four objects (`objects`: the
//! Secret the Pods mount, the Deployment, the Service and, with 2 or more replicas, the
//! PodDisruptionBudget) as rendered. Each object carries the digest of what dbops applied
//! (`dbops.dev/applied-sha256`), so a converged pooler costs reads and no write; an object
//! of the pooler's name that dbops did not make is never touched (`PoolerNameTaken`).
//! `PoolerReady` says how many of the Deployment's Pods are ready. Without `spec.pooler`
//! the objects dbops made go (the DatabaseServer also owns them: they go with it).
//!
//! The Deployment's Pod template does not change with the userlist: a new Database or a
//! rotation changes the Secret, which the kubelet brings into the Pods' volume, and the
//! Pods reload it; they are not restarted.

mod objects;
mod render;
mod tls;

use std::collections::BTreeMap;
use std::sync::Arc;

use dbops_api::{Database, DatabaseServer, DatabaseUser, PoolerStatus};
use dbops_shared::pooler::{
    CLIENT_CA_KEY, TLS_CERT_KEY, TLS_KEY_KEY, Userlist, render as render_ini,
};
use dbops_shared::postgres::generate_password;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};

pub use objects::SERVER_ANNOTATION;
pub use render::Verifiers;

use crate::tenant_secrets::TenantSecrets;

/// The field manager of what the pooler applies.
const MANAGER: &str = "dbops-database-controller";

/// What the server controller needs to keep poolers.
pub struct Poolers {
    /// The pooler Pods' image (`--pooler-image`).
    pub image: String,
    pub verifiers: Verifiers,
    /// The user-controller's cache of DatabaseUsers (their logins are served too).
    pub users: Option<kube::runtime::reflector::Store<DatabaseUser>>,
}

/// Where a pooler stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Running,
    Starting(String),
    NameTaken(String),
    ConfigInvalid(String),
}

/// A pooler's status and condition, for the server's status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub status: PoolerStatus,
    pub outcome: Outcome,
}

/// Where poolers are kept: the client, the controllers' namespace, and the caches the
/// configuration is rendered from.
pub struct On<'a> {
    pub client: &'a Client,
    pub namespace: &'a str,
    pub directory: &'a dbops_shared::server::Directory,
    pub tenants: &'a TenantSecrets,
    /// The Migrations: a Database moved away keeps its route while its cutover's
    /// Migration is kept (`render::forwards`).
    pub migrations: &'a [Arc<dbops_api::Migration>],
}

/// Keeps `server`'s pooler as its spec asks: `None` when it asks for none (and what dbops
/// made for one is gone).
pub async fn sync(
    on: &On<'_>,
    poolers: &Poolers,
    server: &DatabaseServer,
    databases: &[Arc<Database>],
) -> Result<Option<Report>, kube::Error> {
    let server_name = server.name_any();
    let name = objects::name(&server_name);
    let Some(settings) = render::settings(server) else {
        if server.status.as_ref().is_some_and(|s| s.pooler.is_some()) {
            remove(on.client, on.namespace, &name, &server_name).await?;
        }
        return Ok(None);
    };
    let mut status = PoolerStatus {
        host: format!("{name}.{}.svc", on.namespace),
        port: i32::from(render::PORT),
        ..Default::default()
    };
    let report = |status: &PoolerStatus, outcome| {
        Ok(Some(Report {
            status: status.clone(),
            outcome,
        }))
    };
    let waiting = match configure(on, poolers, server, databases, &settings, &mut status).await? {
        Ok(waiting) => waiting,
        Err(outcome) => return report(&status, outcome),
    };
    let replicas = render::replicas(server);
    match workloads(on, poolers, server, replicas).await? {
        Ok(ready) => status.ready_replicas = ready,
        Err(outcome) => return report(&status, outcome),
    }
    let outcome = if status.ready_replicas >= replicas {
        Outcome::Running
    } else {
        let mut message = format!("{} of {replicas} pooler Pods ready", status.ready_replicas);
        if !waiting.is_empty() {
            message.push_str(&format!(
                "; {} Databases not served yet (their connection Secrets are not cached): {}",
                waiting.len(),
                waiting
                    .iter()
                    .take(5)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Outcome::Starting(message)
    };
    report(&status, outcome)
}

/// What [`Outcome::NameTaken`] says of `kind` `name`.
fn taken(kind: &str, namespace: &str, name: &str) -> Outcome {
    Outcome::NameTaken(format!(
        "{kind} {namespace}/{name} was not made by dbops for this server; nothing was changed"
    ))
}

/// The pooler's Secret as rendered from the caches (the last userlist and admin password
/// kept): the Databases waiting for their Secret in the cache, or why there is none.
async fn configure(
    on: &On<'_>,
    poolers: &Poolers,
    server: &DatabaseServer,
    databases: &[Arc<Database>],
    settings: &dbops_shared::pooler::Settings,
    status: &mut PoolerStatus,
) -> Result<Result<Vec<String>, Outcome>, kube::Error> {
    let server_name = server.name_any();
    let name = objects::name(&server_name);
    let existing = on.directory.secret(&name);
    if let Some(s) = &existing
        && !objects::is_ours(&s.metadata, &server_name)
    {
        return Ok(Err(taken("Secret", on.namespace, &name)));
    }
    let value = |key: &str| {
        existing
            .as_ref()
            .and_then(|s| s.data.as_ref()?.get(key))
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
    };
    let previous = value(render::USERLIST_KEY)
        .and_then(|t| Userlist::parse(&t).ok())
        .unwrap_or_default();
    let admin_password = value(render::ADMIN_PASSWORD_KEY).unwrap_or_else(generate_password);
    let (cert, key, client_ca) = match certificate(on, server, &name, &value) {
        Ok(found) => found,
        Err(outcome) => return Ok(Err(outcome)),
    };
    let users = poolers
        .users
        .as_ref()
        .map(|s| s.state())
        .unwrap_or_default();
    let forwards = render::forwards(server, on.migrations, databases, |n| on.directory.get(n));
    let tenants = render::Tenants {
        databases,
        users: &users,
        forwards: &forwards,
    };
    let served = render::served(
        server,
        tenants,
        |ns, secret| on.tenants.cached(ns, secret),
        &previous,
        &poolers.verifiers,
        &[(render::ADMIN_USER, &admin_password)],
    );
    status.databases = i32::try_from(served.routes.len()).unwrap_or(i32::MAX);
    status.logins = i32::try_from(served.userlist.len().saturating_sub(1)).unwrap_or(i32::MAX);
    let ini = match render_ini(settings, &served.routes) {
        Ok(ini) => ini,
        Err(e) => return Ok(Err(Outcome::ConfigInvalid(e.to_string()))),
    };
    let data: BTreeMap<String, String> = [
        (render::INI_KEY.to_string(), ini),
        (render::USERLIST_KEY.to_string(), served.userlist.render()),
        (render::ADMIN_PASSWORD_KEY.to_string(), admin_password),
        (TLS_CERT_KEY.to_string(), cert),
        (TLS_KEY_KEY.to_string(), key),
        (CLIENT_CA_KEY.to_string(), client_ca),
    ]
    .into();
    let desired = objects::secret(server, on.namespace, data);
    if existing
        .as_ref()
        .and_then(|s| objects::applied(&s.metadata))
        != objects::applied(&desired.metadata)
    {
        apply(on.client, on.namespace, &desired).await?;
    }
    Ok(Ok(served.waiting))
}

/// The pooler's certificate, key and the CA clients verify it against: the Secret
/// `spec.pooler.certificateSecretRef` names, or the one dbops made before (`value` reads
/// the pooler's Secret as it is), or a new self-signed one.
fn certificate(
    on: &On<'_>,
    server: &DatabaseServer,
    name: &str,
    value: &impl Fn(&str) -> Option<String>,
) -> Result<(String, String, String), Outcome> {
    let named = server
        .spec
        .pooler
        .as_ref()
        .and_then(|p| p.certificate_secret_ref.as_ref());
    if let Some(r) = named {
        return tls::named_certificate(on.directory.secret(&r.name).as_deref(), &r.name)
            .map_err(Outcome::ConfigInvalid);
    }
    match (value(TLS_CERT_KEY), value(TLS_KEY_KEY)) {
        // Made by dbops before (kept; a pooler Secret made before client-ca.crt was has
        // none), unless the last one was named with a CA of its own.
        (Some(cert), Some(key)) if value(CLIENT_CA_KEY).is_none_or(|ca| ca == cert) => {
            Ok((cert.clone(), key, cert))
        }
        _ => tls::serving_certificate(name, on.namespace)
            .map(|(cert, key)| (cert.clone(), key, cert))
            .map_err(Outcome::ConfigInvalid),
    }
}

/// The Service, the budget (with 2 or more replicas) and the Deployment as rendered: the
/// Deployment's ready Pods, or why not.
async fn workloads(
    on: &On<'_>,
    poolers: &Poolers,
    server: &DatabaseServer,
    replicas: i32,
) -> Result<Result<i32, Outcome>, kube::Error> {
    let (client, namespace) = (on.client, on.namespace);
    let server_name = server.name_any();
    let name = objects::name(&server_name);
    if !converge(
        client,
        namespace,
        &objects::service(server, namespace),
        &server_name,
    )
    .await?
    {
        return Ok(Err(taken("Service", namespace, &name)));
    }
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), namespace);
    if replicas >= 2 {
        let budget = objects::disruption_budget(server, namespace);
        if !converge(client, namespace, &budget, &server_name).await? {
            return Ok(Err(taken("PodDisruptionBudget", namespace, &name)));
        }
    } else if let Some(b) = budgets.get_opt(&name).await?
        && objects::is_ours(&b.metadata, &server_name)
    {
        budgets.delete(&name, &DeleteParams::default()).await?;
    }
    let deployment = objects::deployment(server, namespace, &poolers.image);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let live = match deployments.get_opt(&name).await? {
        Some(d) if !objects::is_ours(&d.metadata, &server_name) => {
            return Ok(Err(taken("Deployment", namespace, &name)));
        }
        Some(d) if objects::applied(&d.metadata) == objects::applied(&deployment.metadata) => d,
        _ => apply(client, namespace, &deployment).await?,
    };
    Ok(Ok(live
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0)))
}

/// What the pooler's four objects have in common.
trait Object:
    Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + serde::Serialize
    + serde::de::DeserializeOwned
    + std::fmt::Debug
{
}

impl<K> Object for K where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug
{
}

/// Applies `object` (server-side apply, dbops's field manager) and returns it as stored.
async fn apply<K: Object>(client: &Client, namespace: &str, object: &K) -> Result<K, kube::Error> {
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    api.patch(
        &object.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
}

/// Makes `object` as rendered unless the live one already is: `false` when an object of
/// its name is not dbops's (nothing is written then).
async fn converge<K: Object>(
    client: &Client,
    namespace: &str,
    object: &K,
    server: &str,
) -> Result<bool, kube::Error> {
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    match api.get_opt(&object.name_any()).await? {
        Some(live) if !objects::is_ours(live.meta(), server) => Ok(false),
        Some(live) if objects::applied(live.meta()) == objects::applied(object.meta()) => Ok(true),
        _ => apply(client, namespace, object).await.map(|_| true),
    }
}

/// Deletes what dbops made for `server`'s pooler (only objects it marked as its own).
async fn remove(
    client: &Client,
    namespace: &str,
    name: &str,
    server: &str,
) -> Result<(), kube::Error> {
    delete::<Deployment>(client, namespace, name, server).await?;
    delete::<PodDisruptionBudget>(client, namespace, name, server).await?;
    delete::<Service>(client, namespace, name, server).await?;
    delete::<Secret>(client, namespace, name, server).await
}

/// Deletes the `K` `name` if dbops made it for `server`.
async fn delete<K: Object>(
    client: &Client,
    namespace: &str,
    name: &str,
    server: &str,
) -> Result<(), kube::Error> {
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    if let Some(live) = api.get_opt(name).await?
        && objects::is_ours(live.meta(), server)
    {
        api.delete(name, &DeleteParams::default()).await?;
    }
    Ok(())
}
