//! The control plane itself: what later tests rely on.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};

use crate::bed;

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
    tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(
            api.clone(),
            "child",
            conditions::is_deleted(&child.metadata.uid.unwrap()),
        ),
    )
    .await
    .expect("kube-controller-manager's garbage collector deletes the child within 60s")
    .unwrap();
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
    tokio::time::timeout(
        Duration::from_secs(60),
        await_condition(
            api,
            &name,
            conditions::is_deleted(&ns.metadata.uid.unwrap()),
        ),
    )
    .await
    .expect("the namespace controller empties and removes the namespace within 60s")
    .unwrap();
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
    }
    let get = b
        .kubectl
        .run(&["get", "dbops", "-n", b.ns.name()], None)
        .unwrap();
    assert!(get.success, "kubectl get dbops: {}", get.text());

    let explain = b
        .kubectl
        .run(&["explain", "database.spec.server.adminSecretRef"], None)
        .unwrap();
    assert!(
        explain.stdout.contains("username") && explain.stdout.contains("password"),
        "kubectl explain shows the field description: {}",
        explain.text()
    );
}
