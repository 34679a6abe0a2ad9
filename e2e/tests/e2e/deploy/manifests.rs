//! The manifests of `deploy/` against the real apiserver: they apply (for real and with
//! `--dry-run=server`), each controller is deployed hardened with two leader-elected
//! replicas and a NetworkPolicy for what it talks to, and the alert rules pass their
//! promtool unit tests.

use dbops_e2e::harness::deploy::{
    CONTROLLERS, SYSTEM_NAMESPACE, TENANT_BINDING_NAME, deploy_dir, deployed,
};
use dbops_e2e::paths;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use kube::api::Api;

use crate::bed;

/// Objects `kubectl apply -k deploy/` sends: the Namespace, 5 CRDs, the backup store's
/// PersistentVolumeClaim, per controller a ServiceAccount, ClusterRole,
/// ClusterRoleBinding, two Roles and RoleBindings (its Lease; the DatabaseServers' admin
/// and CA Secrets), Deployment, PodDisruptionBudget, Service and NetworkPolicy, for the
/// backup- and database-controller a Role and RoleBinding (the backup store's registration
/// ConfigMap), and the database-controller's ClusterRole of the Secret verbs it binds in
/// tenant namespaces and its Role and RoleBinding of the poolers' objects, and the
/// migration-controller's Role and RoleBinding of the poolers' Pods.
const DEPLOY_OBJECTS: usize = 1 + 5 + 1 + 3 * 11 + 2 * 2 + 1 + 2 + 2;

async fn rules_of(
    cluster_roles: &Api<ClusterRole>,
    name: &str,
) -> Vec<k8s_openapi::api::rbac::v1::PolicyRule> {
    cluster_roles
        .get(name)
        .await
        .unwrap()
        .rules
        .unwrap_or_default()
}

#[tokio::test]
async fn the_deployment_applies_to_the_real_apiserver_with_server_side_dry_run() {
    let b = bed("deploy").await;
    deployed(b.cp).await;

    // The whole kustomization, as a user runs it; the namespace exists, so the apiserver
    // admits (and Pod Security checks) every object without storing any.
    let out = b.kubectl.apply_kustomization(&deploy_dir(), true).unwrap();
    assert!(
        out.success,
        "kubectl apply --dry-run=server -k deploy/: {}",
        out.text()
    );
    let applied = out
        .stdout
        .lines()
        .filter(|l| l.contains("(server dry run)"))
        .count();
    assert_eq!(applied, DEPLOY_OBJECTS, "{}", out.text());
    // `warn: restricted` on dbops-system makes the apiserver warn about any Deployment
    // whose pods the restricted Pod Security Standard would refuse.
    // (The only other warning is kubectl's about the CRDs, which the harness installed
    // by server-side apply, lacking its last-applied annotation.)
    let warnings: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("Warning") && !l.contains("last-applied-configuration"))
        .collect();
    assert!(
        warnings.is_empty(),
        "the apiserver warned about the deployment: {warnings:#?}"
    );

    // The check above can fail: a pod template without the hardening is warned about.
    let careless = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: careless, namespace: dbops-system}
spec:
  selector: {matchLabels: {app: careless}}
  template:
    metadata: {labels: {app: careless}}
    spec:
      containers: [{name: c, image: ghcr.io/dbops/dbops-database-controller:0.1.0}]
"#;
    let out = b
        .kubectl
        .run(&["apply", "--dry-run=server", "-f", "-"], Some(careless))
        .unwrap();
    assert!(out.success, "{}", out.text());
    assert!(
        out.stderr.contains("violate PodSecurity \"restricted"),
        "no Pod Security warning for an unhardened pod: {}",
        out.text()
    );
}

#[tokio::test]
async fn each_controller_is_deployed_hardened_with_two_leader_elected_replicas() {
    let b = bed("deploy-shape").await;
    deployed(b.cp).await;
    let client = b.client.clone();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let services: Api<Service> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    let roles: Api<Role> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);

    for controller in CONTROLLERS {
        let name = format!("dbops-{controller}");
        let d = deployments.get(&name).await.unwrap();
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(2), "{name}");
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some(name.as_str()));
        let pod_security = pod.security_context.unwrap();
        assert_eq!(pod_security.run_as_non_root, Some(true), "{name}");
        assert_eq!(
            pod_security.seccomp_profile.map(|s| s.type_).as_deref(),
            Some("RuntimeDefault")
        );
        let [c] = pod.containers.as_slice() else {
            panic!("{name}: one container expected");
        };
        let args = c.args.clone().unwrap_or_default();
        assert!(
            args.iter().any(|a| a == "--leader-elect"),
            "{name}: {args:?}"
        );
        assert!(
            args.iter().any(|a| a == "--metrics-addr=0.0.0.0:8080"),
            "{name}: probes need the health port on the pod's address: {args:?}"
        );
        let env: Vec<String> = c.env.iter().flatten().map(|e| e.name.clone()).collect();
        assert!(
            env.contains(&"POD_NAMESPACE".to_string()),
            "{name}: {env:?}"
        );
        assert!(env.contains(&"POD_NAME".to_string()), "{name}: {env:?}");
        let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
            p.as_ref()
                .and_then(|p| p.http_get.as_ref())
                .and_then(|h| h.path.clone())
        };
        assert_eq!(probe_path(&c.liveness_probe).as_deref(), Some("/healthz"));
        assert_eq!(probe_path(&c.readiness_probe).as_deref(), Some("/readyz"));
        let resources = c.resources.clone().unwrap();
        for key in ["cpu", "memory"] {
            assert!(
                resources.requests.as_ref().unwrap().contains_key(key),
                "{name}"
            );
        }
        assert!(
            resources.limits.as_ref().unwrap().contains_key("memory"),
            "{name}"
        );
        let sc = c.security_context.clone().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{name}");
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{name}");
        assert_eq!(
            sc.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_string()]),
            "{name}"
        );
        let mounts: Vec<String> = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.clone())
            .collect();
        assert!(mounts.contains(&"/tmp".to_string()), "{name}: {mounts:?}");
        if controller != "migration-controller" {
            assert!(
                mounts.contains(&"/var/lib/dbops/backups".to_string()),
                "{name}: {mounts:?}"
            );
        }

        let pdb = pdbs.get(&name).await.unwrap().spec.unwrap();
        assert!(
            pdb.max_unavailable.is_some() || pdb.min_available.is_some(),
            "{name}"
        );
        let svc = services
            .get(&format!("{name}-metrics"))
            .await
            .unwrap()
            .spec
            .unwrap();
        assert!(
            svc.ports
                .iter()
                .flatten()
                .any(|p| p.name.as_deref() == Some("http-metrics")),
            "{name}"
        );

        // Least privilege in shape: no wildcards, no Secret deletion, and the Lease role
        // names its own Lease only.
        let rules = cluster_roles
            .get(&name)
            .await
            .unwrap()
            .rules
            .unwrap_or_default();
        for rule in &rules {
            let everything = |v: &Option<Vec<String>>| v.iter().flatten().any(|x| x == "*");
            assert!(
                !rule.verbs.iter().any(|v| v == "*")
                    && !everything(&rule.resources)
                    && !everything(&rule.api_groups),
                "{name}: wildcard rule {rule:?}"
            );
            let secrets = rule.resources.iter().flatten().any(|r| r == "secrets");
            assert!(
                !(secrets && rule.verbs.iter().any(|v| v == "delete" || v == "update")),
                "{name} may delete or replace Secrets: {rule:?}"
            );
        }
        if controller == "database-controller" {
            // What it binds in tenant namespaces: the Secret verbs it needs, nothing else.
            let tenant = cluster_roles.get(TENANT_BINDING_NAME).await.unwrap();
            let rules = tenant.rules.unwrap_or_default();
            let [rule] = rules.as_slice() else {
                panic!("{TENANT_BINDING_NAME}: one rule expected: {rules:?}");
            };
            assert_eq!(rule.resources, Some(vec!["secrets".to_string()]));
            assert_eq!(rule.api_groups, Some(vec![String::new()]));
            assert_eq!(
                rule.verbs,
                ["get", "list", "watch", "create", "patch"].map(String::from),
            );
            // No Secret rule of its own beyond dbops-system's Role.
            assert!(
                !rules_of(&cluster_roles, &name).await.iter().any(|r| r
                    .resources
                    .iter()
                    .flatten()
                    .any(|r| r == "secrets")),
                "{name} grants Secrets cluster-wide"
            );
        }
        let lease_rules = roles
            .get(&format!("{name}-leader-election"))
            .await
            .unwrap()
            .rules
            .unwrap_or_default();
        for rule in lease_rules
            .iter()
            .filter(|r| r.verbs.iter().any(|v| v == "patch"))
        {
            assert_eq!(rule.resource_names, Some(vec![name.clone()]), "{rule:?}");
        }
    }
}

/// Each controller's NetworkPolicy, as the apiserver stored it, selects that controller's
/// pods and lets through what the controller talks to and nothing more: in, only the
/// health and metrics port; out, the apiserver, DNS, PostgreSQL, Jaeger, and the S3
/// endpoint for the two controllers with a backup store only. (Nothing here enforces it:
/// the control plane has no network plugin; this checks what a plugin would enforce.)
#[tokio::test]
async fn each_controller_has_a_network_policy_for_what_it_talks_to() {
    use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use std::collections::BTreeSet;

    let b = bed("deploy-netpol").await;
    deployed(b.cp).await;
    let deployments: Api<Deployment> = Api::namespaced(b.client.clone(), SYSTEM_NAMESPACE);
    let policies: Api<NetworkPolicy> = Api::namespaced(b.client.clone(), SYSTEM_NAMESPACE);

    // A peer as a short word: `any` (no `to`), `kube-dns`, `jaeger`, or what it is.
    let peer = |p: &NetworkPolicyPeer| -> String {
        let labels = |s: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>| {
            s.as_ref()
                .and_then(|s| s.match_labels.clone())
                .unwrap_or_default()
        };
        let pods = labels(&p.pod_selector);
        let namespaces = labels(&p.namespace_selector);
        let in_kube_system =
            namespaces.get("kubernetes.io/metadata.name") == Some(&"kube-system".to_string());
        if in_kube_system && pods.get("k8s-app").map(String::as_str) == Some("kube-dns") {
            "kube-dns".into()
        } else if p.namespace_selector.is_none()
            && p.ip_block.is_none()
            && pods.get("app.kubernetes.io/name").map(String::as_str) == Some("jaeger")
        {
            "jaeger".into()
        } else if p.namespace_selector.is_none()
            && p.ip_block.is_none()
            && pods.get("app.kubernetes.io/component").map(String::as_str) == Some("pooler")
        {
            "pooler".into()
        } else {
            format!("{p:?}")
        }
    };
    let port = |p: &IntOrString| match p {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) => s.clone(),
    };

    for controller in CONTROLLERS {
        let name = format!("dbops-{controller}");
        let pod_labels = deployments
            .get(&name)
            .await
            .unwrap()
            .spec
            .unwrap()
            .template
            .metadata
            .unwrap()
            .labels
            .unwrap_or_default();
        let policy = policies.get(&name).await.unwrap().spec.unwrap();
        let selector = policy
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .unwrap_or_default();
        assert!(
            !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
            "{name}: the policy's selector {selector:?} does not pick the pods {pod_labels:?}"
        );
        assert_eq!(
            policy.policy_types,
            Some(vec!["Ingress".to_string(), "Egress".to_string()]),
            "{name}"
        );

        // In: the container port `http` (8080), from anywhere, and nothing else.
        let ingress = policy.ingress.clone().unwrap_or_default();
        let [rule] = ingress.as_slice() else {
            panic!("{name}: one ingress rule expected: {ingress:?}");
        };
        assert!(
            rule.from.as_ref().is_none_or(Vec::is_empty),
            "{name}: {rule:?}"
        );
        let ports: Vec<(String, String)> = rule
            .ports
            .iter()
            .flatten()
            .map(|p| {
                (
                    p.port.as_ref().map(port).unwrap_or_default(),
                    p.protocol.clone().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(ports, [("http".to_string(), "TCP".to_string())], "{name}");

        // Out: (peer, port/protocol) pairs.
        let mut egress = BTreeSet::new();
        for rule in policy.egress.iter().flatten() {
            let peers: Vec<String> = match rule.to.as_deref() {
                None | Some([]) => vec!["any".to_string()],
                Some(to) => to.iter().map(peer).collect(),
            };
            for p in peers {
                for ports in rule.ports.iter().flatten() {
                    let number = ports
                        .port
                        .as_ref()
                        .map(port)
                        .unwrap_or_else(|| "all".into());
                    let protocol = ports.protocol.clone().unwrap_or_default();
                    egress.insert(format!("{p} {number}/{protocol}"));
                }
            }
        }
        let mut wanted: BTreeSet<String> = [
            "any 443/TCP",
            "any 6443/TCP",
            "kube-dns 53/UDP",
            "kube-dns 53/TCP",
            "any 53/UDP",
            "any 53/TCP",
            "any 5432/TCP",
            "jaeger 4317/TCP",
        ]
        .map(String::from)
        .into();
        if controller != "migration-controller" {
            // The S3 endpoint of the s3:// backup store (443 is there already).
            wanted.insert("any 9000/TCP".into());
        } else {
            // The poolers' admin consoles (a cutover through the source's pooler).
            wanted.insert("pooler 6432/TCP".into());
        }
        assert_eq!(egress, wanted, "{name}: egress");
    }
}

/// The shipped alert rules (deploy/components/prometheus-rules) pass their unit tests:
/// the PrometheusRule's spec, written out as a Prometheus rule file, under
/// `promtool test rules` (promtool built from Go modules by e2e/install). Each case fires
/// when it should and not before; a wrong expectation fails the run.
#[test]
fn alert_rules_pass_their_promtool_unit_tests() {
    let component = paths::repo_root().join("deploy/components/prometheus-rules");
    let rule: serde_json::Value = serde_norway::from_str(
        &std::fs::read_to_string(component.join("prometheusrule.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(rule["kind"], "PrometheusRule");
    let groups = rule["spec"]["groups"].as_array().expect("spec.groups");
    let alerts: Vec<&str> = groups
        .iter()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    for wanted in [
        "DbopsReconcileErrorsHigh",
        "DbopsReconcileStuck",
        "DbopsDatabasesNotReady",
        "DbopsScheduledBackupLate",
        "DbopsMigrationRolledBack",
        "DbopsDatabaseServerNotReady",
    ] {
        assert!(alerts.contains(&wanted), "no alert {wanted} in {alerts:?}");
    }
    // A kustomize component that lists it.
    let kustomization = std::fs::read_to_string(component.join("kustomization.yaml")).unwrap();
    assert!(
        kustomization.contains("kind: Component") && kustomization.contains("prometheusrule.yaml")
    );

    let dir = tempfile::Builder::new()
        .prefix("dbops-promtool-")
        .tempdir()
        .unwrap();
    std::fs::write(
        dir.path().join("rules.generated.yaml"),
        serde_norway::to_string(&rule["spec"]).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        component.join("tests/alerts.test.yaml"),
        dir.path().join("alerts.test.yaml"),
    )
    .unwrap();
    let promtool = paths::promtool().unwrap();
    let out = std::process::Command::new(&promtool)
        .args(["test", "rules", "alerts.test.yaml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Every alert has at least one test case.
    let tests = std::fs::read_to_string(component.join("tests/alerts.test.yaml")).unwrap();
    for alert in alerts {
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "no promtool test for {alert}"
        );
    }
}
