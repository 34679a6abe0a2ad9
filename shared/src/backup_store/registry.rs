//! The backup store's registration: the ConfigMap `dbops-backup-store` in the controllers'
//! namespace (`--controller-namespace`, `$POD_NAMESPACE`) records the identity
//! ([`StoreIdentity`]) and URL of the store the controllers share. The backup-controller
//! writes artifacts there and the database-controller reads them back for
//! `spec.restoreFrom`; a controller pointed at another store (another bucket, a volume
//! that is not shared, a mount missing in one pod) would otherwise fail only at the first
//! restore, long after the misconfiguration.
//!
//! [`check`] runs before a controller starts: the store must be writable (`file://`), its
//! identity is read (or created), and the ConfigMap is created with it when absent (a
//! lost create race reads the winner's). A ConfigMap naming another identity is a
//! [`CheckError::Mismatch`]; nothing here updates or deletes the ConfigMap: a store moved
//! on purpose is acknowledged by deleting it. Needs `get` and `create` on `configmaps` in
//! that namespace, nothing more.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use dbops_api::ProcessReason;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

use super::error::StoreError;
use super::identity::StoreIdentity;
use super::store::BackupStore;

/// The name of the registration ConfigMap.
pub const CONFIG_MAP: &str = "dbops-backup-store";
/// Its key holding the store's identity.
pub const ID_KEY: &str = "id";
/// Its key holding the store's URL (as `--backup-store` shows it; never a credential).
pub const URL_KEY: &str = "url";
/// The bound on each store operation and API call of a check.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a controller must not start on its backup store (yet).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// This process cannot write to its `file://` store.
    #[error("{0}; this process must be able to write there")]
    NotWritable(#[source] StoreError),
    /// The store is not the one registered by the controllers' peers.
    #[error(
        "this process's backup store {url} has identity {identity}, the registered store \
         (ConfigMap {namespace}/{CONFIG_MAP}, url {registered_url}) has identity \
         {registered_identity}{same_url}; both the backup-controller and the \
         database-controller must mount/point to the same store; if the store was moved on \
         purpose, delete that ConfigMap",
        same_url = if url == registered_url {
            " (the same URL names different storage: a volume that is not shared)"
        } else {
            ""
        }
    )]
    Mismatch {
        url: String,
        identity: StoreIdentity,
        namespace: String,
        registered_url: String,
        /// What the ConfigMap holds (`(none)` when it has no id).
        registered_identity: String,
    },
    /// The store or the API could not be asked (unreachable, timed out, refused).
    #[error("{0}")]
    Unavailable(String),
}

impl CheckError {
    /// The reason `/readyz` and the logs show.
    pub fn reason(&self) -> ProcessReason {
        match self {
            Self::NotWritable(_) => ProcessReason::BackupStoreNotWritable,
            Self::Mismatch { .. } => ProcessReason::BackupStoreMismatch,
            Self::Unavailable(_) => ProcessReason::BackupStoreUnavailable,
        }
    }
}

/// The outcome of a passed [`check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    pub identity: StoreIdentity,
    /// Whether this process created the ConfigMap.
    pub created: bool,
}

/// Checks `store` before a controller starts: writable (`file://`), its identity read or
/// created, and the same identity as the one registered in `namespace` (registered here
/// when nothing is). Each store operation and API call is bounded by [`CALL_TIMEOUT`].
pub async fn check(
    client: &Client,
    namespace: &str,
    store: &BackupStore,
) -> Result<Registered, CheckError> {
    bounded(
        &format!("probing that {store} is writable"),
        store.probe_writable(),
    )
    .await
    .map_err(|e| match e {
        Bounded::Failed(e) => CheckError::NotWritable(e),
        Bounded::TimedOut(message) => CheckError::Unavailable(message),
    })?;
    let identity = bounded(
        &format!("reading the identity of {store}"),
        store.identity(),
    )
    .await
    .map_err(|e| match e {
        Bounded::Failed(e) => CheckError::Unavailable(e.to_string()),
        Bounded::TimedOut(message) => CheckError::Unavailable(message),
    })?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let (registration, created) = match get(&api, namespace).await? {
        Some(found) => (found, false),
        None => {
            let created = bounded(
                &format!("creating ConfigMap {namespace}/{CONFIG_MAP}"),
                api.create(
                    &PostParams::default(),
                    &new_registration(namespace, store, &identity),
                ),
            )
            .await;
            match created {
                Ok(made) => (made, true),
                // Another process registered first: compare with what it wrote.
                Err(Bounded::Failed(kube::Error::Api(status))) if status.code == 409 => {
                    let found = get(&api, namespace).await?;
                    let found = found.ok_or_else(|| {
                        CheckError::Unavailable(format!(
                            "ConfigMap {namespace}/{CONFIG_MAP} was created by another \
                             process and deleted again; retrying"
                        ))
                    })?;
                    (found, false)
                }
                Err(e) => return Err(api_error("creating", namespace, e)),
            }
        }
    };
    compare(store, &identity, namespace, &registration)?;
    Ok(Registered { identity, created })
}

/// Whether `registration` names `identity`; the mismatch otherwise.
fn compare(
    store: &BackupStore,
    identity: &StoreIdentity,
    namespace: &str,
    registration: &ConfigMap,
) -> Result<(), CheckError> {
    let data = registration.data.as_ref();
    let registered = data.and_then(|d| d.get(ID_KEY)).map(String::as_str);
    if registered.and_then(StoreIdentity::parse).as_ref() == Some(identity) {
        return Ok(());
    }
    Err(CheckError::Mismatch {
        url: store.to_string(),
        identity: identity.clone(),
        namespace: namespace.to_owned(),
        registered_url: data
            .and_then(|d| d.get(URL_KEY))
            .cloned()
            .unwrap_or_else(|| "(none)".to_owned()),
        registered_identity: registered
            .filter(|id| !id.trim().is_empty())
            .unwrap_or("(none)")
            .to_owned(),
    })
}

/// The ConfigMap this process creates when none exists.
fn new_registration(namespace: &str, store: &BackupStore, identity: &StoreIdentity) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(CONFIG_MAP.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_owned(),
                "dbops".to_owned(),
            )])),
            annotations: Some(BTreeMap::from([(
                "dbops.dev/description".to_owned(),
                "The backup store the dbops backup-controller and database-controller share. \
                 Delete this ConfigMap only after moving the store on purpose."
                    .to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([
            (ID_KEY.to_owned(), identity.to_string()),
            (URL_KEY.to_owned(), store.to_string()),
        ])),
        ..ConfigMap::default()
    }
}

async fn get(api: &Api<ConfigMap>, namespace: &str) -> Result<Option<ConfigMap>, CheckError> {
    bounded(
        &format!("reading ConfigMap {namespace}/{CONFIG_MAP}"),
        api.get_opt(CONFIG_MAP),
    )
    .await
    .map_err(|e| api_error("reading", namespace, e))
}

fn api_error(doing: &str, namespace: &str, e: Bounded<kube::Error>) -> CheckError {
    let error = match e {
        Bounded::TimedOut(message) => return CheckError::Unavailable(message),
        Bounded::Failed(error) => error,
    };
    let hint = match &error {
        kube::Error::Api(status) if status.code == 403 => format!(
            " (the controller's ServiceAccount needs get and create on configmaps in \
             {namespace})"
        ),
        kube::Error::Api(status) if status.code == 404 => format!(
            " (does the namespace {namespace} exist? it is --controller-namespace, \
             $POD_NAMESPACE)"
        ),
        _ => String::new(),
    };
    CheckError::Unavailable(format!(
        "{doing} ConfigMap {namespace}/{CONFIG_MAP}: {error}{hint}"
    ))
}

/// A step that failed or did not finish in [`CALL_TIMEOUT`].
enum Bounded<E> {
    Failed(E),
    /// The message: what timed out, after how long.
    TimedOut(String),
}

async fn bounded<T, E>(
    what: &str,
    work: impl Future<Output = Result<T, E>>,
) -> Result<T, Bounded<E>> {
    match tokio::time::timeout(CALL_TIMEOUT, work).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Bounded::Failed(e)),
        Err(_) => Err(Bounded::TimedOut(format!(
            "{what} timed out after {}s",
            CALL_TIMEOUT.as_secs()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(id: Option<&str>, url: &str) -> ConfigMap {
        let mut data = BTreeMap::from([(URL_KEY.to_owned(), url.to_owned())]);
        if let Some(id) = id {
            data.insert(ID_KEY.to_owned(), id.to_owned());
        }
        ConfigMap {
            data: Some(data),
            ..ConfigMap::default()
        }
    }

    #[test]
    fn the_same_identity_passes_whatever_the_url() {
        let store: BackupStore = "file:///mnt/backups".parse().unwrap();
        let id = StoreIdentity::parse("0123456789abcdef0123456789abcdef").unwrap();
        let cm = registered(Some("0123456789abcdef0123456789abcdef\n"), "s3://other");
        assert!(compare(&store, &id, "dbops-system", &cm).is_ok());
    }

    #[test]
    fn another_identity_is_a_mismatch_that_says_what_to_do() {
        let store: BackupStore = "file:///var/lib/dbops/backups".parse().unwrap();
        let id = StoreIdentity::parse("aaaa").unwrap();
        let cm = registered(Some("bbbb"), "file:///var/lib/dbops/backups");
        let e = compare(&store, &id, "dbops-system", &cm).unwrap_err();
        assert_eq!(e.reason(), "BackupStoreMismatch");
        let text = e.to_string();
        for part in [
            "this process's backup store file:///var/lib/dbops/backups has identity aaaa",
            "(ConfigMap dbops-system/dbops-backup-store, url file:///var/lib/dbops/backups) has identity bbbb",
            "a volume that is not shared",
            "delete that ConfigMap",
        ] {
            assert!(text.contains(part), "{part:?} missing from: {text}");
        }

        let empty = registered(None, "s3://b/p");
        let e = compare(&store, &id, "ns", &empty).unwrap_err();
        assert!(e.to_string().contains("has identity (none)"), "{e}");
        assert!(!e.to_string().contains("not shared"), "{e}");
    }

    #[test]
    fn the_registration_holds_the_id_and_the_url_only() {
        let store: BackupStore = "s3://bucket/dbops".parse().unwrap();
        let id = StoreIdentity::parse("cafe").unwrap();
        let cm = new_registration("dbops-system", &store, &id);
        assert_eq!(cm.metadata.name.as_deref(), Some(CONFIG_MAP));
        assert_eq!(
            cm.data,
            Some(BTreeMap::from([
                ("id".to_owned(), "cafe".to_owned()),
                ("url".to_owned(), "s3://bucket/dbops".to_owned()),
            ]))
        );
    }
}
