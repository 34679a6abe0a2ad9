//! The restricted Pod Security level on `dbops-system`, and what each controller's
//! container is: uid 65532, a read-only root filesystem, a writable /tmp.

use dbops_e2e::kubectl::Output;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::bed::{CONTROLLERS, SYSTEM, bed, pod_ready};

#[tokio::test]
async fn restricted_pod_security_is_enforced_on_the_controllers_namespace() {
    let bed = bed().await;
    let ns = Api::<Namespace>::all(bed.client.clone())
        .get(SYSTEM)
        .await
        .unwrap();
    assert_eq!(
        ns.labels()
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("restricted"),
        "{SYSTEM} must enforce the restricted level"
    );
    // A Pod that runs as root with privilege escalation allowed: admission refuses it.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "breaks-restricted"},
        "spec": {"containers": [{
            "name": "c", "image": "localhost/dbops-test/pause:3.10",
            "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": true}
        }]}
    }))
    .unwrap();
    let refused = bed
        .api::<Pod>(SYSTEM)
        .create(&PostParams::default(), &pod)
        .await
        .expect_err("a Pod that breaks the restricted level must be refused");
    let text = refused.to_string();
    assert!(
        text.contains("violates PodSecurity \"restricted"),
        "refused, but not by PodSecurity admission: {text}"
    );
}

#[tokio::test]
async fn every_controller_runs_as_65532_on_a_read_only_root() {
    let bed = bed().await;
    for controller in CONTROLLERS {
        let pods = bed.pods_of(controller).await.unwrap();
        assert_eq!(pods.len(), 2, "{controller}: two replicas");
        for pod in pods.iter().filter(|p| pod_ready(p)) {
            let name = pod.name_any();
            let exec = |script: &str| -> Output {
                bed.kubectl
                    .run(
                        &["exec", "-n", SYSTEM, &name, "--", "sh", "-c", script],
                        None,
                    )
                    .unwrap()
            };
            let id = exec("id -u; id -g");
            assert!(id.success, "{name}: {}", id.text());
            assert_eq!(
                id.stdout.split_whitespace().collect::<Vec<_>>(),
                ["65532", "65532"],
                "{name}"
            );
            let root = exec("touch /probe");
            assert!(!root.success, "{name}: / is writable");
            assert!(
                root.text().contains("Read-only file system"),
                "{name}: {}",
                root.text()
            );
            let tmp = exec("touch /tmp/probe && rm /tmp/probe");
            assert!(tmp.success, "{name}: /tmp is not writable: {}", tmp.text());
            // Whatever HOME says, pg_dump and the controller must not need it writable.
            let home = exec("echo \"$HOME\"");
            assert!(home.success, "{name}: {}", home.text());
        }
    }
}
