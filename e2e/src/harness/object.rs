//! What a harness waits on: an object the API serves (a Database, a Backup, a Migration,
//! ...), as `crate::wait::object_or_logs` takes it.

use std::fmt::Debug;

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
