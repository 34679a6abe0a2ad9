//! Readiness of Databases and users, the credentials of a Secret, and the wait for many
//! objects at once (one watch, bounded in all and without progress).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dbops_api::DatabaseUser;
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

pub(crate) fn ready(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

pub(crate) fn user_ready(u: &DatabaseUser) -> bool {
    u.status.as_ref().is_some_and(|s| {
        s.observed_generation == u.metadata.generation && ready(&s.conditions) && s.role.is_some()
    })
}

pub(crate) fn username(s: &Secret) -> Option<String> {
    s.data
        .as_ref()?
        .get("username")
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
}

pub(crate) fn password(s: &Secret) -> Option<String> {
    s.data
        .as_ref()?
        .get("password")
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
}

/// The bound of a wait: in all, and without progress (no object newly done).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bound {
    pub(crate) total: Duration,
    pub(crate) stall: Duration,
}

/// Waits (one watch, no polling) until `want` objects of `api` satisfy `done` in their
/// latest version; the seconds since `t0` then. At most `bound.total`, and fails sooner
/// when no object became done for `bound.stall`, naming some that are not.
pub(crate) async fn wait_all<K>(
    api: Api<K>,
    want: usize,
    t0: Instant,
    bound: Bound,
    done: impl Fn(&K) -> bool,
) -> Result<f64>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let mut seen: BTreeMap<String, bool> = BTreeMap::new();
    let stream = watcher(api, watcher::Config::default()).applied_objects();
    futures::pin_mut!(stream);
    let deadline = tokio::time::Instant::now() + bound.total;
    let mut progress = tokio::time::Instant::now();
    let not_done = |seen: &BTreeMap<String, bool>| {
        let names: Vec<&str> = seen
            .iter()
            .filter(|(_, d)| !**d)
            .map(|(n, _)| n.as_str())
            .take(5)
            .collect();
        let done = seen.values().filter(|d| **d).count();
        format!(
            "{done} of {want} {kind}s done, {} seen; not done: {}",
            seen.len(),
            names.join(", ")
        )
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {
                bail!("{} after {:?}", not_done(&seen), bound.total)
            }
            _ = tokio::time::sleep_until(progress + bound.stall) => {
                bail!("{}; none newly done for {:?}", not_done(&seen), bound.stall)
            }
            next = stream.try_next() => {
                let Some(obj) = next? else { bail!("the {kind} watch ended") };
                let is_done = done(&obj);
                if seen.insert(obj.name_any(), is_done) != Some(true) && is_done {
                    progress = tokio::time::Instant::now();
                }
                if seen.values().filter(|d| **d).count() >= want {
                    return Ok(t0.elapsed().as_secs_f64());
                }
            }
        }
    }
}
