//! The deployment in `deploy/` against the real apiserver: it applies (for real and with
//! `--dry-run=server`), its pods would pass the `restricted` Pod Security Standard, each
//! controller does its whole job with a token of its own ServiceAccount (TokenRequest
//! API), and the apiserver refuses a controller a verb it does not need.
//!
//! The ServiceAccounts, RBAC, Deployments, PodDisruptionBudgets and Services are applied
//! once per control plane into `dbops-system` ([`deployed`]); nothing runs the
//! Deployments (there is no scheduler or kubelet), the controllers run here as processes
//! with the ServiceAccounts' tokens, the way they would in those pods.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use dbops_api::{Backup, BackupPhase, Database};
use dbops_e2e::controlplane::{client_from_kubeconfig, service_account_user};
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::wait::{Want, eventually, holds_for, wait_for};
use dbops_e2e::{ControllerProcess, Kubectl, PgServer, paths};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use dbops_e2e::harness::deploy::{
    CONTROLLERS, SYSTEM_NAMESPACE, deploy_dir, deployed, start_controller, wait_leading,
};

use crate::bed;

/// The ClusterRole of the Secret verbs the database-controller needs in a tenant
/// namespace, and the RoleBinding of it it makes there.
const TENANT_ROLE: &str =
    "clusterroles.rbac.authorization.k8s.io/dbops-database-controller-tenant-secrets";
const TENANT_BINDING: &str =
    "rolebindings.rbac.authorization.k8s.io/dbops-database-controller-tenant-secrets";
const TENANT_BINDING_NAME: &str = "dbops-database-controller-tenant-secrets";
/// How often the database-controller compares the namespaces it reaches with those needed.
const TENANT_TICK: Duration = Duration::from_secs(5);
/// Objects `kubectl apply -k deploy/` sends: the Namespace, 5 CRDs, the backup store's
/// PersistentVolumeClaim, per controller a ServiceAccount, ClusterRole,
/// ClusterRoleBinding, two Roles and RoleBindings (its Lease; the DatabaseServers' admin
/// and CA Secrets), Deployment, PodDisruptionBudget, Service and NetworkPolicy, for the
/// backup- and database-controller a Role and RoleBinding (the backup store's registration
/// ConfigMap), and the database-controller's ClusterRole of the Secret verbs it binds in
/// tenant namespaces.
const DEPLOY_OBJECTS: usize = 1 + 5 + 1 + 3 * 11 + 2 * 2 + 1;

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

/// `kubectl auth can-i <verb> <resource> -n <namespace> --as=<user>` (as the admin).
fn can_i_as(kubectl: &Kubectl, user: &str, verb: &str, resource: &str, namespace: &str) -> bool {
    let out = kubectl
        .run(
            &[
                "auth", "can-i", verb, resource, "-n", namespace, "--as", user,
            ],
            None,
        )
        .unwrap();
    match out.stdout.split_whitespace().next() {
        Some("yes") => true,
        Some("no") => false,
        _ => panic!(
            "can-i {verb} {resource} -n {namespace} --as {user}: {}",
            out.text()
        ),
    }
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
        }
        assert_eq!(egress, wanted, "{name}: egress");
    }
}

/// One test's world for the ServiceAccount runs: namespace, PostgreSQL, admin Secret (in
/// `dbops-system`, the controllers' namespace, deleted with the world), DatabaseServer,
/// the three controllers with their own tokens.
struct AsServiceAccounts {
    controllers: Vec<(&'static str, ControllerProcess)>,
    pg: PgServer,
    b: crate::Bed,
    logs: tempfile::TempDir,
    _store: tempfile::TempDir,
    /// The admin Secret's name in `dbops-system`.
    admin_secret: String,
}

impl Drop for AsServiceAccounts {
    fn drop(&mut self) {
        let _ = self.b.kubectl.run(
            &[
                "delete",
                "secret",
                &self.admin_secret,
                "-n",
                SYSTEM_NAMESPACE,
                "--wait=false",
                "--ignore-not-found",
            ],
            None,
        );
    }
}

impl AsServiceAccounts {
    fn log(&self, controller: &str) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        let text = std::fs::read_to_string(path).unwrap_or_default();
        redact_passwords(&text.replace(self.pg.superuser_password(), "<superuser-password>"))
    }

    fn logs(&self) -> String {
        self.controllers
            .iter()
            .map(|(c, _)| format!("---- {c} log ----\n{}\n", self.log(c)))
            .collect()
    }
}

#[tokio::test]
async fn each_controller_does_its_job_with_a_token_of_its_own_service_account() {
    let b = bed("sa-token").await;
    deployed(b.cp).await;
    let ns = b.ns.name().to_string();
    let pg = PgServer::start("sa-token").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(b.client.clone(), &ns);
    // The admin Secret where the Deployments' controllers read it, named for this test
    // (dbops-system is shared); the DatabaseServer labelled as this test's, which the
    // controllers select.
    let admin_secret = format!("{ns}-pg-admin");
    dbops_e2e::fixtures::create_secret(
        &b.client,
        SYSTEM_NAMESPACE,
        &admin_secret,
        &[
            ("username", dbops_e2e::postgres::SUPERUSER),
            ("password", pg.superuser_password()),
        ],
    )
    .await
    .unwrap();
    let server = dbops_e2e::fixtures::server_name(&ns, "pg");
    dbops_e2e::fixtures::create_server(
        &b.client,
        &ns,
        &server,
        dbops_e2e::fixtures::server_spec(&pg, &admin_secret),
    )
    .await
    .unwrap();

    let logs = tempfile::tempdir().unwrap();
    let store = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", store.path().display());
    let pg_bin = paths::postgres_bin_dir().unwrap();
    let mut world = AsServiceAccounts {
        controllers: Vec::new(),
        pg,
        b,
        logs,
        _store: store,
        admin_secret,
    };
    for controller in CONTROLLERS {
        let account = format!("dbops-{controller}");
        let kubeconfig = world
            .b
            .cp
            .kubeconfig_for_service_account(SYSTEM_NAMESPACE, &account, Duration::from_secs(3600))
            .await
            .unwrap();
        // The flags and environment of the Deployment, scoped to this test's namespace.
        let mut args = vec![
            "--leader-elect".to_string(),
            format!("--watch-namespace={ns}"),
            "--resync-interval=5s".to_string(),
            "--backoff-base=1s".to_string(),
            "--backoff-max=5s".to_string(),
        ];
        match controller {
            "database-controller" => args.extend([
                format!("--backup-store={store_url}"),
                format!("--pg-restore={}", pg_bin.join("pg_restore").display()),
            ]),
            "backup-controller" => args.extend([
                format!("--backup-store={store_url}"),
                format!("--pg-dump={}", pg_bin.join("pg_dump").display()),
            ]),
            _ => args.extend([
                format!("--pg-dump={}", pg_bin.join("pg_dump").display()),
                format!("--pg-restore={}", pg_bin.join("pg_restore").display()),
            ]),
        }
        let pod = format!("{account}-sa-test");
        let mut env = vec![
            ("POD_NAMESPACE", SYSTEM_NAMESPACE),
            ("POD_NAME", pod.as_str()),
        ];
        if controller == "database-controller" {
            // As the Deployment sets it (from the pod's spec.serviceAccountName).
            env.push(("DBOPS_SERVICE_ACCOUNT", account.as_str()));
        }
        let c = start_controller(
            controller,
            controller,
            &kubeconfig,
            world.logs.path(),
            &args,
            &env,
        )
        .await
        .unwrap();
        world.controllers.push((controller, c));
    }
    // Each holds its Lease in dbops-system and has synced its watches: list and watch of
    // its kinds across the namespace, and get/create/patch of its Lease, are allowed.
    for (_, c) in &world.controllers {
        wait_leading(c, Duration::from_secs(60)).await;
    }

    // The database-controller provisions a Database; the backup-controller backs it up.
    let databases: Api<Database> = Api::namespaced(world.b.client.clone(), &ns);
    let db: Database = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Database",
        "metadata": {"name": "app"},
        "spec": {"serverRef": {"name": server}},
    }))
    .unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();
    if let Err(e) = dbops_e2e::wait::database_condition(
        &world.b.client,
        &ns,
        "app",
        Want::new("Ready", "True", Some("Provisioned")),
        Duration::from_secs(90),
    )
    .await
    {
        panic!("{e:#}\n{}", world.logs());
    }
    assert!(secrets.get_opt("app-connection").await.unwrap().is_some());

    let backups: Api<Backup> = Api::namespaced(world.b.client.clone(), &ns);
    let backup: Backup = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": "app-1"},
        "spec": {"databaseRef": {"name": "app"}},
    }))
    .unwrap();
    backups
        .create(&PostParams::default(), &backup)
        .await
        .unwrap();
    let completed = wait_for(
        "Backup app-1 to complete",
        Duration::from_secs(120),
        || async { Ok(backups.get("app-1").await?.status.and_then(|s| s.phase)) },
        |phase| *phase == Some(BackupPhase::Completed),
    )
    .await;
    if let Err(e) = completed {
        panic!("{e:#}\n{}", world.logs());
    }

    // What each ServiceAccount wrote, as the apiserver's audit log records it: its Lease,
    // and (for the two that acted) its objects; none of it refused.
    for (controller, _) in &world.controllers {
        let user = service_account_user(SYSTEM_NAMESPACE, &format!("dbops-{controller}"));
        let lease = world
            .b
            .cp
            .audit_writes(&user, Some(SYSTEM_NAMESPACE))
            .unwrap();
        assert!(
            lease.iter().any(|w| w.resource == "leases" && w.code < 300),
            "{user} never wrote its Lease: {lease:?}"
        );
        let writes = world.b.cp.audit_writes(&user, Some(&ns)).unwrap();
        let refused: Vec<_> = writes
            .iter()
            .chain(&lease)
            .filter(|w| w.code >= 400)
            .collect();
        // A 409 is a lost race the controllers expect (create of an existing object);
        // anything else refused is a missing permission or a bug.
        assert!(
            refused.iter().all(|w| w.code == 409),
            "{user} was refused: {refused:?}"
        );
        if *controller != "migration-controller" {
            assert!(!writes.is_empty(), "{user} wrote nothing in {ns}");
        }
        // Refused reads (a watch, a get) do not reach the audit log; they reach the log.
        let log = world.log(controller).to_lowercase();
        assert!(
            !log.contains("forbidden") && !log.contains("could not publish an event"),
            "{controller} was refused something:\n{}",
            world.log(controller)
        );
    }
    let wrote = |user: &str, resource: &str, verb: &str| {
        world
            .b
            .cp
            .audit_writes(user, Some(&ns))
            .unwrap()
            .iter()
            .any(|w| w.resource == resource && w.verb == verb && w.code < 300)
    };
    let database_user = service_account_user(SYSTEM_NAMESPACE, "dbops-database-controller");
    let backup_user = service_account_user(SYSTEM_NAMESPACE, "dbops-backup-controller");
    assert!(wrote(&database_user, "secrets", "create"));
    // Through the RoleBinding it made for the Database's namespace.
    assert!(wrote(&database_user, "rolebindings", "create"));
    assert!(wrote(&database_user, "events", "create"));
    assert!(wrote(&backup_user, "backups", "patch"));
    assert!(wrote(&backup_user, "events", "create"));
}

#[tokio::test]
async fn the_apiserver_refuses_a_controller_what_it_does_not_need() {
    let b = bed("sa-refused").await;
    deployed(b.cp).await;
    let ns = b.ns.name().to_string();

    // Objects to be refused on: a Secret and a Database.
    let secrets: Api<Secret> = Api::namespaced(b.client.clone(), &ns);
    let mut secret = Secret::default();
    secret.metadata.name = Some("precious".into());
    secret.string_data = Some(BTreeMap::from([("k".to_string(), "v".to_string())]));
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let databases: Api<Database> = Api::namespaced(b.client.clone(), &ns);
    let db: Database = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Database",
        "metadata": {"name": "orders"},
        "spec": {"serverRef": {"name": "pg-main"}},
    }))
    .unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();

    let token = |account: &'static str| {
        let cp = b.cp;
        async move {
            cp.kubeconfig_for_service_account(SYSTEM_NAMESPACE, account, Duration::from_secs(3600))
                .await
                .unwrap()
        }
    };
    let backup_kubeconfig = token("dbops-backup-controller").await;
    let database_kubeconfig = token("dbops-database-controller").await;
    let migration_kubeconfig = token("dbops-migration-controller").await;
    let as_backup = Kubectl::new(&backup_kubeconfig);
    let as_database = Kubectl::new(&database_kubeconfig);
    let as_migration = Kubectl::new(&migration_kubeconfig);

    // What RBAC answers, per verb: (kubectl, verb, resource, namespace or all, allowed).
    let lease = "leases/dbops-database-controller";
    // (The test's namespace stands in for dbops-system in the other tests, so it was granted
    // the Secrets Roles: the tenant namespace here is `default`.)
    let cases: [(&Kubectl, &str, &str, Option<&str>, bool); 35] = [
        // The backup-controller reads the admin and CA Secrets in its own namespace, no
        // tenant's, and writes none.
        (&as_backup, "get", "secrets", Some(SYSTEM_NAMESPACE), true),
        (&as_backup, "watch", "secrets", Some(SYSTEM_NAMESPACE), true),
        (&as_backup, "get", "secrets", Some("default"), false),
        (&as_backup, "list", "secrets", None, false),
        (&as_backup, "delete", "secrets", Some(&ns), false),
        (&as_backup, "create", "secrets", Some(&ns), false),
        // DatabaseServers are the platform team's: read, never written.
        (&as_backup, "watch", "databaseservers.dbops.dev", None, true),
        (
            &as_backup,
            "patch",
            "databaseservers.dbops.dev",
            None,
            false,
        ),
        // It watches Databases everywhere, and never writes them.
        (&as_backup, "watch", "databases.dbops.dev", None, true),
        (&as_backup, "patch", "databases.dbops.dev", Some(&ns), false),
        (
            &as_backup,
            "delete",
            "databases.dbops.dev",
            Some(&ns),
            false,
        ),
        // Its own kind: scheduled Backups are created and pruned.
        (&as_backup, "delete", "backups.dbops.dev", Some(&ns), true),
        // Not another controller's Lease, and no Lease outside dbops-system.
        (&as_backup, "patch", lease, Some(SYSTEM_NAMESPACE), false),
        (
            &as_backup,
            "create",
            "leases.coordination.k8s.io",
            Some(&ns),
            false,
        ),
        // The database-controller reads the admin and CA Secrets in its own namespace and
        // no tenant's Secret: it writes connection Secrets only where a Database needs
        // them, through a RoleBinding it makes there (none here: no Database is served),
        // and never deletes one.
        (&as_database, "get", "secrets", Some(SYSTEM_NAMESPACE), true),
        (&as_database, "get", "secrets", Some("default"), false),
        (&as_database, "list", "secrets", None, false),
        (&as_database, "create", "secrets", Some(&ns), false),
        (&as_database, "delete", "secrets", Some(&ns), false),
        // Those RoleBindings: it may bind the one ClusterRole holding the Secret verbs,
        // and delete only RoleBindings of that name; no other role, no escalation.
        (
            &as_database,
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            Some(&ns),
            true,
        ),
        (&as_database, "delete", TENANT_BINDING, Some(&ns), true),
        (
            &as_database,
            "delete",
            "rolebindings.rbac.authorization.k8s.io/other",
            Some(&ns),
            false,
        ),
        (
            &as_database,
            "update",
            "rolebindings.rbac.authorization.k8s.io/other",
            Some(&ns),
            false,
        ),
        (&as_database, "bind", TENANT_ROLE, None, true),
        (
            &as_database,
            "bind",
            "clusterroles.rbac.authorization.k8s.io/cluster-admin",
            None,
            false,
        ),
        (
            &as_database,
            "escalate",
            "clusterroles.rbac.authorization.k8s.io",
            None,
            false,
        ),
        (
            &as_database,
            "create",
            "clusterrolebindings.rbac.authorization.k8s.io",
            None,
            false,
        ),
        // It keeps the DatabaseServers' status and finalizer, and never deletes one.
        (
            &as_database,
            "delete",
            "databaseservers.dbops.dev",
            None,
            false,
        ),
        (
            &as_database,
            "delete",
            "databases.dbops.dev",
            Some(&ns),
            false,
        ),
        (
            &as_database,
            "delete",
            "backups.dbops.dev",
            Some(&ns),
            false,
        ),
        (&as_database, "patch", lease, Some(SYSTEM_NAMESPACE), true),
        // Nothing outside what it serves.
        (&as_database, "list", "pods", None, false),
        // The migration-controller reads the admin and CA Secrets in its own namespace
        // only: no tenant's Secret, and no list across namespaces.
        (
            &as_migration,
            "get",
            "secrets",
            Some(SYSTEM_NAMESPACE),
            true,
        ),
        (&as_migration, "get", "secrets", Some("default"), false),
        (&as_migration, "list", "secrets", None, false),
    ];
    for (kubectl, verb, resource, namespace, allowed) in cases {
        let answer = kubectl.can_i(verb, resource, namespace).unwrap();
        assert_eq!(
            answer,
            allowed,
            "can-i {verb} {resource} in {namespace:?} with {}",
            if std::ptr::eq(kubectl, &as_backup) {
                "the backup-controller's token"
            } else if std::ptr::eq(kubectl, &as_migration) {
                "the migration-controller's token"
            } else {
                "the database-controller's token"
            }
        );
    }

    // No controller may read a Secret in a namespace where no Database is served (the
    // test's namespace stands in for dbops-system: it was granted the Secrets Roles).
    for controller in CONTROLLERS {
        let user = service_account_user(SYSTEM_NAMESPACE, &format!("dbops-{controller}"));
        for namespace in ["default", "kube-system"] {
            assert!(
                !can_i_as(&b.kubectl, &user, "get", "secrets", namespace),
                "{user} may read the Secrets of namespace {namespace}"
            );
        }
    }

    // And real requests with the backup-controller's token: 403, nothing changed.
    let client = client_from_kubeconfig(&backup_kubeconfig).await.unwrap();
    let forbidden = |result: Result<(), kube::Error>, what: &str| match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what} with the backup-controller's token: expected 403, got {other:?}"),
    };
    let their_secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    forbidden(
        their_secrets
            .delete("precious", &DeleteParams::default())
            .await
            .map(|_| ()),
        "deleting a Secret",
    );
    let their_databases: Api<Database> = Api::namespaced(client.clone(), &ns);
    forbidden(
        their_databases
            .patch(
                "orders",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"connectionLimit": 1}})),
            )
            .await
            .map(|_| ()),
        "patching a Database",
    );
    // Neither the backup- nor the migration-controller can read a tenant's Secret (one in
    // `default`, a namespace no Role of theirs reaches).
    let tenant_secrets: Api<Secret> = Api::namespaced(b.client.clone(), "default");
    let mut tenant_secret = secret.clone();
    tenant_secret.metadata.name = Some(format!("precious-{ns}"));
    tenant_secrets
        .create(&PostParams::default(), &tenant_secret)
        .await
        .unwrap();
    for (kubeconfig, who) in [
        (&backup_kubeconfig, "backup-controller"),
        (&migration_kubeconfig, "migration-controller"),
    ] {
        let client = client_from_kubeconfig(kubeconfig).await.unwrap();
        match Api::<Secret>::namespaced(client, "default")
            .get(&format!("precious-{ns}"))
            .await
        {
            Err(kube::Error::Api(status)) if status.code == 403 => {}
            other => panic!(
                "reading a tenant's Secret with the {who}'s token: expected 403, got {:?}",
                other.map(|s| s.metadata.name)
            ),
        }
    }
    tenant_secrets
        .delete(&format!("precious-{ns}"), &DeleteParams::default())
        .await
        .unwrap();
    // What it may do still works with the same client: the refusal is RBAC, not a bad token.
    assert!(their_databases.get("orders").await.is_ok());
    assert!(secrets.get_opt("precious").await.unwrap().is_some());
    let db = databases.get("orders").await.unwrap();
    assert_ne!(db.spec.connection_limit, 1);

    // The audit log shows the refused write under the ServiceAccount's name.
    let user = service_account_user(SYSTEM_NAMESPACE, "dbops-backup-controller");
    let started = Instant::now();
    let refused = eventually(
        "the refused writes in the audit log",
        Duration::from_secs(10),
        || async { b.cp.audit_writes(&user, Some(&ns)) },
        |writes| writes.iter().filter(|w| w.code == 403).count() >= 2,
    )
    .await;
    assert!(
        refused
            .iter()
            .any(|w| w.verb == "delete" && w.resource == "secrets" && w.code == 403),
        "{refused:?} (after {:?})",
        started.elapsed()
    );
}

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

    let kubeconfig = crate::controller_kubeconfig(b.cp, "database-controller").await;
    let logs = tempfile::tempdir().unwrap();
    let args = [
        format!("--watch-namespace={}", tenant.name),
        format!("--controller-namespace={ctl}"),
        format!(
            "--server-selector={}={ctl}",
            dbops_e2e::fixtures::TEST_NAMESPACE_LABEL
        ),
        "--resync-interval=5s".to_string(),
        "--backoff-base=1s".to_string(),
        "--backoff-max=5s".to_string(),
    ];
    let controller =
        ControllerProcess::start("database-controller", &kubeconfig, logs.path(), &args).unwrap();
    let log = || {
        redact_passwords(
            &controller
                .process
                .log_tail(8000)
                .replace(pg.superuser_password(), "<superuser-password>"),
        )
    };

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
    let db: Database = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Database",
        "metadata": {"name": "app"},
        "spec": {"serverRef": {"name": server}, "deletionPolicy": "Retain"},
    }))
    .unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();
    let refused = Want::new("Ready", "False", Some("NamespaceNotAllowed"));
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
        Want::new("Ready", "True", Some("Provisioned")),
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
    let changed = dbops_e2e::fixtures::merge_patch(
        &servers,
        &server,
        json!({"spec": {"allowedNamespaces": {"matchLabels": {tenant_label: "nobody"}}}}),
    )
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
            let ready = dbops_e2e::wait::database_has(
                &databases.get("app").await?,
                Want::new("Ready", "True", Some("Provisioned")),
            );
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
