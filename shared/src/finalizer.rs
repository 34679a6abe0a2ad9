//! A finalizer that is present exactly when deletion has work to do outside the cluster.
//!
//! Edited with a merge patch that carries the resourceVersion, never through
//! server-side apply (a field manager would then "own" the finalizer) and never as a
//! lost update.

use std::fmt::Debug;

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;

/// Adds (`present`) or removes `finalizer` on `obj` if it is not already so. A removal
/// from an object that is already gone is success.
pub async fn set<K>(
    obj: &K,
    api: &Api<K>,
    finalizer: &str,
    present: bool,
) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let has = obj.finalizers().iter().any(|f| f == finalizer);
    if has == present {
        return Ok(());
    }
    let mut finalizers: Vec<String> = obj
        .finalizers()
        .iter()
        .filter(|f| *f != finalizer)
        .cloned()
        .collect();
    if present {
        finalizers.push(finalizer.to_string());
    }
    let patch =
        json!({"metadata": {"finalizers": finalizers, "resourceVersion": obj.resource_version()}});
    match api
        .patch(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 && !present => Ok(()),
        Err(e) => Err(e),
    }
}
