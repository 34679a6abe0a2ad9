//! The Kubernetes client every controller uses: configuration from `KUBECONFIG` (or
//! `~/.kube/config`) or the in-cluster service account, behind the `--api-rate-limit`
//! token bucket.

use std::num::NonZeroU32;

use kube::{Client, Config, client::ClientBuilder};

use crate::rate_limit::{RateLimitLayer, RateLimiter};

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no Kubernetes configuration found (KUBECONFIG, ~/.kube/config or in-cluster): {0}")]
    Config(#[from] kube::config::InferConfigError),
    #[error("failed to build the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
}

/// A client whose requests are limited to `requests_per_second` (bursts of twice that).
pub async fn rate_limited_client(requests_per_second: NonZeroU32) -> Result<Client, ClientError> {
    let config = Config::infer().await?;
    let layer = RateLimitLayer::new(RateLimiter::new(requests_per_second));
    Ok(ClientBuilder::try_from(config)?.with_layer(&layer).build())
}
