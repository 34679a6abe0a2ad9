//! The control plane itself: what later tests rely on.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};

use dbops_e2e::Kubectl;
use dbops_e2e::wait::eventually;

use crate::bed;

/// Waits (60 s at most) until `object` of `api` (by its name and UID) is deleted; on
/// timeout panics with `expected`.
async fn await_deleted<K>(api: Api<K>, object: &K, expected: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let meta = object.meta();
    let (name, uid) = (meta.name.as_deref().unwrap(), meta.uid.as_deref().unwrap());
    tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(api, name, conditions::is_deleted(uid)),
    )
    .await
    .expect(expected)
    .unwrap();
}

#[tokio::test]
async fn apiserver_reports_the_version_built_from_go_modules() {
    let b = bed("version").await;
    let out = b.kubectl.run(&["version", "-o", "json"], None).unwrap();
    assert!(out.success, "{}", out.text());
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let expected = dbops_e2e::paths::kubernetes_version().unwrap();
    assert_eq!(v["serverVersion"]["gitVersion"], expected.as_str());

    let readyz = b.kubectl.run(&["get", "--raw", "/readyz"], None).unwrap();
    assert_eq!(readyz.stdout.trim(), "ok", "{}", readyz.text());
}

#[tokio::test]
async fn garbage_collector_deletes_children_of_a_deleted_owner() {
    let b = bed("gc").await;
    let api: Api<ConfigMap> = Api::namespaced(b.client.clone(), b.ns.name());
    let mut owner = ConfigMap::default();
    owner.metadata.name = Some("owner".into());
    let owner = api.create(&PostParams::default(), &owner).await.unwrap();

    let mut child = ConfigMap::default();
    child.metadata.name = Some("child".into());
    child.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: "owner".into(),
            uid: owner.metadata.uid.clone().unwrap(),
            ..Default::default()
        },
    ]);
    let child = api.create(&PostParams::default(), &child).await.unwrap();

    api.delete("owner", &DeleteParams::default()).await.unwrap();
    await_deleted(
        api.clone(),
        &child,
        "kube-controller-manager's garbage collector deletes the child within 60s",
    )
    .await;
}

#[tokio::test]
async fn namespace_controller_finishes_namespace_deletion() {
    let b = bed("nsdel").await;
    let api: Api<Namespace> = Api::all(b.client.clone());
    let mut ns = Namespace::default();
    ns.metadata.name = Some(format!("{}-gone", b.ns.name()));
    let ns = api.create(&PostParams::default(), &ns).await.unwrap();
    let name = ns.metadata.name.clone().unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(b.client.clone(), &name);
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("content".into());
    cms.create(&PostParams::default(), &cm).await.unwrap();

    api.delete(&name, &DeleteParams::default()).await.unwrap();
    await_deleted(
        api,
        &ns,
        "the namespace controller empties and removes the namespace within 60s",
    )
    .await;
}

#[tokio::test]
async fn every_dbops_kind_is_served_with_short_names_and_the_category() {
    let b = bed("discovery").await;
    let out = b
        .kubectl
        .run(
            &["api-resources", "--api-group=dbops.dev", "-o", "wide"],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.text());
    for (kind, short) in [
        ("DatabaseServer", "dbserver"),
        ("Database", "pgdb"),
        ("Backup", "pgbackup"),
        ("Migration", "pgmig"),
    ] {
        let line = out
            .stdout
            .lines()
            .find(|l| l.split_whitespace().any(|w| w == kind))
            .unwrap_or_else(|| panic!("{kind} not served:\n{}", out.stdout));
        assert!(
            line.contains(short),
            "{kind} lacks short name {short}: {line}"
        );
        assert!(
            line.contains("dbops"),
            "{kind} lacks category dbops: {line}"
        );
        // The NAMESPACED column: only DatabaseServer is cluster-scoped.
        let namespaced = if kind == "DatabaseServer" {
            "false"
        } else {
            "true"
        };
        assert!(
            line.split_whitespace().any(|w| w == namespaced),
            "{kind} is not namespaced={namespaced}: {line}"
        );
    }
    let get = b
        .kubectl
        .run(&["get", "dbops", "-n", b.ns.name()], None)
        .unwrap();
    assert!(get.success, "kubectl get dbops: {}", get.text());

    let explain = b
        .kubectl
        .run(&["explain", "databaseserver.spec.adminSecretRef"], None)
        .unwrap();
    assert!(
        explain.stdout.contains("username") && explain.stdout.contains("password"),
        "kubectl explain shows the field description: {}",
        explain.text()
    );
    let explain = b
        .kubectl
        .run(&["explain", "database.spec.serverRef"], None)
        .unwrap();
    assert!(
        explain.stdout.contains("DatabaseServer"),
        "kubectl explain shows the field description: {}",
        explain.text()
    );
}

#[tokio::test]
async fn minted_users_are_authenticated_and_their_writes_audited() {
    let b = bed("audit").await;
    let ns = b.ns.name();
    // A user name no other test uses: the audit log is shared by the whole binary.
    let user = format!("e2e-audit-{ns}");
    let kubeconfig =
        b.cp.kubeconfig_for(&user, &["system:masters", "dbops:testers"])
            .unwrap();
    let as_user = Kubectl::new(&kubeconfig);

    assert!(b.cp.audit_writes(&user, None).unwrap().is_empty());
    let whoami = as_user
        .run(&["auth", "whoami", "-o", "json"], None)
        .unwrap();
    assert!(whoami.success, "{}", whoami.text());
    let review: serde_json::Value = serde_json::from_str(&whoami.stdout).unwrap();
    assert_eq!(review["status"]["userInfo"]["username"], user.as_str());
    let groups = review["status"]["userInfo"]["groups"].to_string();
    assert!(
        groups.contains("system:masters") && groups.contains("dbops:testers"),
        "both organizations of the certificate are groups: {groups}"
    );

    // `kubectl auth whoami` creates a SelfSubjectReview: a write, cluster-scoped.
    let reviews = eventually(
        "the audited SelfSubjectReview",
        Duration::from_secs(10),
        || async { b.cp.audit_writes(&user, None) },
        |w| !w.is_empty(),
    )
    .await;
    assert_eq!(
        (reviews[0].verb.as_str(), reviews[0].resource.as_str()),
        ("create", "selfsubjectreviews"),
        "{reviews:#?}"
    );
    assert!(b.cp.audit_writes(&user, Some(ns)).unwrap().is_empty());
    for args in [
        vec![
            "create",
            "configmap",
            "audited",
            "-n",
            ns,
            "--from-literal=a=1",
        ],
        vec!["get", "configmap", "audited", "-n", ns],
        vec![
            "patch",
            "configmap",
            "audited",
            "-n",
            ns,
            "-p",
            r#"{"data":{"a":"2"}}"#,
        ],
        vec!["delete", "configmap", "audited", "-n", ns],
    ] {
        let out = as_user.run(&args, None).unwrap();
        assert!(out.success, "kubectl {args:?}: {}", out.text());
    }
    // The admin's own writes in the namespace are not this user's.
    let out = b
        .kubectl
        .run(&["create", "configmap", "by-admin", "-n", ns], None)
        .unwrap();
    assert!(out.success, "{}", out.text());

    let writes = eventually(
        "three audited writes by the minted user",
        Duration::from_secs(10),
        || async { b.cp.audit_writes(&user, Some(ns)) },
        |w| w.len() >= 3,
    )
    .await;
    let summary: Vec<(String, String, String, i32)> = writes
        .iter()
        .map(|w| {
            (
                w.verb.clone(),
                w.resource.clone(),
                w.namespace.clone(),
                w.code,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "create".to_string(),
                "configmaps".to_string(),
                ns.to_string(),
                201
            ),
            (
                "patch".to_string(),
                "configmaps".to_string(),
                ns.to_string(),
                200
            ),
            (
                "delete".to_string(),
                "configmaps".to_string(),
                ns.to_string(),
                200
            ),
        ],
        "reads are not audited, writes are, in order: {writes:#?}"
    );
    assert_eq!(writes[1].name, "audited");
    assert!(writes.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    assert!(
        b.cp.audit_writes(&user, Some("another-namespace"))
            .unwrap()
            .is_empty()
    );
}
