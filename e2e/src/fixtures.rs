//! Objects many tests create the same way.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

use crate::PgServer;

/// Creates the admin Secret `ns/name` for `pg`: username `postgres` with the server's
/// superuser password.
pub async fn create_admin_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pg: &PgServer,
) -> Result<Secret> {
    let mut secret = Secret::default();
    secret.metadata.name = Some(name.to_string());
    secret.string_data = Some(BTreeMap::from([
        ("username".to_string(), "postgres".to_string()),
        ("password".to_string(), pg.superuser_password().to_string()),
    ]));
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .with_context(|| format!("creating admin Secret {ns}/{name}"))
}
