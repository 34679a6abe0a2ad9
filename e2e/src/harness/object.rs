//! What a harness waits on: an object the API serves (a Database, a Backup, a Migration,
//! ...), as `crate::wait::object_or_logs` takes it, and a harness that shows its
//! controllers' logs when a wait times out.

use std::fmt::Debug;
use std::time::Duration;

use kube::api::Api;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A kind of object a harness polls until it is as a test wants it.
pub trait Object:
    kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug
{
}

impl<K> Object for K where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug
{
}

/// A harness whose waits, on a timeout, show the object as last seen and its controllers'
/// logs.
// Not bound to `Send`: a test awaits its harness on its own task.
#[allow(async_fn_in_trait)]
pub trait Logged {
    /// The controllers' logs, redacted, for a failure message.
    fn logs_of_all(&self) -> String;

    /// Polls `api`'s object `name` until `done` holds; on timeout the panic shows what was
    /// last seen and [`Logged::logs_of_all`].
    async fn wait<K: Object>(
        &self,
        api: Api<K>,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&K) -> bool,
    ) -> K {
        crate::wait::object_or_logs(&api, name, what, timeout, done, || self.logs_of_all()).await
    }
}
