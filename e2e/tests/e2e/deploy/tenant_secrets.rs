//! The database-controller reaches a tenant namespace's Secrets only while a Database there
//! needs them.

use std::time::Duration;

use dbops_api::Database;
use dbops_e2e::controlplane::service_account_user;
use dbops_e2e::fixtures::manifest;
use dbops_e2e::harness::deploy::{
    CONTROLLERS, SYSTEM_NAMESPACE, TENANT_BINDING_NAME, TENANT_TICK, can_i_as,
};
use dbops_e2e::harness::redact::redact;
use dbops_e2e::wait::{Want, holds_for, wait_for};
use dbops_e2e::{Kubectl, PgServer};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use crate::bed;

/// A namespace of the test's own that is no `TestNamespace`: no controller is granted
/// anything in it by the test bed, as in a tenant's namespace of a real cluster. Deleted
/// when dropped.
struct TenantNamespace {
    name: String,
    kubectl: Kubectl,
}

impl TenantNamespace {
    async fn create(b: &crate::Bed, suffix: &str) -> Self {
        let name = format!("{}-{suffix}", b.ns.name());
        let mut ns = k8s_openapi::api::core::v1::Namespace::default();
        ns.metadata.name = Some(name.clone());
        Api::<k8s_openapi::api::core::v1::Namespace>::all(b.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        Self {
            name,
            kubectl: b.kubectl.clone(),
        }
    }
}

impl Drop for TenantNamespace {
    fn drop(&mut self) {
        let _ = self
            .kubectl
            .run(&["delete", "namespace", &self.name, "--wait=false"], None);
    }
}

/// The database-controller's own token reaches a tenant namespace's Secrets only while a
/// Database there needs them: not while no DatabaseServer allows the namespace, then
/// (once a server allows it) through the RoleBinding the controller makes there, kept
/// while a Database provisioned there stays, and gone with the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_controller_reaches_a_tenant_namespaces_secrets_only_while_a_database_needs_them()
 {
    let b = bed("sa-tenant").await;
    // The controllers' namespace (admin Secret) is the bed's; the tenant's and an idle
    // one are plain namespaces.
    let ctl = b.ns.name().to_string();
    let tenant = TenantNamespace::create(&b, "tenant").await;
    let idle = TenantNamespace::create(&b, "idle").await;
    let pg = PgServer::start("sa-tenant").await.unwrap();
    let admin = "pg-admin";
    dbops_e2e::fixtures::create_secret(
        &b.client,
        &ctl,
        admin,
        &[
            ("username", dbops_e2e::postgres::SUPERUSER),
            ("password", pg.superuser_password()),
        ],
    )
    .await
    .unwrap();
    // The server allows the namespaces labelled as this test's tenants.
    let tenant_label = "dbops.dev/tenant-of";
    let server = dbops_e2e::fixtures::server_name(&ctl, admin);
    let mut spec = dbops_e2e::fixtures::server_spec(&pg, admin);
    spec["allowedNamespaces"] = json!({"matchLabels": {tenant_label: ctl}});
    dbops_e2e::fixtures::create_server(&b.client, &ctl, &server, spec)
        .await
        .unwrap();

    let logs = tempfile::tempdir().unwrap();
    let controller =
        crate::start_tenant_database_controller(&b, &tenant.name, &ctl, "5s", &[], logs.path())
            .await;
    let log = || redact(&controller.process.log_tail(8000), [("superuser", &pg)]);

    let users: Vec<String> = CONTROLLERS
        .iter()
        .map(|c| service_account_user(SYSTEM_NAMESPACE, &format!("dbops-{c}")))
        .collect();
    let database_user = users[0].clone();
    let can = |verb: &str, namespace: &str| {
        can_i_as(&b.kubectl, &database_user, verb, "secrets", namespace)
    };
    let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(b.client.clone(), &tenant.name);

    // 1. No server allows either namespace: no controller may read a Secret there.
    for user in &users {
        for namespace in [&tenant.name, &idle.name] {
            assert!(
                !can_i_as(&b.kubectl, user, "get", "secrets", namespace),
                "{user} may read the Secrets of {namespace}, which no server allows"
            );
        }
    }

    // 2. A Database in the tenant namespace, which its server does not allow (yet): refused,
    // and still no access to the namespace's Secrets.
    let databases: Api<Database> = Api::namespaced(b.client.clone(), &tenant.name);
    let db: Database = manifest(
        "app",
        json!({"serverRef": {"name": server}, "deletionPolicy": "Retain"}),
    )
    .unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();
    let refused = Want::not_ready("NamespaceNotAllowed");
    if let Err(e) = dbops_e2e::wait::database_condition(
        &b.client,
        &tenant.name,
        "app",
        refused,
        Duration::from_secs(60),
    )
    .await
    {
        panic!("{e:#}\n---- controller log ----\n{}", log());
    }
    assert!(
        bindings
            .get_opt(TENANT_BINDING_NAME)
            .await
            .unwrap()
            .is_none()
    );
    assert!(!can("get", &tenant.name));

    // 3. The server allows the namespace: the Database gets Ready with its connection
    // Secret, written through the RoleBinding the controller made, which grants exactly
    // the Secret verbs it needs, there only.
    let out = b
        .kubectl
        .run(
            &[
                "label",
                "namespace",
                &tenant.name,
                &format!("{tenant_label}={ctl}"),
            ],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.text());
    if let Err(e) = dbops_e2e::wait::database_condition(
        &b.client,
        &tenant.name,
        "app",
        Want::provisioned(),
        Duration::from_secs(90),
    )
    .await
    {
        panic!("{e:#}\n---- controller log ----\n{}", log());
    }
    let secrets: Api<Secret> = Api::namespaced(b.client.clone(), &tenant.name);
    assert!(secrets.get_opt("app-connection").await.unwrap().is_some());
    let binding = bindings.get(TENANT_BINDING_NAME).await.unwrap();
    assert_eq!(
        (
            binding.role_ref.kind.as_str(),
            binding.role_ref.name.as_str()
        ),
        ("ClusterRole", TENANT_BINDING_NAME)
    );
    let subjects: Vec<String> = binding
        .subjects
        .iter()
        .flatten()
        .map(|s| {
            format!(
                "{}:{}:{}",
                s.kind,
                s.namespace.as_deref().unwrap_or(""),
                s.name
            )
        })
        .collect();
    assert_eq!(
        subjects,
        ["ServiceAccount:dbops-system:dbops-database-controller"]
    );
    assert_eq!(
        binding
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app.kubernetes.io/managed-by"))
            .map(String::as_str),
        Some("dbops")
    );
    for verb in ["get", "list", "watch", "create", "patch"] {
        assert!(can(verb, &tenant.name), "{verb} secrets in {}", tenant.name);
    }
    for verb in ["delete", "update"] {
        assert!(
            !can(verb, &tenant.name),
            "{verb} secrets in {}",
            tenant.name
        );
    }
    assert!(!can("get", &idle.name));
    assert!(!can("get", "kube-system"));
    let created =
        b.cp.audit_writes(&database_user, Some(&tenant.name))
            .unwrap();
    assert!(
        created
            .iter()
            .any(|w| w.resource == "rolebindings" && w.verb == "create" && w.code == 201),
        "{created:#?}"
    );

    // 4. The server stops allowing the namespace: the Database, provisioned there, stays
    // admitted and Ready, and so does the access its connection Secret needs.
    let servers: Api<dbops_api::DatabaseServer> = Api::all(b.client.clone());
    let nobody = json!({"allowedNamespaces": {"matchLabels": {tenant_label: "nobody"}}});
    let changed = dbops_e2e::fixtures::merge_patch_spec(&servers, &server, nobody)
        .await
        .unwrap();
    let generation = changed.metadata.generation;
    dbops_e2e::wait::eventually(
        "the server controller to see the server's new generation",
        Duration::from_secs(30),
        || async {
            Ok(servers
                .get(&server)
                .await?
                .status
                .and_then(|s| s.observed_generation))
        },
        |seen| *seen >= generation,
    )
    .await;
    let kept = holds_for(
        "the RoleBinding and the Database's readiness",
        2 * TENANT_TICK + Duration::from_secs(2),
        || async {
            let binding = bindings.get_opt(TENANT_BINDING_NAME).await?.is_some();
            let ready =
                dbops_e2e::wait::database_has(&databases.get("app").await?, Want::provisioned());
            Ok((binding, ready))
        },
        |(binding, ready)| *binding && *ready,
    )
    .await;
    if let Err(e) = kept {
        panic!("{e:#}\n---- controller log ----\n{}", log());
    }
    assert!(can("get", &tenant.name));

    // 5. The Database goes (Retain: at once): nothing there needs the Secrets any more,
    // the RoleBinding goes and the namespace's Secrets are out of reach again.
    databases
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    let gone = wait_for(
        "the RoleBinding to go with the last Database",
        Duration::from_secs(30),
        || async { Ok(bindings.get_opt(TENANT_BINDING_NAME).await?.is_none()) },
        |gone| *gone,
    )
    .await;
    if let Err(e) = gone {
        panic!("{e:#}\n---- controller log ----\n{}", log());
    }
    for user in &users {
        assert!(
            !can_i_as(&b.kubectl, user, "get", "secrets", &tenant.name),
            "{user} may still read the Secrets of {}",
            tenant.name
        );
    }
    // Its watch stopped before its RoleBinding went: no refusal anywhere in the log.
    let text = log();
    assert!(
        !text.to_lowercase().contains("forbidden"),
        "the controller was refused something:\n{text}"
    );
    drop(controller);
}
