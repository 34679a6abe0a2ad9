//! The client-side limit on requests to the Kubernetes API server (`--api-rate-limit`).
//!
//! [`RateLimiter`] is a token bucket: `rate` tokens per second, holding at most `2 * rate`
//! (the burst). [`RateLimitLayer`] puts it in front of the kube client's HTTP stack, so
//! every request of the process — reads, writes, watch (re)connects, lease renewals — takes
//! a token before it is sent. A long-running watch counts once, when it is opened.

use std::{
    future::Future,
    num::NonZeroU32,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use tokio::time::Instant;
use tower::{Layer, Service};

/// A token bucket shared by its clones.
#[derive(Clone, Debug)]
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    bucket: Arc<Mutex<Bucket>>,
}

#[derive(Debug)]
struct Bucket {
    /// May go negative: each waiter reserves its token and sleeps until it is paid back.
    tokens: f64,
    refilled_at: Instant,
}

impl RateLimiter {
    /// `per_second` requests per second, bursts up to twice that; starts full.
    pub fn new(per_second: NonZeroU32) -> Self {
        let per_second = f64::from(per_second.get());
        let burst = 2.0 * per_second;
        Self {
            per_second,
            burst,
            bucket: Arc::new(Mutex::new(Bucket {
                tokens: burst,
                refilled_at: Instant::now(),
            })),
        }
    }

    /// Takes one token and returns how long the caller must wait before using it.
    /// Tokens are handed out in call order.
    pub fn reserve(&self) -> Duration {
        let mut bucket = self.bucket.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let earned = now.duration_since(bucket.refilled_at).as_secs_f64() * self.per_second;
        bucket.tokens = (bucket.tokens + earned).min(self.burst);
        bucket.refilled_at = now;
        bucket.tokens -= 1.0;
        if bucket.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-bucket.tokens / self.per_second)
        }
    }

    /// Waits until a token is available and takes it.
    pub async fn acquire(&self) {
        let wait = self.reserve();
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Makes every request through the wrapped service wait for a [`RateLimiter`] token.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    limiter: RateLimiter,
}

impl RateLimitLayer {
    pub fn new(limiter: RateLimiter) -> Self {
        Self { limiter }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimited {
            inner,
            limiter: self.limiter.clone(),
            state: Permit::None,
        }
    }
}

/// A service that is ready only once it holds a token.
pub struct RateLimited<S> {
    inner: S,
    limiter: RateLimiter,
    state: Permit,
}

enum Permit {
    None,
    Waiting(Pin<Box<tokio::time::Sleep>>),
    Granted,
}

impl<S, Request> Service<Request> for RateLimited<S>
where
    S: Service<Request>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        loop {
            match &mut self.state {
                Permit::Granted => return self.inner.poll_ready(cx),
                Permit::None => {
                    let wait = self.limiter.reserve();
                    crate::metrics::observe_queue_wait(crate::metrics::Queue::ApiRateLimit, wait);
                    self.state = if wait.is_zero() {
                        Permit::Granted
                    } else {
                        Permit::Waiting(Box::pin(tokio::time::sleep(wait)))
                    };
                }
                Permit::Waiting(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.state = Permit::Granted;
                }
            }
        }
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // Spend the token; the next request needs a new one.
        self.state = Permit::None;
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn limiter(per_second: u32) -> RateLimiter {
        RateLimiter::new(NonZeroU32::new(per_second).unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_bucket_allows_a_burst_of_twice_the_rate() {
        let limiter = limiter(10);
        for _ in 0..20 {
            assert_eq!(limiter.reserve(), Duration::ZERO);
        }
        // The 21st request waits for one token: 1/10 s.
        assert_eq!(limiter.reserve(), Duration::from_millis(100));
        // The 22nd is queued behind it.
        assert_eq!(limiter.reserve(), Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_come_back_at_the_rate_up_to_the_burst() {
        let limiter = limiter(10);
        for _ in 0..20 {
            limiter.reserve();
        }
        tokio::time::advance(Duration::from_millis(500)).await;
        for _ in 0..5 {
            assert_eq!(limiter.reserve(), Duration::ZERO);
        }
        assert!(limiter.reserve() > Duration::ZERO);

        // A long idle time refills only up to the burst.
        tokio::time::advance(Duration::from_secs(3600)).await;
        for _ in 0..20 {
            assert_eq!(limiter.reserve(), Duration::ZERO);
        }
        assert!(limiter.reserve() > Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn acquire_sleeps_for_the_reserved_time() {
        let limiter = limiter(1);
        let start = Instant::now();
        for _ in 0..3 {
            limiter.acquire().await;
        }
        // Two from the burst, the third a second later.
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn the_layer_holds_requests_until_a_token_is_free() {
        let (service, mut handle) = tower_test::mock::pair::<&'static str, &'static str>();
        let mut service = RateLimitLayer::new(limiter(1)).layer(service);
        let start = Instant::now();

        for _ in 0..3 {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .unwrap();
            let response = service.call("request");
            let (request, respond) = handle.next_request().await.unwrap();
            assert_eq!(request, "request");
            respond.send_response("response");
            assert_eq!(response.await.unwrap(), "response");
        }
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        // The wait is in dbops_queue_wait_seconds (a process-wide family: other tests may
        // have added to it, never taken away).
        let text = crate::metrics::Metrics::new("test-controller")
            .encode()
            .unwrap();
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        assert!(
            value(r#"dbops_queue_wait_seconds_count{queue="api_rate_limit"}"#) >= 3.0,
            "{text}"
        );
        assert!(
            value(r#"dbops_queue_wait_seconds_sum{queue="api_rate_limit"}"#) >= 1.0,
            "{text}"
        );
    }
}
