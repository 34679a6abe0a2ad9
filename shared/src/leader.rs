//! Leader election (`--leader-elect`): only the replica holding the coordination.k8s.io/v1
//! Lease `dbops-<controller>` in `$POD_NAMESPACE` (default `default`) runs its controller.
//!
//! The Lease is managed by the `kube-lease-manager` crate: 15 s lease, renewed 5 s before it
//! expires, holder identity `$POD_NAME` (random when unset). A replica that loses the Lease
//! stops its controller and returns [`LeaderError::LostLeadership`], so the process exits and
//! Kubernetes restarts it as a standby, the way client-go's leader election does. On
//! shutdown the Lease is released so a standby takes over without waiting for expiry.

use std::{future::Future, time::Duration};

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::health::HealthState;

const LEASE_DURATION_SECONDS: u64 = 15;
const LEASE_GRACE_SECONDS: u64 = 5;
/// How long shutdown waits for the Lease to be released.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why leader election ended the process.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("failed to set up the Lease {namespace}/{name}: {source}")]
    Lease {
        namespace: String,
        name: String,
        source: LeaseManagerError,
    },
    #[error("lost leadership of the Lease; exiting so a fresh replica can stand by")]
    LostLeadership,
    #[error("the Lease manager stopped unexpectedly")]
    ManagerStopped,
}

/// The Lease of one controller.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    pub name: String,
    pub namespace: String,
    /// `$POD_NAME`, or a random identity when unset.
    pub identity: Option<String>,
}

impl LeaseSettings {
    /// `dbops-<controller>` in `$POD_NAMESPACE` (default `default`).
    pub fn from_env(controller: &str) -> Self {
        Self {
            name: format!("dbops-{controller}"),
            namespace: std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".to_owned()),
            identity: std::env::var("POD_NAME").ok(),
        }
    }
}

/// Stands by until this replica holds the Lease, then runs `lead` until `shutdown` or until
/// the Lease is lost. `lead` receives a token cancelled when it must stop.
///
/// A standby reports ready; a leader reports not ready until `lead` marks its stores synced.
pub async fn run_as_leader<F, Fut>(
    client: Client,
    lease: LeaseSettings,
    health: &HealthState,
    shutdown: CancellationToken,
    lead: F,
) -> Result<(), LeaderError>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut builder = LeaseManagerBuilder::new(client, &lease.name)
        .with_namespace(&lease.namespace)
        .with_duration(LEASE_DURATION_SECONDS)
        .with_grace(LEASE_GRACE_SECONDS);
    if let Some(identity) = &lease.identity {
        builder = builder.with_identity(identity);
    }
    let manager = builder.build().await.map_err(|source| LeaderError::Lease {
        namespace: lease.namespace.clone(),
        name: lease.name.clone(),
        source,
    })?;
    let (mut is_leader, manager_task) = manager.watch().await;
    health.set_ready(true);
    tracing::info!(lease = %lease.name, namespace = %lease.namespace, "standing by for leadership");

    let outcome = tokio::select! {
        () = shutdown.cancelled() => Ok(()),
        acquired = wait_for(&mut is_leader, true) => match acquired {
            Ok(()) => lead_until_lost(&mut is_leader, health, &shutdown, lead).await,
            Err(error) => Err(error),
        },
    };

    // Closing the channel makes the manager release the Lease and stop.
    drop(is_leader);
    match tokio::time::timeout(RELEASE_TIMEOUT, manager_task).await {
        Ok(Ok(Ok(_))) => tracing::info!(lease = %lease.name, "released the Lease"),
        Ok(Ok(Err(error))) => tracing::warn!(%error, "failed to release the Lease"),
        Ok(Err(error)) => tracing::warn!(%error, "the Lease manager task failed"),
        Err(_) => tracing::warn!("timed out releasing the Lease; it expires on its own"),
    }
    outcome
}

async fn lead_until_lost<F, Fut>(
    is_leader: &mut watch::Receiver<bool>,
    health: &HealthState,
    shutdown: &CancellationToken,
    lead: F,
) -> Result<(), LeaderError>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    tracing::info!("acquired leadership");
    health.set_ready(false);
    health.set_leader(true);
    let stop = shutdown.child_token();
    let controller = lead(stop.clone());
    tokio::pin!(controller);
    let outcome = tokio::select! {
        () = &mut controller => Ok(()),
        lost = wait_for(is_leader, false) => {
            tracing::warn!("lost leadership; stopping the controller");
            stop.cancel();
            controller.await;
            Err(lost.err().unwrap_or(LeaderError::LostLeadership))
        }
    };
    health.set_leader(false);
    outcome
}

/// Waits until the leadership flag equals `leader`.
async fn wait_for(is_leader: &mut watch::Receiver<bool>, leader: bool) -> Result<(), LeaderError> {
    is_leader
        .wait_for(|current| *current == leader)
        .await
        .map(|_| ())
        .map_err(|_| LeaderError::ManagerStopped)
}
