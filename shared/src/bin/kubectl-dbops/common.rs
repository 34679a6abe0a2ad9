//! What every subcommand uses: the API server and namespace, and how it ends.

use kube::api::Api;

/// What a subcommand ends with.
pub enum Outcome {
    Done,
    OnTheWay,
    Failed,
    NotFound,
}

/// The API server and the namespace.
pub struct Kube {
    pub client: kube::Client,
    pub ns: String,
}

impl Kube {
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.ns)
    }
}
