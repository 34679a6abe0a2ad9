//! The controllers' Pods going away in the middle of work: the leader of each deleted
//! (the standby takes over), a rolling update of all three Deployments to a new image tag,
//! and the PodDisruptionBudgets refusing to evict both replicas at once.

use std::time::Duration;

use dbops_e2e::wait::wait_for;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};

use crate::bed::{Bed, CONTROLLERS, SYSTEM, bed, pod_ready};
use crate::work;

const SETTLE: Duration = Duration::from_secs(180);

/// The store's directory on the node (the hostPath behind the claim dbops-backups).
async fn store_dir() -> std::path::PathBuf {
    crate::runtime::backup_store_dir(bed().await).await
}

/// Every controller's Deployment rolled out, within [`SETTLE`].
async fn all_rolled_out(bed: &Bed) {
    for c in CONTROLLERS {
        bed.rolled_out(c, SETTLE).await.unwrap();
    }
}

#[tokio::test]
async fn the_standby_takes_over_when_each_leader_pod_is_deleted_mid_work() {
    let bed = bed().await;
    all_rolled_out(bed).await;
    // The leaders first (before the work exists, so that deleting them is immediate).
    let mut leaders = Vec::new();
    for controller in CONTROLLERS {
        leaders.push((
            controller,
            bed.ready_leader(controller, SETTLE).await.unwrap(),
        ));
    }
    let work = work::start(bed, "failover").await;
    // All three at once, while the Migration, the Backup and the Databases are under way.
    let pods: Api<Pod> = bed.api(SYSTEM);
    for (_, leader) in &leaders {
        pods.delete(leader, &DeleteParams::default()).await.unwrap();
    }
    let under_way = work.under_way(bed).await;
    eprintln!("leaders deleted while under way: {under_way}");
    assert!(
        under_way.contains("Migration"),
        "the Migration had ended before its leader went: {under_way}"
    );
    for (controller, leader) in &leaders {
        let next = wait_for(
            &format!("another leader of {controller} than {leader}"),
            SETTLE,
            || async { bed.leader(controller).await },
            |l: &Option<String>| l.as_ref().is_some_and(|l| l != leader),
        )
        .await
        .unwrap()
        .unwrap();
        eprintln!("{controller}: leader {leader} deleted, {next} took over");
    }
    work.settles(bed, Some(&store_dir().await)).await;
    all_rolled_out(bed).await;
}

#[tokio::test]
async fn a_rolling_update_of_all_three_in_the_middle_of_work() {
    let bed = bed().await;
    all_rolled_out(bed).await;
    // The new tag: the same image under another name, so that the template changes and
    // every Pod is replaced (IfNotPresent: it is on the node, nothing is pulled).
    let mut images = Vec::new();
    for controller in CONTROLLERS {
        let pod = bed.pods_of(controller).await.unwrap().remove(0);
        let image = pod.spec.unwrap().containers[0].image.clone().unwrap();
        let (repo, tag) = image.rsplit_once(':').unwrap();
        let next = if let Some(base) = tag.strip_suffix("-rollout") {
            format!("{repo}:{base}")
        } else {
            format!("{repo}:{tag}-rollout")
        };
        let _ = bed.ctr(&["images", "tag", &image, &next]);
        images.push((controller, next));
    }
    let work = work::start(bed, "rollout").await;
    for (controller, image) in &images {
        bed.kubectl(&[
            "set",
            "image",
            "-n",
            SYSTEM,
            &format!("deployment/dbops-{controller}"),
            &format!("controller={image}"),
        ])
        .unwrap();
    }
    eprintln!(
        "rolling update started while under way: {}",
        work.under_way(bed).await
    );
    for (controller, image) in &images {
        let d = bed.rolled_out(controller, SETTLE).await.unwrap();
        let template = d.spec.unwrap().template.spec.unwrap().containers[0]
            .image
            .clone();
        assert_eq!(template.as_deref(), Some(image.as_str()));
        for pod in bed.pods_of(controller).await.unwrap() {
            assert_eq!(
                pod.spec.unwrap().containers[0].image.as_deref(),
                Some(image.as_str())
            );
        }
    }
    work.settles(bed, Some(&store_dir().await)).await;
}

/// Evicts `pod` as `kubectl drain` does (a policy/v1 Eviction): Ok, or the refusal.
/// (kube's `Api::evict` sends no apiVersion and kind, and the apiserver then evicted both
/// replicas past the budget: not what a drain does, so not used here.)
fn evict(bed: &Bed, pod: &str) -> Result<(), String> {
    let body = serde_json::json!({
        "apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": {"name": pod, "namespace": SYSTEM}
    })
    .to_string();
    let path = format!("/api/v1/namespaces/{SYSTEM}/pods/{pod}/eviction");
    let out = bed
        .kubectl
        .run(&["create", "--raw", &path, "-f", "-"], Some(&body))
        .map_err(|e| e.to_string())?;
    if out.success { Ok(()) } else { Err(out.text()) }
}

#[tokio::test]
async fn the_disruption_budget_refuses_to_evict_both_replicas() {
    let bed = bed().await;
    let controller = "backup-controller";
    bed.rolled_out(controller, SETTLE).await.unwrap();
    let pods: Api<Pod> = bed.api(SYSTEM);
    let names: Vec<String> = bed
        .pods_of(controller)
        .await
        .unwrap()
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(names.len(), 2);
    evict(bed, &names[0]).unwrap();
    // While the replacement is not Ready, the second eviction is refused (429).
    let refused =
        evict(bed, &names[1]).expect_err("evicting the second replica while the first is gone");
    assert!(
        refused.contains("disruption budget"),
        "refused, but not by the budget: {refused}"
    );
    assert!(pod_ready(&pods.get(&names[1]).await.unwrap()));
    // Once the replacement is Ready, the budget allows it.
    bed.rolled_out(controller, SETTLE).await.unwrap();
    wait_for(
        &format!("evicting {} once a replacement is Ready", names[1]),
        SETTLE,
        || async { Ok(evict(bed, &names[1]).is_ok()) },
        |ok: &bool| *ok,
    )
    .await
    .unwrap();
    bed.rolled_out(controller, SETTLE).await.unwrap();
}
