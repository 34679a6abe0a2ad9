//! The one bounded wait of a reconcile for something outside the cluster's watches (a
//! session gone, a subscription stopped, a slot applied, a permission granted): ask, and
//! if the answer is not there yet, ask again after `every`, never past `limit`.
//!
//! Waits for objects of the cluster are watches (kube-runtime's triggers), never a poll.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Asks `probe` until it gives `Some`, every `every`, for at most `limit` (the probe is
/// asked at least once, and once more at the limit): `Ok(None)` when the limit passed
/// first, the probe's error at once.
pub async fn until<T, E, F, Fut>(
    limit: Duration,
    every: Duration,
    mut probe: F,
) -> Result<Option<T>, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, E>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = probe().await? {
            return Ok(Some(found));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(every.min(deadline - now)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::until;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn it_answers_when_found_gives_up_at_the_limit_and_passes_errors_on() {
        let mut asked = 0;
        let found: Result<Option<u32>, ()> =
            until(Duration::from_secs(10), Duration::from_secs(1), || {
                asked += 1;
                let n = asked;
                async move { Ok((n == 3).then_some(n)) }
            })
            .await;
        assert_eq!(found, Ok(Some(3)));

        let started = tokio::time::Instant::now();
        let mut asked = 0;
        let never: Result<Option<()>, ()> =
            until(Duration::from_millis(2500), Duration::from_secs(1), || {
                asked += 1;
                async { Ok(None) }
            })
            .await;
        assert_eq!(never, Ok(None));
        assert_eq!(asked, 4, "at 0, 1, 2 and the limit");
        assert_eq!(started.elapsed(), Duration::from_millis(2500));

        let failed: Result<Option<()>, &str> =
            until(Duration::from_secs(10), Duration::from_secs(1), || async {
                Err("refused")
            })
            .await;
        assert_eq!(failed, Err("refused"));
    }
}
