//! The Kubernetes client every controller uses: configuration from `KUBECONFIG` (or
//! `~/.kube/config`) or the in-cluster service account, behind the `--api-rate-limit`
//! token bucket, with every request traced and counted ([`TraceLayer`]), and every
//! watcher's request reported to the process's [`WatchHealth`].

use std::{
    future::Future,
    num::NonZeroU32,
    pin::Pin,
    task::{Context, Poll},
};

use http::{Request, Response};
use kube::{
    Client, Config,
    client::{ClientBuilder, retry::RetryPolicy},
};
use tower::{Layer, Service};
use tracing::{Instrument, field};

use crate::{
    api_path::{is_collection, is_watch, resource_of},
    metrics::{Target, observe_external_request, record_external_request},
    rate_limit::{RateLimitLayer, RateLimiter},
    watch_health::{WatchHealth, watch_of},
};

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no Kubernetes configuration found (KUBECONFIG, ~/.kube/config or in-cluster): {0}")]
    Config(#[from] kube::config::InferConfigError),
    #[error("failed to build the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
}

/// A client whose requests are limited to `requests_per_second` (bursts of twice that).
pub async fn rate_limited_client(
    requests_per_second: NonZeroU32,
    timeout: std::time::Duration,
) -> Result<Client, ClientError> {
    let mut config = Config::infer().await?;
    // kube's default retry policy is off: it retried 429/503/504 up to 15 times inside
    // `timeout`, honouring `Retry-After` with a backoff that grows to minutes, so a watch
    // or list the apiserver refused for a while ended as an opaque `request timed out`
    // after `timeout`, never saying why. In its place, a bounded one below the rate
    // limit: a request the apiserver refuses for now (429 from API Priority and Fairness
    // or while a resource's storage starts: it was not carried out; 503, 504) waits what
    // `Retry-After` says (or 0.2 s doubling to 5 s) and is sent again, at most 3 times,
    // each attempt with its own `timeout` (and one token of the rate limit for all). The
    // apiserver's 429 thus slows the caller down instead of failing its reconcile;
    // what is still refused after that reaches the caller as it is.
    config.default_retry = false;
    let layer = RateLimitLayer::new(RateLimiter::new(requests_per_second));
    // Innermost, the deadline of each request: its response (for a watch, the start of
    // the stream) within `timeout`, or an error the reconcile reports and retries. The
    // trace layer sits inside the rate limit: a span measures the request, not the wait
    // for a token.
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&tower::timeout::TimeoutLayer::new(timeout))
        // The retry sends clones of the service below it: a buffer makes the stack one.
        .with_layer(&tower::buffer::BufferLayer::new(1024))
        .with_layer(&tower::retry::RetryLayer::new(refused_again()))
        .with_layer(&WriteFence)
        .with_layer(&TraceLayer)
        .with_layer(&layer)
        .build())
}

/// The retry of a request the apiserver refused for now (see [`rate_limited_client`]).
fn refused_again() -> RetryPolicy {
    RetryPolicy::new(
        std::time::Duration::from_millis(200),
        std::time::Duration::from_secs(5),
        3,
        true,
    )
    .unwrap_or_default()
}

/// Refuses a write (any method but GET, HEAD, OPTIONS) locally while the leader-election
/// write fence is closed ([`crate::leader::fence`]); Lease writes always pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteFence;

impl<S> Layer<S> for WriteFence {
    type Service = Fenced<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Fenced { inner }
    }
}

/// The service of [`WriteFence`].
#[derive(Clone, Debug)]
pub struct Fenced<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for Fenced<S>
where
    S: Service<Request<B>>,
    S::Response: Send + 'static,
    S::Error: Into<tower::BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, tower::BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let write = !matches!(
            *request.method(),
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        );
        if write
            && resource_of(request.uri().path()) != "leases"
            && let Some(why) = crate::leader::fence::closed(jiff::Timestamp::now())
        {
            return Box::pin(std::future::ready(Err(why.into())));
        }
        let response = self.inner.call(request);
        Box::pin(async move { response.await.map_err(Into::into) })
    }
}

/// One `kubernetes` span per request sent inside a span (a reconcile): named
/// `<METHOD> <resource>[/<subresource>]`, with `http.request.method`, `url.path` (never
/// the query, never a body), `k8s.resource` and `http.response.status_code`. Every
/// request, traced or not (watches run outside reconciles), counts in
/// `dbops_external_requests_total{target="kubernetes"}`. A watcher's request (a watch
/// start or a paged list of a collection) tells the process's [`WatchHealth`] how its
/// watch is doing: answered with success, or failed.
#[derive(Clone, Copy, Debug, Default)]
pub struct TraceLayer;

impl<S> Layer<S> for TraceLayer {
    type Service = Traced<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Traced { inner }
    }
}

/// The service of [`TraceLayer`].
#[derive(Clone, Debug)]
pub struct Traced<S> {
    inner: S,
}

impl<S, B, RB> Service<Request<B>> for Traced<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: std::fmt::Display,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // A watch's answer is its stream's start; its duration says nothing of the API.
        let watch = is_watch(request.uri().query());
        let resource = resource_of(request.uri().path());
        crate::metrics::record_kubernetes_request(
            verb_of(request.method(), request.uri().path(), watch),
            resource.clone(),
        );
        // A watcher's request: its answer tells the watch's health (watch_health.rs).
        let watcher = watch_of(request.method(), request.uri());
        let started = std::time::Instant::now();
        let span = if tracing::Span::current().is_none() {
            tracing::Span::none()
        } else {
            let method = request.method().as_str();
            let path = request.uri().path();
            tracing::info_span!(
                "kubernetes",
                otel.name = %format_args!("{method} {resource}"),
                otel.kind = "client",
                otel.status_code = field::Empty,
                http.request.method = method,
                url.path = path,
                k8s.resource = resource,
                http.response.status_code = field::Empty,
            )
        };
        let response = span.in_scope(|| self.inner.call(request));
        Box::pin(
            async move {
                let result = response.await;
                if let Some(watch) = &watcher {
                    let health = WatchHealth::process();
                    match &result {
                        Ok(response) => health.answered(watch, response.status()),
                        Err(error) => health.unanswered(watch, error),
                    }
                }
                let outcome = match &result {
                    Ok(response) => {
                        let status = response.status();
                        let span = tracing::Span::current();
                        span.record("http.response.status_code", status.as_u16());
                        if status.is_server_error() || status.is_client_error() {
                            span.record("otel.status_code", "ERROR");
                        }
                        outcome_of(status)
                    }
                    Err(_) => {
                        tracing::Span::current().record("otel.status_code", "ERROR");
                        "error"
                    }
                };
                record_external_request(Target::Kubernetes, outcome);
                if !watch {
                    observe_external_request(Target::Kubernetes, started.elapsed());
                }
                result
            }
            .instrument(span),
        )
    }
}

/// The Kubernetes verb of a request: `watch`, `list`, `get`, `create`, `update`,
/// `patch`, `delete` (`other` for anything else).
fn verb_of(method: &http::Method, path: &str, watch: bool) -> &'static str {
    match *method {
        http::Method::GET if watch => "watch",
        http::Method::GET if is_collection(path) => "list",
        http::Method::GET => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => "other",
    }
}

/// The `outcome` label of an answered request.
fn outcome_of(status: http::StatusCode) -> &'static str {
    if status.is_server_error() {
        "server_error"
    } else if status.is_client_error() {
        "client_error"
    } else {
        "ok"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_request_is_counted_by_outcome() {
        let (mock, mut handle) = tower_test::mock::pair::<Request<String>, Response<String>>();
        let mut service = TraceLayer.layer(mock);
        let respond = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.unwrap();
            assert_eq!(request.uri().path(), "/api/v1/namespaces/ns/secrets/gone");
            send.send_response(
                Response::builder()
                    .status(http::StatusCode::NOT_FOUND)
                    .body(String::new())
                    .unwrap(),
            );
        });
        let request = Request::get("/api/v1/namespaces/ns/secrets/gone?resourceVersion=0")
            .body(String::new())
            .unwrap();
        let response = tower::ServiceExt::oneshot(&mut service, request)
            .await
            .unwrap();
        assert_eq!(response.status(), http::StatusCode::NOT_FOUND);
        respond.await.unwrap();
        let text = crate::metrics::Metrics::new("test-controller")
            .encode()
            .unwrap();
        assert!(
            text.contains(
                r#"dbops_external_requests_total{target="kubernetes",outcome="client_error"}"#
            ),
            "{text}"
        );
        // Timed too (not a watch).
        assert!(
            text.contains(r#"dbops_external_request_duration_seconds_count{target="kubernetes"}"#),
            "{text}"
        );
        // And by verb and resource.
        assert!(
            text.contains(r#"dbops_kubernetes_requests_total{verb="get",resource="secrets"}"#),
            "{text}"
        );
    }

    /// A 429 (API Priority and Fairness, a storage that starts) waits its `Retry-After`
    /// and is sent again; a third refusal in a row is not the last word either, but a
    /// fourth is what the caller gets.
    #[tokio::test(start_paused = true)]
    async fn a_refused_request_is_sent_again_after_what_retry_after_says() {
        let (mock, mut handle) =
            tower_test::mock::pair::<Request<kube::client::Body>, Response<String>>();
        let mut service = tower::ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(refused_again()))
            .layer(tower::buffer::BufferLayer::new(8))
            .service(mock);
        let refuse = |after: &str| {
            Response::builder()
                .status(http::StatusCode::TOO_MANY_REQUESTS)
                .header("Retry-After", after)
                .body(String::new())
                .unwrap()
        };
        let started = tokio::time::Instant::now();
        let answers = tokio::spawn(async move {
            let mut at = Vec::new();
            for answer in [Some("2"), Some("1"), None] {
                let (request, send) = handle.next_request().await.unwrap();
                assert_eq!(request.method(), http::Method::POST);
                at.push(started.elapsed().as_secs());
                send.send_response(match answer {
                    Some(after) => refuse(after),
                    None => Response::new("created".to_string()),
                });
            }
            at
        });
        let request = Request::post("/api/v1/namespaces/ns/secrets")
            .body(kube::client::Body::from(b"{}".to_vec()))
            .unwrap();
        let response = tower::ServiceExt::oneshot(&mut service, request)
            .await
            .unwrap();
        assert_eq!(response.status(), http::StatusCode::OK);
        assert_eq!(answers.await.unwrap(), [0, 2, 3]);
    }

    #[test]
    fn verbs_by_method_and_path() {
        let secrets = "/api/v1/namespaces/ns/secrets";
        assert_eq!(verb_of(&http::Method::GET, secrets, true), "watch");
        assert_eq!(verb_of(&http::Method::GET, secrets, false), "list");
        assert_eq!(
            verb_of(&http::Method::GET, "/api/v1/namespaces/ns/secrets/a", false),
            "get"
        );
        assert_eq!(verb_of(&http::Method::POST, secrets, false), "create");
        assert_eq!(
            verb_of(
                &http::Method::PATCH,
                "/apis/dbops.dev/v1alpha1/namespaces/ns/databases/a/status",
                false
            ),
            "patch"
        );
        assert_eq!(
            verb_of(
                &http::Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/ns/leases/a",
                false
            ),
            "update"
        );
        assert_eq!(
            verb_of(
                &http::Method::DELETE,
                "/api/v1/namespaces/ns/secrets/a",
                false
            ),
            "delete"
        );
    }

    #[test]
    fn outcomes_by_status_class() {
        assert_eq!(outcome_of(http::StatusCode::OK), "ok");
        assert_eq!(outcome_of(http::StatusCode::NOT_FOUND), "client_error");
        assert_eq!(outcome_of(http::StatusCode::CONFLICT), "client_error");
        assert_eq!(
            outcome_of(http::StatusCode::SERVICE_UNAVAILABLE),
            "server_error"
        );
    }
}
