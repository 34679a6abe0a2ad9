//! Whether the object a reconcile read is still the live one of its name. Checked before
//! each change on the server and before a connection Secret or status is written, so that
//! what a reconcile waited for on the way never makes it act for an object that is gone.

use std::fmt::Debug;

use k8s_openapi::NamespaceResourceScope;
use kube::api::Api;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::error::{Error, Result, Why};

/// What a reconcile acts for and checks the liveness of: a Database or a DatabaseUser
/// (any namespaced kind the API can GET).
pub(crate) trait Held:
    Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + Debug + DeserializeOwned
{
}

impl<K> Held for K where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
{
}

/// Confirms that `held`, the Database or DatabaseUser this reconcile read when it began,
/// is still the live object of its name: the same UID, not being deleted, at the same generation. Called
/// before each change on the server (and before its connection Secret is written), so
/// after whatever the reconcile waited for on the way: its namespace's connection Secrets
/// (`tenant_secrets`: a RoleBinding in force, a first list), a session slot on the
/// server, a restore's checksum. A Database deleted and created again with the same name
/// meanwhile must not get the role and database of the one that went (marked as the
/// deleted UID's, they would belong to nobody and block the new one). Otherwise
/// [`Error::Superseded`], which abandons the reconcile without writing anything.
///
/// A read of the API, not of the cache (which is what the reconcile began with): a GET,
/// which the apiserver answers from etcd. It was a LIST by name (the RBAC then had no
/// `get`); a consistent LIST is served from the watch cache once the cache has caught up
/// with etcd, which under a burst of writes made it the slowest request of a reconcile,
/// made while holding a session slot (issue 25).
pub(crate) async fn confirm_live<K: Held>(client: &kube::Client, held: &K) -> Result<()> {
    let api: Api<K> = Api::namespaced(client.clone(), &held.namespace().unwrap_or_default());
    let live = api.get_opt(&held.name_any()).await?;
    match superseded(held, live.as_ref()) {
        Some(why) => Err(Error::Superseded(why)),
        None => Ok(()),
    }
}

/// What a status write guarded by the UID that found no object of that UID
/// (`dbops_shared::status::Write::Gone`) means for the reconcile: [`Error::Superseded`]
/// when the object is gone or replaced (the reconcile is abandoned), else (the write
/// raced a read that says it is live) a retry with `reason`.
pub(crate) async fn status_write_gone<K: Held>(
    client: &kube::Client,
    held: &K,
    reason: impl Into<Why>,
) -> Result<()> {
    confirm_live(client, held).await?;
    Err(Error::Reported {
        reason: reason.into(),
        message: format!(
            "the status write found no {} {} of UID {}, yet it is the live one; trying again",
            K::kind(&()),
            held.name_any(),
            held.uid().unwrap_or_default()
        ),
    })
}

/// Why `held`, the object a reconcile read (a Database, a DatabaseUser), is no longer the
/// one to act for, given `live`, the object of that name now (`None`: there is none);
/// `None` while it still is.
pub(crate) fn superseded<K>(held: &K, live: Option<&K>) -> Option<String>
where
    K: kube::Resource<DynamicType = ()>,
{
    let what = format!(
        "{} {}/{} (UID {})",
        K::kind(&()),
        held.namespace().unwrap_or_default(),
        held.name_any(),
        held.uid().unwrap_or_default()
    );
    let Some(live) = live else {
        return Some(format!("{what} is gone"));
    };
    if live.uid() != held.uid() {
        return Some(format!(
            "{what} was deleted; the {} of that name now is UID {}",
            K::kind(&()),
            live.uid().unwrap_or_default()
        ));
    }
    if live.meta().deletion_timestamp.is_some() && held.meta().deletion_timestamp.is_none() {
        return Some(format!("{what} is being deleted"));
    }
    if live.meta().generation != held.meta().generation {
        return Some(format!(
            "{what} is at generation {} now; this reconcile read generation {}",
            live.meta().generation.unwrap_or_default(),
            held.meta().generation.unwrap_or_default()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_api::Database;

    #[test]
    fn a_reconcile_acts_only_for_the_live_database_of_its_name() {
        let mut held: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "uid-orders"},
            "spec": {"serverRef": {"name": "pg-main"}}
        }))
        .unwrap();
        held.metadata.generation = Some(1);
        // Still the live one (its status may have moved on): nothing to say.
        let mut live = held.clone();
        live.metadata.resource_version = Some("42".into());
        assert_eq!(superseded(&held, Some(&live)), None);
        // Gone.
        let gone = superseded(&held, None).unwrap();
        assert!(
            gone.contains("uid-orders") && gone.contains("gone"),
            "{gone}"
        );
        // Deleted and created again with the same name: another UID.
        let mut successor = held.clone();
        successor.metadata.uid = Some("uid-successor".into());
        let replaced = superseded(&held, Some(&successor)).unwrap();
        assert!(replaced.contains("uid-successor"), "{replaced}");
        // Being deleted since.
        let mut deleting = held.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(superseded(&held, Some(&deleting)).is_some());
        // Its spec changed since: the next reconcile acts on the new generation.
        let mut changed = held.clone();
        changed.metadata.generation = Some(2);
        assert!(superseded(&held, Some(&changed)).is_some_and(|m| m.contains("generation 2")));
    }
}
