#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The deployment in `deploy/`, applied once per control plane into `dbops-system`
//! ([`deployed`]), and the controllers run as processes the way its pods would run them
//! ([`start_controller`], [`wait_leading`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use tokio::sync::OnceCell;

use crate::controllers::{ControllerProcess, controller_spec, http_get};
use crate::controlplane::ControlPlane;
use crate::kubectl::Kubectl;
use crate::paths;
use crate::postgres::redact_passwords;
use crate::process::{Supervised, free_port};
use crate::wait::wait_for;

/// Where the controllers, their ServiceAccounts and their Leases live.
pub const SYSTEM_NAMESPACE: &str = "dbops-system";
/// The ClusterRole of the Secret verbs the database-controller needs in a tenant
/// namespace, and the RoleBinding of it it makes there.
pub const TENANT_ROLE: &str =
    "clusterroles.rbac.authorization.k8s.io/dbops-database-controller-tenant-secrets";
pub const TENANT_BINDING: &str =
    "rolebindings.rbac.authorization.k8s.io/dbops-database-controller-tenant-secrets";
pub const TENANT_BINDING_NAME: &str = "dbops-database-controller-tenant-secrets";
/// How often the database-controller compares the namespaces it reaches with those needed.
pub const TENANT_TICK: Duration = Duration::from_secs(5);
pub const CONTROLLERS: [&str; 3] = [
    "database-controller",
    "backup-controller",
    "migration-controller",
];
pub fn deploy_dir() -> PathBuf {
    paths::repo_root().join("deploy")
}

/// Applies `deploy/namespace.yaml` and each `deploy/<controller>/` for real, once per
/// control plane (idempotent: a second apply changes nothing). The CRDs are the harness's.
pub async fn deployed(cp: &ControlPlane) {
    static DONE: OnceCell<()> = OnceCell::const_new();
    DONE.get_or_init(|| async {
        let kubectl = Kubectl::new(cp.kubeconfig());
        let namespace = deploy_dir().join("namespace.yaml").display().to_string();
        let out = kubectl.run(&["apply", "-f", &namespace], None).unwrap();
        assert!(out.success, "applying {namespace}: {}", out.text());
        for controller in CONTROLLERS {
            let out = kubectl
                .apply_kustomization(&deploy_dir().join(controller), false)
                .unwrap();
            assert!(
                out.success,
                "kubectl apply -k deploy/{controller}: {}",
                out.text()
            );
        }
    })
    .await;
}

/// Starts the controller binary `dbops-<controller>` as `name` (its log is
/// `<log_dir>/<name>.log`) with `kubeconfig`, `args` and `env`, on a free health and
/// metrics port, scoped to the watched namespace as `ControllerProcess::start` scopes it
/// (`controllers::scoped_args`); returns once `/healthz` answers.
pub async fn start_controller(
    controller: &str,
    name: &str,
    kubeconfig: &Path,
    log_dir: &Path,
    args: &[String],
    env: &[(&str, &str)],
) -> Result<ControllerProcess> {
    let port = free_port()?;
    let spec = controller_spec(controller, name, kubeconfig, port, args, env)?;
    let process = Supervised::start(&spec, log_dir)?;
    let log = process.log_path().to_path_buf();
    wait_for(
        &format!("{name} to answer /healthz"),
        Duration::from_secs(30),
        || async {
            Ok(http_get(port, "/healthz")
                .map(|(code, _)| code)
                .unwrap_or(0))
        },
        |code| *code == 200,
    )
    .await
    .map_err(|e| {
        e.context(format!(
            "{name} log:\n{}",
            redact_passwords(&crate::process::log_tail(&log, 4000))
        ))
    })?;
    Ok(ControllerProcess {
        process,
        metrics_port: port,
    })
}

/// Waits until the replica's `/readyz` says it is the ready leader.
pub async fn wait_leading(c: &ControllerProcess, timeout: Duration) {
    let what = format!("{} to lead and be ready", c.process.name());
    let result = wait_for(
        &what,
        timeout,
        || async { c.get("/readyz") },
        |(code, body)| *code == 200 && body.contains("leader"),
    )
    .await;
    if let Err(e) = result {
        panic!(
            "{e:#}\n---- {} log ----\n{}",
            c.process.name(),
            redact_passwords(&c.process.log_tail(6000))
        );
    }
}

/// `kubectl auth can-i <verb> <resource> -n <namespace> --as=<user>` (as the admin).
pub fn can_i_as(
    kubectl: &Kubectl,
    user: &str,
    verb: &str,
    resource: &str,
    namespace: &str,
) -> bool {
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
