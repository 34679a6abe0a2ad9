//! Leader election (`--leader-elect`): only the replica holding the coordination.k8s.io/v1
//! Lease `dbops-<controller>` in the controllers' namespace (`--controller-namespace`, `$POD_NAMESPACE`) runs its controller.
//!
//! The Lease is managed by the `kube-lease-manager` crate: 15 s lease, renewed 5 s before it
//! expires, holder identity `$POD_NAME` (`<hostname>-<random>` when unset). A replica that
//! loses the Lease stops its controller and returns [`LeaderError::LostLeadership`], so the
//! process exits and Kubernetes restarts it as a standby, the way client-go's leader
//! election does. On shutdown the Lease is released.
//!
//! Two guards around the crate, both reading the Lease with `get` only:
//! - **A deposed leader stops at once and on time.** The leader reads its Lease every
//!   second; it steps down when the Lease names another holder, or when no renewal was seen
//!   for [`RENEW_DEADLINE`] (13 s) after the last one, which is before the Lease expires
//!   (15 s) and so before another replica can acquire it (client-go's renew deadline; the
//!   crate itself only notices a loss when a renewal succeeds and shows another holder, and
//!   never while the API server is unreachable). On a loss the controller is dropped, not
//!   drained: in-flight reconciles stop at their next await, like a crash they are built to
//!   survive, instead of completing writes for up to the shutdown grace.
//! - **A released Lease is taken over at once.** The crate's standby sleeps until the
//!   current term expires; a standby here also reads the Lease every [`STANDBY_POLL`] (2 s,
//!   client-go's retry period) and, when it shows no holder (a SIGTERMed leader released
//!   it), starts a fresh manager, which acquires it.

use std::{future::Future, time::Duration};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{Api, Client};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError};
use rand::distr::{Alphanumeric, SampleString};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::health::HealthState;

const LEASE_DURATION_SECONDS: u64 = 15;
const LEASE_GRACE_SECONDS: u64 = 5;
/// How long shutdown waits for the Lease to be released.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(3);
/// How often a standby reads the Lease to notice that it was released.
pub const STANDBY_POLL: Duration = Duration::from_secs(2);
/// How often the leader reads its own Lease.
const LEADER_POLL: Duration = Duration::from_secs(1);
/// A leader that has seen no renewal of its Lease for this long after the last renewal
/// steps down. Renewals are due 10 s after the previous one; the Lease expires after 15 s.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(13);

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
    /// `dbops-<controller>` in the controllers' namespace (`--controller-namespace`,
    /// `$POD_NAMESPACE`), held as `$POD_NAME`.
    pub fn new(controller: &str, namespace: &str) -> Self {
        Self {
            name: format!("dbops-{controller}"),
            namespace: namespace.to_owned(),
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
    let identity = lease.identity.clone().unwrap_or_else(random_identity);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &lease.namespace);
    let mut lead = Some(lead);
    health.set_ready(true);
    loop {
        let manager = LeaseManagerBuilder::new(client.clone(), &lease.name)
            .with_namespace(&lease.namespace)
            .with_duration(LEASE_DURATION_SECONDS)
            .with_grace(LEASE_GRACE_SECONDS)
            .with_identity(&identity)
            .build()
            .await
            .map_err(|source| LeaderError::Lease {
                namespace: lease.namespace.clone(),
                name: lease.name.clone(),
                source,
            })?;
        let (mut is_leader, manager_task) = manager.watch().await;
        tracing::info!(
            lease = %lease.name,
            namespace = %lease.namespace,
            %identity,
            "standing by for leadership"
        );

        let (outcome, release) = tokio::select! {
            () = shutdown.cancelled() => (Some(Ok(())), Release::Yes),
            () = released(&leases, &lease.name) => {
                tracing::info!(lease = %lease.name, "the Lease was released; taking it over now");
                (None, Release::Yes)
            }
            acquired = wait_for(&mut is_leader, true) => match (acquired, lead.take()) {
                (Ok(()), Some(lead)) => {
                    let term = Term {
                        is_leader: &mut is_leader,
                        leases: &leases,
                        lease: &lease.name,
                        identity: &identity,
                    };
                    let (outcome, release) =
                        lead_until_lost(term, health, &shutdown, lead).await;
                    (Some(outcome), release)
                }
                (Ok(()), None) => (Some(Err(LeaderError::ManagerStopped)), Release::Yes),
                (Err(error), _) => (Some(Err(error)), Release::Yes),
            },
        };
        stop_manager(is_leader, manager_task, release, &lease.name).await;
        if let Some(outcome) = outcome {
            return outcome;
        }
    }
}

/// Whether stopping the Lease manager may release the Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Release {
    /// This replica holds it (or nobody does): release it.
    Yes,
    /// Another replica holds it: the manager's view is stale and its release would clear
    /// the new holder's Lease, so the manager is stopped without one.
    No,
}

/// Stops the Lease manager: closing the channel makes it release the Lease; aborting it
/// does not.
async fn stop_manager(
    is_leader: watch::Receiver<bool>,
    manager_task: JoinHandle<Result<LeaseManager, LeaseManagerError>>,
    release: Release,
    lease: &str,
) {
    if release == Release::No {
        manager_task.abort();
        let _ = manager_task.await;
        drop(is_leader);
        tracing::info!(lease, "left the Lease to its new holder");
        return;
    }
    drop(is_leader);
    match tokio::time::timeout(RELEASE_TIMEOUT, manager_task).await {
        Ok(Ok(Ok(_))) => tracing::info!(lease, "released the Lease"),
        Ok(Ok(Err(error))) => tracing::warn!(%error, "failed to release the Lease"),
        Ok(Err(error)) => tracing::warn!(%error, "the Lease manager task failed"),
        Err(_) => tracing::warn!("timed out releasing the Lease; it expires on its own"),
    }
}

/// What the leader watches during its term.
struct Term<'a> {
    is_leader: &'a mut watch::Receiver<bool>,
    leases: &'a Api<Lease>,
    lease: &'a str,
    identity: &'a str,
}

async fn lead_until_lost<F, Fut>(
    term: Term<'_>,
    health: &HealthState,
    shutdown: &CancellationToken,
    lead: F,
) -> (Result<(), LeaderError>, Release)
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    tracing::info!("acquired leadership");
    health.set_ready(false);
    health.set_leader(true);
    let stop = shutdown.child_token();
    // Boxed so that it can be dropped (with every in-flight reconcile) before returning.
    let mut controller = Box::pin(lead(stop.clone()));
    let outcome = tokio::select! {
        () = &mut controller => (Ok(()), Release::Yes),
        lost = wait_for(term.is_leader, false) => {
            tracing::warn!("lost leadership; stopping the controller now");
            (Err(lost.err().unwrap_or(LeaderError::LostLeadership)), Release::Yes)
        }
        deposed = deposed(term.leases, term.lease, term.identity) => step_down(deposed),
    };
    // On a loss the controller future is dropped here, in-flight reconciles with it.
    stop.cancel();
    drop(controller);
    health.set_leader(false);
    outcome
}

/// The write fence of a leader-elected process: the last time its leadership was
/// confirmed (a renewal seen on its Lease). The client refuses a write locally, without
/// sending it, once that is older than [`RENEW_DEADLINE`] (`client::WriteFence`): a leader
/// frozen (SIGSTOP, a stalled VM) past its Lease wakes up with timers due and reconciles
/// resuming, and their writes would otherwise reach the API server before the leader
/// notices, within a second, that it was deposed. Lease writes pass (they are how
/// leadership is kept or taken). Without leader election the fence is open.
pub mod fence {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

    use jiff::Timestamp;

    static ACTIVE: AtomicBool = AtomicBool::new(false);
    static CONFIRMED_MS: AtomicI64 = AtomicI64::new(i64::MIN);

    /// Leadership confirmed at `at`: writes are allowed until `at` + the renew deadline.
    pub fn confirmed(at: Timestamp) {
        ACTIVE.store(true, Ordering::Release);
        CONFIRMED_MS.fetch_max(at.as_millisecond(), Ordering::AcqRel);
    }

    /// Why a write must not be sent now, if it must not.
    pub fn closed(now: Timestamp) -> Option<String> {
        if !ACTIVE.load(Ordering::Acquire) {
            return None;
        }
        let confirmed = CONFIRMED_MS.load(Ordering::Acquire);
        let age_ms = now.as_millisecond().saturating_sub(confirmed);
        let deadline_ms = i64::try_from(super::RENEW_DEADLINE.as_millis()).unwrap_or(i64::MAX);
        (age_ms > deadline_ms).then(|| {
            format!(
                "write refused: leadership last confirmed {:.1} s ago (more than the {} s renew deadline); this replica may have been deposed",
                age_ms as f64 / 1000.0,
                super::RENEW_DEADLINE.as_secs()
            )
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn writes_close_past_the_renew_deadline_after_the_last_confirmation() {
            let t0 = Timestamp::now();
            confirmed(t0);
            assert_eq!(closed(t0 + jiff::SignedDuration::from_secs(5)), None);
            let late = closed(t0 + jiff::SignedDuration::from_secs(45));
            assert!(late.is_some_and(|why| why.contains("may have been deposed")));
            // A later confirmation opens it again; an earlier one changes nothing.
            confirmed(t0 + jiff::SignedDuration::from_secs(44));
            confirmed(t0);
            assert_eq!(closed(t0 + jiff::SignedDuration::from_secs(45)), None);
        }
    }
}

/// Why a leader must stop although its Lease manager has not said so.
#[derive(Debug)]
enum Deposed {
    /// The Lease names another holder (or none).
    NotHolder(Option<String>),
    /// No renewal seen for [`RENEW_DEADLINE`] after the last one (the time since it).
    Unrenewed(SignedDuration),
}

/// Logs why the leader steps down; whether the Lease is still its own to release.
fn step_down(deposed: Deposed) -> (Result<(), LeaderError>, Release) {
    let release = match deposed {
        Deposed::NotHolder(holder) => {
            tracing::warn!(
                holder = holder.as_deref().unwrap_or("<none>"),
                "the Lease names another holder; stopping the controller now"
            );
            Release::No
        }
        Deposed::Unrenewed(since) => {
            tracing::warn!(
                ?since,
                deadline = ?RENEW_DEADLINE,
                "the Lease was not renewed in time; stepping down before it expires"
            );
            Release::Yes
        }
    };
    (Err(LeaderError::LostLeadership), release)
}

/// Reads the Lease every [`LEADER_POLL`] while leading; resolves when this replica must
/// stop acting as leader.
async fn deposed(leases: &Api<Lease>, lease: &str, identity: &str) -> Deposed {
    let deadline = SignedDuration::from_secs(RENEW_DEADLINE.as_secs().cast_signed());
    let mut renewed = Timestamp::now();
    fence::confirmed(renewed);
    loop {
        tokio::time::sleep(LEADER_POLL).await;
        // First without I/O: a process that was frozen (or starved) past the deadline
        // steps down on its first wake-up, without waiting for an answer.
        let since = Timestamp::now().duration_since(renewed);
        if since > deadline {
            return Deposed::Unrenewed(since);
        }
        // Bounded, so that an API server that does not answer cannot hold off the deadline.
        match tokio::time::timeout(LEADER_POLL, leases.get_opt(lease)).await {
            Err(_) => tracing::debug!("reading the Lease timed out; renewal unconfirmed"),
            Ok(Err(error)) => {
                tracing::debug!(%error, "could not read the Lease; renewal unconfirmed");
            }
            Ok(Ok(found)) => {
                let spec = found.and_then(|l| l.spec).unwrap_or_default();
                if spec.holder_identity.as_deref() != Some(identity) {
                    return Deposed::NotHolder(spec.holder_identity);
                }
                if let Some(renew) = spec.renew_time {
                    renewed = renewed.max(renew.0);
                    fence::confirmed(renewed);
                }
            }
        }
        let since = Timestamp::now().duration_since(renewed);
        if since > deadline {
            return Deposed::Unrenewed(since);
        }
    }
}

/// Reads the Lease every [`STANDBY_POLL`]; resolves once it shows no holder (released,
/// and not yet taken by anyone: a fresh Lease manager takes it at once). A Lease that
/// does not exist yet is the manager's to create.
async fn released(leases: &Api<Lease>, lease: &str) {
    loop {
        tokio::time::sleep(STANDBY_POLL).await;
        match leases.get_opt(lease).await {
            Ok(Some(found)) => {
                if found.spec.and_then(|s| s.holder_identity).is_none() {
                    return;
                }
            }
            Ok(None) => {}
            Err(error) => tracing::debug!(%error, "could not read the Lease"),
        }
    }
}

/// This replica's identity: `$POD_NAME`, or `<hostname>-<random>` without it (a process
/// started again then has a new identity).
pub fn identity() -> String {
    std::env::var("POD_NAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(random_identity)
}

/// `<hostname>-<random>` for a replica without `$POD_NAME`.
fn random_identity() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "dbops".to_owned());
    let suffix = Alphanumeric
        .sample_string(&mut rand::rng(), 8)
        .to_lowercase();
    format!("{host}-{suffix}")
}

/// Waits until the leadership flag equals `leader`.
async fn wait_for(is_leader: &mut watch::Receiver<bool>, leader: bool) -> Result<(), LeaderError> {
    is_leader
        .wait_for(|current| *current == leader)
        .await
        .map(|_| ())
        .map_err(|_| LeaderError::ManagerStopped)
}

#[cfg(test)]
mod tests {
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;

    use super::*;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn leases() -> (Api<Lease>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "dbops-system");
        (Api::namespaced(client, "dbops-system"), handle)
    }

    /// Answers every GET of the Lease with `holder` (none: released), renewed now.
    fn serve(mut handle: Handle, holder: Option<&'static str>) -> JoinHandle<usize> {
        tokio::spawn(async move {
            let mut served = 0;
            while let Some((request, send)) = handle.next_request().await {
                assert_eq!(request.method(), http::Method::GET);
                assert!(
                    request.uri().path().ends_with("/leases/dbops-test"),
                    "{}",
                    request.uri()
                );
                let lease = json!({
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": "dbops-test", "namespace": "dbops-system"},
                    "spec": {
                        "holderIdentity": holder,
                        "renewTime": Timestamp::now().to_string(),
                        "leaseDurationSeconds": 15,
                    },
                });
                let body = Body::from(serde_json::to_vec(&lease).unwrap());
                send.send_response(Response::builder().status(200).body(body).unwrap());
                served += 1;
            }
            served
        })
    }

    /// Once the client is gone, the fake API server ends: it answered exactly one request.
    async fn assert_served_once(api: Api<Lease>, server: JoinHandle<usize>) {
        drop(api);
        assert_eq!(server.await.unwrap(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_lease_names_another_holder_is_deposed_without_releasing() {
        let (api, handle) = leases();
        let server = serve(handle, Some("replica-b"));
        let deposed = deposed(&api, "dbops-test", "replica-a").await;
        assert!(
            matches!(&deposed, Deposed::NotHolder(Some(h)) if h == "replica-b"),
            "{deposed:?}"
        );
        let (outcome, release) = step_down(deposed);
        assert!(matches!(outcome, Err(LeaderError::LostLeadership)));
        assert_eq!(
            release,
            Release::No,
            "the new holder's Lease is not cleared"
        );
        assert_served_once(api, server).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_sees_its_lease_renewed_stays() {
        let (api, handle) = leases();
        let _server = serve(handle, Some("replica-a"));
        let still = tokio::time::timeout(
            Duration::from_secs(60),
            deposed(&api, "dbops-test", "replica-a"),
        )
        .await;
        assert!(still.is_err(), "deposed although renewed: {still:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_notices_a_released_lease() {
        let (api, handle) = leases();
        let server = serve(handle, None);
        tokio::time::timeout(Duration::from_secs(10), released(&api, "dbops-test"))
            .await
            .expect("a Lease without holder is noticed at the first poll");
        assert_served_once(api, server).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_leaves_a_held_lease_alone() {
        let (api, handle) = leases();
        let _server = serve(handle, Some("replica-b"));
        let waited =
            tokio::time::timeout(Duration::from_secs(60), released(&api, "dbops-test")).await;
        assert!(waited.is_err(), "a held Lease was taken for released");
    }
}
