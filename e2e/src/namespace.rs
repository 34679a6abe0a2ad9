//! A namespace of its own for each test, deleted afterwards with the test's
//! DatabaseServers (cluster-scoped, labelled with the namespace); when the test panics,
//! the namespace's dbops objects, its DatabaseServers, Secrets (names and keys, never
//! values) and Events are printed first.

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Client;
use kube::api::{Api, PostParams};
use rand::distr::{Alphanumeric, SampleString};
use serde::Deserialize;

use crate::fixtures::TEST_NAMESPACE_LABEL;
use crate::kubectl::Kubectl;
use crate::paths;

/// The Roles `dbops-<controller>-<role>` of `deploy/<controller>/rbac.yaml` in the
/// controllers' own namespace, granted in each test namespace: (controller, role, whether
/// the Role must be there).
const CONTROLLER_NAMESPACE_ROLES: [(&str, &str, bool); 7] = [
    // The backup store's registration ConfigMap.
    ("backup-controller", "backup-store", true),
    ("database-controller", "backup-store", true),
    // The DatabaseServers' admin and CA Secrets (get, list, watch).
    ("database-controller", "secrets", false),
    ("backup-controller", "secrets", false),
    ("migration-controller", "secrets", false),
    // The poolers' Secrets, Deployments, Services and PodDisruptionBudgets.
    ("database-controller", "poolers", true),
    // The poolers' EndpointSlices and Pods (a Migration's cutover through a pooler).
    ("migration-controller", "poolers", true),
];

/// The namespaced dbops kinds (`kubectl get dbops -n` would list every test's
/// DatabaseServers too: they are cluster-scoped).
const NAMESPACED_KINDS: &str = "databases.dbops.dev,backups.dbops.dev,migrations.dbops.dev";
const SERVERS: &str = "databaseservers.dbops.dev";

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
    /// Creates `<prefix>-<random>`, where the controllers' ServiceAccounts may do what
    /// they may do in their own namespace (see [`grant_controller_namespace_roles`]).
    pub async fn create(client: &Client, kubectl: &Kubectl, prefix: &str) -> Result<Self> {
        let created = Self::create_tenant(client, kubectl, prefix).await?;
        grant_controller_namespace_roles(client, &created.name).await?;
        Ok(created)
    }

    /// Creates `<prefix>-<random>` as a tenant namespace of a real installation: the
    /// controllers' ServiceAccounts hold nothing there but what the cluster-wide RBAC of
    /// `deploy/` and the controllers' own RoleBindings give them (no Secret, say, until
    /// the database-controller's RoleBinding grants it).
    pub async fn create_tenant(client: &Client, kubectl: &Kubectl, prefix: &str) -> Result<Self> {
        let suffix = Alphanumeric
            .sample_string(&mut rand::rng(), 6)
            .to_lowercase();
        let name = format!("{prefix}-{suffix}");
        let api: Api<Namespace> = Api::all(client.clone());
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.clone());
        ns.metadata.labels = Some([("dbops.dev/e2e".to_string(), "true".to_string())].into());
        api.create(&PostParams::default(), &ns).await?;
        Ok(Self {
            name,
            kubectl: kubectl.clone(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The label selector of this test's DatabaseServers.
    pub fn server_selector(&self) -> String {
        format!("{TEST_NAMESPACE_LABEL}={}", self.name)
    }

    /// What a failing test leaves behind, for its report.
    pub fn dump(&self) -> String {
        let mut out = String::new();
        let servers = self.server_selector();
        for args in [
            vec!["get", NAMESPACED_KINDS, "-n", &self.name, "-o", "yaml"],
            vec!["get", SERVERS, "-l", &servers, "-o", "yaml"],
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

    /// Deletes this test's DatabaseServers (they are cluster-scoped: deleting the namespace
    /// leaves them) and removes their `dbops.dev/server-in-use` finalizer, which no stopped
    /// controller would remove. Best effort, not waited for.
    fn delete_servers(&self) {
        let selector = self.server_selector();
        // Deleting first: no finalizer can be added to an object being deleted, so a
        // controller still running cannot put one back after the patch.
        let _ = self.kubectl.run(
            &[
                "delete",
                SERVERS,
                "-l",
                &selector,
                "--wait=false",
                "--ignore-not-found",
            ],
            None,
        );
        let Ok(listed) = self
            .kubectl
            .run(&["get", SERVERS, "-l", &selector, "-o", "name"], None)
        else {
            return;
        };
        for server in listed.stdout.lines().filter(|l| !l.trim().is_empty()) {
            let _ = self.kubectl.run(
                &[
                    "patch",
                    server.trim(),
                    "--type=merge",
                    "-p",
                    r#"{"metadata":{"finalizers":null}}"#,
                ],
                None,
            );
        }
    }
}

/// The namespace stands in for `dbops-system` as a controller's own namespace
/// (`--controller-namespace`, see `controllers::CONTROLLER_NAMESPACE`): the Roles of
/// [`CONTROLLER_NAMESPACE_ROLES`] in `deploy/<controller>/rbac.yaml` (the backup store's
/// registration ConfigMap, the DatabaseServers' admin and CA Secrets), copied here as they
/// are and bound to the controllers' ServiceAccounts in `dbops-system`, so a controller run
/// with its own token may do here exactly what it may do there. A Role that need not be
/// there and is not is skipped.
async fn grant_controller_namespace_roles(client: &Client, namespace: &str) -> Result<()> {
    let roles: Api<Role> = Api::namespaced(client.clone(), namespace);
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    for (controller, role_name, required) in CONTROLLER_NAMESPACE_ROLES {
        let name = format!("dbops-{controller}-{role_name}");
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
        let mut role = match role {
            Some(role) => role,
            None if required => bail!("no Role {name} in {}", path.display()),
            None => continue,
        };
        role.metadata.namespace = Some(namespace.to_string());
        roles
            .create(&PostParams::default(), &role)
            .await
            .with_context(|| format!("creating Role {namespace}/{name}"))?;
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{
                "kind": "ServiceAccount",
                "name": format!("dbops-{controller}"),
                "namespace": "dbops-system",
            }],
        }))?;
        bindings
            .create(&PostParams::default(), &binding)
            .await
            .with_context(|| format!("creating RoleBinding {namespace}/{name}"))?;
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
        self.delete_servers();
        let _ = self
            .kubectl
            .run(&["delete", "namespace", &self.name, "--wait=false"], None);
    }
}
