//! DatabaseServers as the three controllers see them: the cluster-scoped objects, their
//! admin and CA Secrets (read in the controllers' own namespace only) and the labels of
//! namespaces (for `allowedNamespaces`), each kept by a watch so that a reconcile resolves
//! a `serverRef` without an API call.
//!
//! Only Secrets of the controllers' namespace are cached here; a tenant's Secrets never
//! are. `--server-selector` narrows the DatabaseServers an installation serves (several
//! installations, or the tests' controllers, side by side in one cluster).

use std::sync::Arc;
use std::time::Duration;

use dbops_api::{DatabaseServer, SharedReason, TlsMode};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::Api;
use kube::core::{PartialObjectMeta, Selector, SelectorExt};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::postgres::{CaBundle, Credentials, CredentialsError, Endpoint, ServerKey, TlsSettings};
use crate::shared_watch::{SharedWatch, WatchTask};

/// How long a reconcile waits for the server, Secret and namespace caches to fill after
/// the process starts, before it reports `CacheNotSynced` and backs off.
const SYNC_WAIT: Duration = Duration::from_secs(30);

/// Why a `serverRef` cannot be used, sorted for a condition's reason.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ServerError {
    #[error("DatabaseServer {0:?} not found")]
    NotFound(String),
    #[error("DatabaseServer {server:?} does not allow namespace {namespace:?}: {detail}")]
    NamespaceNotAllowed {
        server: String,
        namespace: String,
        detail: String,
    },
    #[error(
        "DatabaseServer {server:?}: admin Secret {secret} not found (in the controllers' namespace)"
    )]
    AdminSecretNotFound { server: String, secret: String },
    #[error("DatabaseServer {server:?}: {message}")]
    AdminSecretInvalid { server: String, message: String },
    #[error(
        "DatabaseServer {server:?}: CA Secret {secret} not found (in the controllers' namespace)"
    )]
    CaSecretNotFound { server: String, secret: String },
    #[error("DatabaseServer {server:?}: CA Secret {secret}: {message}")]
    CaSecretInvalid {
        server: String,
        secret: String,
        message: String,
    },
    #[error("DatabaseServer {0:?} is being deleted")]
    Deleting(String),
    #[error("the caches of DatabaseServers, their Secrets and namespaces have not synced yet")]
    NotSynced,
}

impl ServerError {
    /// The condition reason.
    pub fn reason(&self) -> SharedReason {
        match self {
            ServerError::NotFound(_) => SharedReason::ServerNotFound,
            ServerError::NamespaceNotAllowed { .. } => SharedReason::NamespaceNotAllowed,
            ServerError::AdminSecretNotFound { .. } => SharedReason::AdminSecretNotFound,
            ServerError::AdminSecretInvalid { .. } => SharedReason::AdminSecretInvalid,
            ServerError::CaSecretNotFound { .. } => SharedReason::CASecretNotFound,
            ServerError::CaSecretInvalid { .. } => SharedReason::CASecretInvalid,
            ServerError::Deleting(_) => SharedReason::ServerDeleting,
            ServerError::NotSynced => SharedReason::CacheNotSynced,
        }
    }

    /// Whether only time can cure it (the others wait for an object to change).
    pub fn is_transient(&self) -> bool {
        matches!(self, ServerError::NotSynced)
    }
}

/// A DatabaseServer resolved for one use: where, how and as whom.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub name: String,
    pub endpoint: Endpoint,
    pub credentials: Credentials,
    pub server: Arc<DatabaseServer>,
    /// The server's pooler, once dbops has made it (`spec.pooler`).
    pub pooler: Option<crate::pooler::Access>,
}

/// The DatabaseServers this installation serves, their Secrets and the namespaces' labels.
#[derive(Clone)]
pub struct Directory {
    servers: Store<DatabaseServer>,
    secrets: Store<Secret>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    /// The same three watches, for the controllers of the process to follow (one watch of
    /// each kind per process): they run from the process's start, so a controller that
    /// subscribes once it leads first hears of everything the caches hold.
    watches: Arc<Watches>,
    controller_namespace: Arc<str>,
    selector: Option<String>,
}

/// The Directory's watches, ended when the last Directory goes.
struct Watches {
    servers: SharedWatch<DatabaseServer>,
    secrets: SharedWatch<Secret>,
    namespaces: SharedWatch<PartialObjectMeta<Namespace>>,
    _tasks: [WatchTask; 3],
}

impl Directory {
    /// Starts the three watches (DatabaseServers matching `selector`, the Secrets of
    /// `controller_namespace`, the namespaces' metadata) and returns their caches.
    pub fn watch(
        client: &kube::Client,
        controller_namespace: &str,
        selector: Option<&str>,
    ) -> Self {
        let servers = SharedWatch::new(
            "DatabaseServer",
            watcher(
                Api::<DatabaseServer>::all(client.clone()),
                server_watch_config(selector),
            )
            .modify(|s| crate::controller::slim(&mut s.metadata))
            .default_backoff(),
        );
        let secrets = SharedWatch::new(
            "controller-namespace Secret",
            watcher(
                Api::<Secret>::namespaced(client.clone(), controller_namespace),
                watcher::Config::default(),
            )
            .modify(|s| crate::controller::slim(&mut s.metadata))
            .default_backoff(),
        );
        let namespaces = SharedWatch::new(
            "Namespace",
            watcher(
                Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
                watcher::Config::default(),
            )
            .modify(|n| crate::controller::slim(&mut n.metadata))
            .default_backoff(),
        );
        let tasks = [servers.start(), secrets.start(), namespaces.start()];
        Self {
            servers: servers.store(),
            secrets: secrets.store(),
            namespaces: namespaces.store(),
            watches: Arc::new(Watches {
                servers,
                secrets,
                namespaces,
                _tasks: tasks,
            }),
            controller_namespace: Arc::from(controller_namespace),
            selector: selector.map(str::to_string),
        }
    }

    /// The watch of the DatabaseServers this installation serves.
    pub fn servers_watch(&self) -> &SharedWatch<DatabaseServer> {
        &self.watches.servers
    }

    /// The watch of the Secrets of the controllers' namespace.
    pub fn secrets_watch(&self) -> &SharedWatch<Secret> {
        &self.watches.secrets
    }

    /// The watch of the namespaces' metadata.
    pub fn namespaces_watch(&self) -> &SharedWatch<PartialObjectMeta<Namespace>> {
        &self.watches.namespaces
    }

    /// [`Directory::watch`] with the process's `--controller-namespace` and
    /// `--server-selector`.
    pub fn for_process(client: &kube::Client, args: &crate::cli::CommonArgs) -> Self {
        Self::watch(
            client,
            &args.controller_namespace,
            args.server_selector.as_deref(),
        )
    }

    /// The watch config for DatabaseServers: the `--server-selector`, if any.
    pub fn server_config(&self) -> watcher::Config {
        server_watch_config(self.selector.as_deref())
    }

    /// The controllers' namespace, where admin and CA Secrets live.
    pub fn controller_namespace(&self) -> &str {
        &self.controller_namespace
    }

    /// Waits (bounded) until the three caches have their first full list.
    pub async fn synced(&self) -> Result<(), ServerError> {
        let all = async {
            let (a, b, c) = tokio::join!(
                crate::store_ready::until_ready(&self.servers),
                crate::store_ready::until_ready(&self.secrets),
                crate::store_ready::until_ready(&self.namespaces)
            );
            a.and(b).and(c)
        };
        match tokio::time::timeout(SYNC_WAIT, all).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(ServerError::NotSynced),
        }
    }

    /// The DatabaseServer `name`, if this installation serves it.
    pub fn get(&self, name: &str) -> Option<Arc<DatabaseServer>> {
        self.servers.get(&ObjectRef::new(name))
    }

    /// Every DatabaseServer this installation serves.
    pub fn all(&self) -> Vec<Arc<DatabaseServer>> {
        self.servers.state()
    }

    /// The servers whose admin, CA or pooler certificate Secret is `secret` (a Secret of
    /// the controllers' namespace).
    pub fn using_secret(&self, secret: &str) -> Vec<String> {
        self.servers
            .state()
            .iter()
            .filter(|s| {
                let pooler_certificate = s
                    .spec
                    .pooler
                    .as_ref()
                    .and_then(|p| p.certificate_secret_ref.as_ref());
                s.spec.admin_secret_ref.name == secret
                    || s.spec.tls.ca_secret_ref.as_ref().map(|r| r.name.as_str()) == Some(secret)
                    || pooler_certificate.map(|r| r.name.as_str()) == Some(secret)
            })
            .filter_map(|s| s.metadata.name.clone())
            .collect()
    }

    /// Whether `server` lets Databases of `namespace` on it; `Err` says why not.
    pub fn admits(&self, server: &DatabaseServer, namespace: &str) -> Result<(), ServerError> {
        let name = server.metadata.name.clone().unwrap_or_default();
        let refuse = |detail: String| ServerError::NamespaceNotAllowed {
            server: name.clone(),
            namespace: namespace.to_string(),
            detail,
        };
        let Some(selector) = &server.spec.allowed_namespaces else {
            return Err(refuse(
                "it allows no namespace (spec.allowedNamespaces is not set)".into(),
            ));
        };
        let selector = Selector::try_from(selector.clone()).map_err(|e| {
            refuse(format!(
                "spec.allowedNamespaces is not a valid selector: {e}"
            ))
        })?;
        let Some(ns) = self.namespaces.get(&ObjectRef::new(namespace)) else {
            return Err(refuse("the namespace was not found".into()));
        };
        let labels = ns.metadata.labels.clone().unwrap_or_default();
        if selector.matches(&labels) {
            Ok(())
        } else {
            Err(refuse(
                "its labels do not match spec.allowedNamespaces".to_string(),
            ))
        }
    }

    /// Whether namespace `name` is being deleted (or already gone).
    pub fn namespace_terminating(&self, name: &str) -> bool {
        self.namespaces
            .get(&ObjectRef::new(name))
            .is_none_or(|ns| ns.metadata.deletion_timestamp.is_some())
    }

    /// The server `name` with its endpoint and admin credentials, read from the caches.
    pub fn resolve(&self, name: &str) -> Result<Resolved, ServerError> {
        let server = self
            .get(name)
            .ok_or_else(|| ServerError::NotFound(name.to_string()))?;
        self.resolve_server(server)
    }

    /// [`Directory::resolve`] of a server already in hand.
    pub fn resolve_server(&self, server: Arc<DatabaseServer>) -> Result<Resolved, ServerError> {
        let name = server.metadata.name.clone().unwrap_or_default();
        let endpoint = self.endpoint(&server)?;
        let admin = &server.spec.admin_secret_ref.name;
        let secret = self
            .secret(admin)
            .ok_or_else(|| ServerError::AdminSecretNotFound {
                server: name.clone(),
                secret: format!("{}/{admin}", self.controller_namespace),
            })?;
        let credentials =
            Credentials::from_secret(&secret).map_err(|e| ServerError::AdminSecretInvalid {
                server: name.clone(),
                message: match e {
                    CredentialsError::MissingKey(s, k) => format!(
                        "admin Secret {}/{s} has no key {k:?} (it needs username and password)",
                        self.controller_namespace
                    ),
                    CredentialsError::NotUtf8(s, k) => format!(
                        "admin Secret {}/{s} key {k:?} is not UTF-8",
                        self.controller_namespace
                    ),
                },
            })?;
        let pooler = crate::pooler::access(&server, &self.controller_namespace, |n| self.secret(n));
        Ok(Resolved {
            name,
            endpoint,
            credentials,
            server,
            pooler,
        })
    }

    /// Where and with which TLS the controllers reach `server` (its CA from the cache).
    pub fn endpoint(&self, server: &DatabaseServer) -> Result<Endpoint, ServerError> {
        let name = server.metadata.name.clone().unwrap_or_default();
        let ca = match &server.spec.tls.ca_secret_ref {
            None => None,
            Some(reference) => {
                let secret_name = format!("{}/{}", self.controller_namespace, reference.name);
                let secret =
                    self.secret(&reference.name)
                        .ok_or_else(|| ServerError::CaSecretNotFound {
                            server: name.clone(),
                            secret: secret_name.clone(),
                        })?;
                let invalid = |message: String| ServerError::CaSecretInvalid {
                    server: name.clone(),
                    secret: secret_name.clone(),
                    message,
                };
                let pem = secret
                    .data
                    .as_ref()
                    .and_then(|d| d.get("ca.crt"))
                    .map(|b| b.0.clone())
                    .or_else(|| {
                        secret
                            .string_data
                            .as_ref()
                            .and_then(|d| d.get("ca.crt"))
                            .map(|s| s.clone().into_bytes())
                    })
                    .ok_or_else(|| invalid("has no key \"ca.crt\"".into()))?;
                Some(CaBundle::from_pem(&pem).map_err(|e| invalid(format!("ca.crt: {e}")))?)
            }
        };
        Ok(Endpoint {
            key: key_of(server),
            tls: TlsSettings {
                mode: server.spec.tls.mode,
                ca,
            },
        })
    }

    /// The resourceVersion of Secret `name` of the controllers' namespace, if cached.
    pub fn secret_version(&self, name: &str) -> Option<String> {
        self.secret(name)
            .and_then(|s| s.metadata.resource_version.clone())
    }

    /// Secret `name` of the controllers' namespace, if cached.
    pub fn secret(&self, name: &str) -> Option<Arc<Secret>> {
        self.secrets
            .get(&ObjectRef::new(name).within(&self.controller_namespace))
    }
}

/// `host:port` of a server.
pub fn key_of(server: &DatabaseServer) -> ServerKey {
    ServerKey {
        host: server.spec.host.clone(),
        port: u16::try_from(server.spec.port).unwrap_or(5432),
    }
}

/// The libpq `sslmode` applications use for `server`.
pub fn ssl_mode(server: &DatabaseServer) -> TlsMode {
    server.spec.tls.mode
}

fn server_watch_config(selector: Option<&str>) -> watcher::Config {
    match selector {
        Some(selector) => watcher::Config::default().labels(selector),
        None => watcher::Config::default(),
    }
}
