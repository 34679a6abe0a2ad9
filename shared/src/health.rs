//! The health and metrics HTTP server:
//!
//! - `GET /healthz`: 200 `ok` while the process runs;
//! - `GET /readyz`: 200 once this replica is ready, 503 with the reason otherwise. Without
//!   leader election that is "the watch stores have synced"; with leader election a standby
//!   replica is ready once it takes part in the election, and the leader once its stores have
//!   synced. The body names the role (`leader`, `standby`). While a startup check blocks
//!   the process ([`HealthState::set_blocked`], for example a backup store it cannot
//!   write), it is not ready whatever else holds, and the body is `not ready: <reason>`;
//! - `GET /metrics`: Prometheus metrics in the OpenMetrics text format.

use std::{
    future::Future,
    net::SocketAddr,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use tokio::net::TcpListener;

use crate::metrics::Metrics;

const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why the health server stopped.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("failed to listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("health server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// Readiness and leadership of this replica; clones share the same state.
#[derive(Clone, Debug)]
pub struct HealthState {
    inner: Arc<Flags>,
}

#[derive(Debug)]
struct Flags {
    leader_election: bool,
    ready: AtomicBool,
    leader: AtomicBool,
    /// Why a startup check keeps the process from starting its controllers.
    blocked: Mutex<Option<String>>,
}

impl HealthState {
    /// Not ready and not leader; `leader_election` is whether `--leader-elect` is on.
    pub fn new(leader_election: bool) -> Self {
        Self {
            inner: Arc::new(Flags {
                leader_election,
                ready: AtomicBool::new(false),
                leader: AtomicBool::new(false),
                blocked: Mutex::new(None),
            }),
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Release);
    }

    pub fn set_leader(&self, leader: bool) {
        self.inner.leader.store(leader, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire)
    }

    pub fn is_leader(&self) -> bool {
        self.inner.leader.load(Ordering::Acquire)
    }

    /// Not ready because of `reason` (a startup check that fails, for example
    /// `BackupStoreNotWritable: ...`) until called again with `None`.
    pub fn set_blocked(&self, reason: Option<String>) {
        *self
            .inner
            .blocked
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = reason;
    }

    /// Why a startup check blocks the process, if one does.
    pub fn blocked(&self) -> Option<String> {
        self.inner
            .blocked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The `/readyz` answer: `Ok(body)` when ready, `Err(reason)` otherwise.
    pub fn readiness(&self) -> Result<String, String> {
        if let Some(reason) = self.blocked() {
            return Err(format!("not ready: {reason}"));
        }
        let ready = self.is_ready();
        if !self.inner.leader_election {
            return match ready {
                true => Ok("ready".to_owned()),
                false => Err("not ready: watch stores have not synced yet".to_owned()),
            };
        }
        match (ready, self.is_leader()) {
            (true, true) => Ok("ready (leader)".to_owned()),
            (true, false) => Ok("ready (standby)".to_owned()),
            (false, true) => Err("not ready (leader): watch stores have not synced yet".to_owned()),
            (false, false) => {
                Err("not ready (standby): not yet taking part in leader election".to_owned())
            }
        }
    }
}

#[derive(Clone)]
struct AppState {
    health: HealthState,
    metrics: Arc<Metrics>,
}

/// The routes, without a listener.
pub fn router(health: HealthState, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState { health, metrics })
}

/// Serves the routes on `addr` until `shutdown` completes. Logs `listening on <addr>`.
pub async fn serve(
    addr: SocketAddr,
    health: HealthState,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), HealthError> {
    serve_on(bind(addr).await?, health, metrics, shutdown).await
}

/// Binds `addr` (so a taken port fails startup before anything else runs).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, HealthError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| HealthError::Bind { addr, source })
}

/// Serves the routes on a bound listener until `shutdown` completes. Logs
/// `listening on <addr>` with the bound address.
pub async fn serve_on(
    listener: TcpListener,
    health: HealthState,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), HealthError> {
    let bound = listener.local_addr().map_err(HealthError::Serve)?;
    tracing::info!("listening on {bound}");
    axum::serve(listener, router(health, metrics))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(HealthError::Serve)
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.health.readiness() {
        Ok(body) => (StatusCode::OK, body).into_response(),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    match state.metrics.encode() {
        Ok(body) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(error) => {
            tracing::warn!(%error, "failed to encode metrics");
            (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_leader_election_ready_means_synced() {
        let health = HealthState::new(false);
        assert!(health.readiness().is_err());
        health.set_ready(true);
        assert_eq!(health.readiness(), Ok("ready".to_owned()));
    }

    #[test]
    fn with_leader_election_the_body_names_the_role() {
        let health = HealthState::new(true);
        health.set_ready(true);
        assert_eq!(health.readiness(), Ok("ready (standby)".to_owned()));
        health.set_leader(true);
        health.set_ready(false);
        assert!(health.readiness().unwrap_err().contains("leader"));
        health.set_ready(true);
        assert_eq!(health.readiness(), Ok("ready (leader)".to_owned()));
    }

    #[test]
    fn a_blocked_process_is_not_ready_and_says_why() {
        for leader_election in [false, true] {
            let health = HealthState::new(leader_election);
            health.set_ready(true);
            health.set_blocked(Some("BackupStoreNotWritable: /x: Not a directory".into()));
            assert_eq!(
                health.readiness(),
                Err("not ready: BackupStoreNotWritable: /x: Not a directory".to_owned())
            );
            health.set_blocked(None);
            assert!(health.readiness().is_ok());
        }
    }

    #[tokio::test]
    async fn endpoints_answer() {
        let health = HealthState::new(false);
        let metrics = Arc::new(Metrics::new("test-controller"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(health.clone(), metrics);
        tokio::spawn(async move { axum::serve(listener, app).await });

        assert_eq!(get_status(addr, "/healthz").await, 200);
        assert_eq!(get_status(addr, "/readyz").await, 503);
        health.set_ready(true);
        assert_eq!(get_status(addr, "/readyz").await, 200);
        assert_eq!(get_status(addr, "/metrics").await, 200);
    }

    /// A bare HTTP/1.1 GET; returns the status code.
    async fn get_status(addr: SocketAddr, path: &str) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response[9..12].parse().unwrap()
    }
}
