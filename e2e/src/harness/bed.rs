#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! One control plane for the whole test binary, and per test a client, kubectl and a
//! namespace of its own ([`bed`]); the controllers' own ServiceAccount identities.

use std::path::Path;

use tokio::sync::OnceCell;

use crate::controllers::ControllerProcess;
use crate::controlplane::{ControlPlane, Options};
use crate::harness::deploy;
use crate::kubectl::Kubectl;
use crate::namespace::TestNamespace;

/// The control plane shared by every test in this binary. Its processes are stopped by
/// their lifelines when the test binary exits.
pub async fn control_plane() -> &'static ControlPlane {
    static CP: OnceCell<ControlPlane> = OnceCell::const_new();
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    CP.get_or_init(|| async {
        crate::init_test_logging();
        let dir = DIR.get_or_init(|| {
            tempfile::Builder::new()
                .prefix("dbops-e2e-")
                .tempdir()
                .expect("temporary directory")
        });
        ControlPlane::start(Options {
            dir: dir.path().to_path_buf(),
            apiserver_port: None,
        })
        .await
        .expect("the control plane starts")
    })
    .await
}

/// A temporary directory `dbops-<prefix>-<what>-…` of one test (its store, its logs, …),
/// removed when dropped.
pub fn test_dir(prefix: &str, what: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("dbops-{prefix}-{what}-"))
        .tempdir()
        .unwrap()
}

/// A test controller's first flags: only namespace `ns` watched, a resync every `resync`
/// (`5s`, …) and a backoff of 1 s to 5 s.
pub fn watch_args(ns: &str, resync: &str) -> Vec<String> {
    vec![
        format!("--watch-namespace={ns}"),
        format!("--resync-interval={resync}"),
        "--backoff-base=1s".to_string(),
        "--backoff-max=5s".to_string(),
    ]
}

/// A database-controller with its own ServiceAccount's token ([`controller_kubeconfig`])
/// serving tenant namespace `tenant` from the controllers' namespace `ctl` (its admin
/// Secrets, and the DatabaseServers the fixtures label with it): [`watch_args`] with a
/// resync every `resync`, then `extra`; it logs into `logs`.
pub async fn start_tenant_database_controller(
    b: &Bed,
    tenant: &str,
    ctl: &str,
    resync: &str,
    extra: &[String],
    logs: &Path,
) -> ControllerProcess {
    let kubeconfig = controller_kubeconfig(b.cp, "database-controller").await;
    let mut args = watch_args(tenant, resync);
    args.extend([
        format!("--controller-namespace={ctl}"),
        format!(
            "--server-selector={}={ctl}",
            crate::fixtures::TEST_NAMESPACE_LABEL
        ),
    ]);
    args.extend_from_slice(extra);
    ControllerProcess::start("database-controller", &kubeconfig, logs, &args).unwrap()
}

/// The admin Secret of a harness's server (username postgres, the server's password),
/// and with it the DatabaseServer `server_name(ns, ADMIN_SECRET)` on that server: one
/// name in every harness that has one server.
pub const ADMIN_SECRET: &str = "pg-admin";

/// A client, kubectl and a fresh namespace for one test.
pub struct Bed {
    pub cp: &'static ControlPlane,
    pub client: kube::Client,
    pub kubectl: Kubectl,
    pub ns: TestNamespace,
}

pub async fn bed(prefix: &str) -> Bed {
    let cp = control_plane().await;
    let client = cp.client().await.expect("client");
    let kubectl = Kubectl::new(cp.kubeconfig());
    let ns = TestNamespace::create(&client, &kubectl, prefix)
        .await
        .expect("namespace");
    Bed {
        cp,
        client,
        kubectl,
        ns,
    }
}

/// Kubeconfigs holding a token of each controller's own ServiceAccount
/// (`dbops-system/dbops-<controller>`, with `deploy/`'s RBAC applied once), minted by the
/// TokenRequest API, by controller name: the suite runs every controller with exactly the
/// permissions it ships with, so a verb missing from its Role fails a test.
pub async fn controller_identities(
    cp: &ControlPlane,
) -> &'static std::collections::BTreeMap<String, std::path::PathBuf> {
    static KUBECONFIGS: OnceCell<std::collections::BTreeMap<String, std::path::PathBuf>> =
        OnceCell::const_new();
    KUBECONFIGS
        .get_or_init(|| async {
            deploy::deployed(cp).await;
            let mut all = std::collections::BTreeMap::new();
            for c in [
                "database-controller",
                "backup-controller",
                "migration-controller",
            ] {
                let path = cp
                    .kubeconfig_for_service_account(
                        "dbops-system",
                        &format!("dbops-{c}"),
                        std::time::Duration::from_secs(6 * 3600),
                    )
                    .await
                    .expect("a ServiceAccount token");
                all.insert(c.to_string(), path);
            }
            all
        })
        .await
}

/// The kubeconfig of [`controller_identities`] for one controller.
pub async fn controller_kubeconfig(cp: &ControlPlane, controller: &str) -> std::path::PathBuf {
    controller_identities(cp)
        .await
        .get(controller)
        .unwrap_or_else(|| panic!("no ServiceAccount for {controller}"))
        .clone()
}

/// The user a controller run with [`controller_kubeconfig`] is in the audit log.
pub fn controller_user(controller: &str) -> String {
    crate::controlplane::service_account_user("dbops-system", &format!("dbops-{controller}"))
}
