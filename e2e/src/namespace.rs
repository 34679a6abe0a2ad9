//! A namespace of its own for each test, deleted afterwards; when the test panics, the
//! namespace's dbops objects, Secrets (names and keys, never values) and Events are
//! printed first.

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Client;
use kube::api::{Api, PostParams};
use rand::distr::{Alphanumeric, SampleString};
use serde::Deserialize;

use crate::kubectl::Kubectl;
use crate::paths;

/// The controllers that register their backup store in their own namespace.
const STORE_CONTROLLERS: [&str; 2] = ["backup-controller", "database-controller"];

/// A go-template printing each Secret without its values.
const SECRET_SUMMARY: &str = "go-template={{range .items}}Secret {{.metadata.name}}: keys [\
{{range $k, $v := .data}}{{$k}} {{end}}] labels {{.metadata.labels}} owners [\
{{range .metadata.ownerReferences}}{{.kind}}/{{.name}} controller={{.controller}} {{end}}]\n{{end}}";

#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    kubectl: Kubectl,
}

impl TestNamespace {
    /// Creates `<prefix>-<random>`.
    pub async fn create(client: &Client, kubectl: &Kubectl, prefix: &str) -> Result<Self> {
        let suffix = Alphanumeric
            .sample_string(&mut rand::rng(), 6)
            .to_lowercase();
        let name = format!("{prefix}-{suffix}");
        let api: Api<Namespace> = Api::all(client.clone());
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.clone());
        ns.metadata.labels = Some([("dbops.dev/e2e".to_string(), "true".to_string())].into());
        api.create(&PostParams::default(), &ns).await?;
        let created = Self {
            name,
            kubectl: kubectl.clone(),
        };
        grant_backup_store_roles(client, &created.name).await?;
        Ok(created)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a failing test leaves behind, for its report.
    pub fn dump(&self) -> String {
        let mut out = String::new();
        for args in [
            vec!["get", "dbops", "-n", &self.name, "-o", "yaml"],
            // Secrets by name, keys, labels and owners only: their values are passwords.
            vec!["get", "secrets", "-n", &self.name, "-o", SECRET_SUMMARY],
            vec![
                "get",
                "events",
                "-n",
                &self.name,
                "--sort-by=.lastTimestamp",
            ],
        ] {
            if let Ok(o) = self.kubectl.run(&args, None) {
                out.push_str(&o.text());
            }
        }
        out
    }
}

/// The namespace stands in for `dbops-system` as a controller's own namespace
/// (`--controller-namespace`, see `controllers::controller_namespace_arg`): the Roles
/// `dbops-<controller>-backup-store` of `deploy/<controller>/rbac.yaml` (the backup store's
/// registration ConfigMap), copied here as they are and bound to the controllers'
/// ServiceAccounts in `dbops-system`, so a controller run with its own token may do here
/// exactly what it may do there.
async fn grant_backup_store_roles(client: &Client, namespace: &str) -> Result<()> {
    let roles: Api<Role> = Api::namespaced(client.clone(), namespace);
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    for controller in STORE_CONTROLLERS {
        let name = format!("dbops-{controller}-backup-store");
        let path = paths::repo_root()
            .join("deploy")
            .join(controller)
            .join("rbac.yaml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let mut role = None;
        for document in serde_norway::Deserializer::from_str(&text) {
            let value = serde_json::Value::deserialize(document)
                .with_context(|| format!("parsing {}", path.display()))?;
            if value["kind"] == "Role" && value["metadata"]["name"] == name.as_str() {
                role = Some(serde_json::from_value::<Role>(value)?);
            }
        }
        let mut role = role.with_context(|| format!("no Role {name} in {}", path.display()))?;
        role.metadata.namespace = Some(namespace.to_string());
        roles.create(&PostParams::default(), &role).await?;
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{
                "kind": "ServiceAccount",
                "name": format!("dbops-{controller}"),
                "namespace": "dbops-system",
            }],
        }))?;
        bindings.create(&PostParams::default(), &binding).await?;
    }
    Ok(())
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- state of namespace {} at failure ----\n{}",
                self.name,
                self.dump()
            );
        }
        let _ = self
            .kubectl
            .run(&["delete", "namespace", &self.name, "--wait=false"], None);
    }
}
