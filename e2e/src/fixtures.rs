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

/// Creates Database `ns/name` on `pg` with admin Secret `admin` (sslMode disable) and the
/// further spec fields in `extra_spec` (a JSON object: deletionPolicy, extensions,
/// restoreFrom, …). Not waited for.
pub async fn create_database(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pg: &PgServer,
    admin: &str,
    extra_spec: serde_json::Value,
) -> Result<dbops_api::Database> {
    let mut spec = serde_json::json!({
        "server": {
            "host": pg.host(),
            "port": pg.port(),
            "adminSecretRef": {"name": admin},
            "sslMode": "disable",
        },
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra_spec.as_object()) {
        spec.extend(extra.clone());
    }
    let db: dbops_api::Database = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Database",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .context("building a Database")?;
    Api::<dbops_api::Database>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &db)
        .await
        .with_context(|| format!("creating Database {ns}/{name}"))
}

/// The name of the final snapshot Backup made for the Database with `db_uid`
/// (`deletionPolicy: Snapshot`), found by its label once the database-controller made it.
pub async fn wait_final_snapshot(
    client: &kube::Client,
    ns: &str,
    db_uid: &str,
    timeout: std::time::Duration,
) -> Result<String> {
    let api = Api::<dbops_api::Backup>::namespaced(client.clone(), ns);
    let selector = format!("{}={db_uid}", dbops_api::marks::FINAL_SNAPSHOT_OF);
    let found = crate::wait::wait_for(
        &format!("the final snapshot Backup of the Database with UID {db_uid}"),
        timeout,
        || async {
            let list = api
                .list(&kube::api::ListParams::default().labels(&selector))
                .await?;
            Ok(list
                .items
                .into_iter()
                .filter_map(|b| b.metadata.name)
                .collect::<Vec<_>>())
        },
        |names| !names.is_empty(),
    )
    .await?;
    found.into_iter().next().context("no final snapshot Backup")
}

/// The core/v1 Events of namespace `ns` about the object `kind`/`name`.
pub async fn events_about(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    name: &str,
) -> Result<Vec<k8s_openapi::api::core::v1::Event>> {
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), ns)
        .list(&kube::api::ListParams::default())
        .await
        .with_context(|| format!("listing the Events of {ns}"))?;
    Ok(events
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some(kind)
                && e.involved_object.name.as_deref() == Some(name)
        })
        .collect())
}
