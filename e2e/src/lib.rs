//! The dbops test bed: a real control plane (etcd, kube-apiserver,
//! kube-controller-manager built from Go modules by `e2e/install`), real PostgreSQL
//! servers, the real `kubectl`, and the three controller binaries, all started on
//! loopback by this crate and stopped when the test or dev session ends.

pub mod argocd;
pub mod chart;
pub mod controllers;
pub mod controlplane;
pub mod crd_compat;
pub mod fixtures;
pub mod harness;
pub mod jaeger;
pub mod kubeconform;
pub mod kubectl;
pub mod live_writer;
pub mod namespace;
pub mod paths;
pub mod pgbouncer;
pub mod postgres;
pub mod process;
pub mod s3;
pub mod secret_audit;
pub mod tls;
pub mod traps;
pub mod wait;

pub use controllers::ControllerProcess;
pub use controlplane::{AuditWrite, ControlPlane};
pub use kubectl::Kubectl;
pub use namespace::TestNamespace;
pub use postgres::PgServer;

use std::sync::Once;

/// Logs of the harness itself go to the test's output (`RUST_LOG` filters them).
pub fn init_test_logging() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info,kube_client::client::builder=off".into()),
            )
            .with_test_writer()
            .try_init();
    });
}
