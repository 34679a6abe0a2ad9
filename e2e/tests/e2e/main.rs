#![allow(clippy::unwrap_used)] // a test: an unwrap that fails is a failed test
//! Integration tests against the real test bed: a kube-apiserver, etcd and
//! kube-controller-manager built from Go modules, PostgreSQL from Debian's packages, the
//! machine's kubectl, and this workspace's controller binaries. One control plane serves
//! the whole binary; every test works in a namespace of its own.

mod api_validation;
mod backup;
mod control_plane;
mod controllers;
mod database;
mod deploy;
mod leader;
mod metrics;
mod migration;
mod postgres;
mod schedule;
mod traces;

use dbops_e2e::{ControlPlane, Kubectl, TestNamespace, controlplane::Options};
use tokio::sync::OnceCell;

/// The control plane shared by every test in this binary. Its processes are stopped by
/// their lifelines when the test binary exits.
pub async fn control_plane() -> &'static ControlPlane {
    static CP: OnceCell<ControlPlane> = OnceCell::const_new();
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    CP.get_or_init(|| async {
        dbops_e2e::init_test_logging();
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
