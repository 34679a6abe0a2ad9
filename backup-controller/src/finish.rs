//! The end of an attempt (or of a Backup that cannot start): Completed, a retry after
//! the shared backoff curve until `maxRetries` retries are spent, or Failed.

use std::time::Instant;

use dbops_api::Backup;
use dbops_shared::backup_store::traced;
use dbops_shared::controller::Context;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use crate::dump::object_key;
use crate::error::{Failure, Result};
use crate::state::State;
use crate::status::{Completed, Standing};
use crate::write::{self, CHANGED_UNDER_US, Over};

/// How many attempts a Backup may make: the first and `maxRetries` retries.
pub fn allowed(backup: &Backup) -> i32 {
    backup.spec.max_retries.max(0).saturating_add(1)
}

/// Publishes the end of an attempt (or of a Backup that cannot start): Completed, a retry
/// after the backoff, or Failed, as `guard` allows. `latest` carries the status as last
/// written.
pub async fn finish(
    latest: &Backup,
    ctx: &Context<State>,
    api: &Api<Backup>,
    ended: std::result::Result<Completed, Failure>,
    over: Over<'_>,
) -> Result<Action> {
    let attempt = match over {
        Over::Runner { attempt, .. } => attempt,
        Over::Read => ctx.state.statuses.latest(latest).attempts.unwrap_or(0),
    };
    let end = End {
        latest,
        ctx,
        api,
        over,
        attempt,
    };
    let written = match ended {
        Ok(done) => end.completed(&done).await?,
        Err(failure) if failure.is_permanent() || attempt >= allowed(latest) => {
            end.failed(&failure).await?
        }
        Err(failure) => end.retrying(&failure).await?,
    };
    Ok(written.unwrap_or_else(|| {
        tracing::info!(
            attempt,
            "the Backup changed under this outcome (another replica); leaving it to that"
        );
        Action::requeue(CHANGED_UNDER_US)
    }))
}

/// The end of attempt `attempt` of `latest`, to be written as `over` allows.
struct End<'a> {
    latest: &'a Backup,
    ctx: &'a Context<State>,
    api: &'a Api<Backup>,
    over: Over<'a>,
    attempt: i32,
}

impl End<'_> {
    /// Writes `standing`; `false` when the guard refused it.
    async fn publish(&self, standing: &Standing<'_>) -> Result<bool> {
        let state = &self.ctx.state;
        let published = write::publish(self.latest, state, self.api, standing, self.over).await?;
        Ok(!published.refused())
    }

    /// The next attempt is not started before `retry_at` (none: as soon as asked).
    fn retry_at(&self, retry_at: Option<Instant>) {
        let uid = self.latest.uid().unwrap_or_default();
        let retries = &self.ctx.state.retries;
        match retry_at {
            Some(at) => retries.retry_at(&uid, at),
            None => retries.forget(&uid),
        }
    }

    /// Completed; `None` when the guard refused the write.
    async fn completed(&self, done: &Completed) -> Result<Option<Action>> {
        if !self.publish(&Standing::Completed(done)).await? {
            return Ok(None);
        }
        // Partial files of interrupted attempts of this key.
        discard_partial(self.latest, self.ctx).await;
        record_completed(self.latest, self.ctx, done);
        self.retry_at(None);
        Ok(Some(Action::await_change()))
    }

    /// Failed, with no further attempt; `None` when the guard refused the write.
    async fn failed(&self, failure: &Failure) -> Result<Option<Action>> {
        tracing::warn!(
            reason = %failure.reason,
            "Backup failed: {}",
            failure.message
        );
        if !self.publish(&Standing::Failed(failure)).await? {
            return Ok(None);
        }
        discard_partial(self.latest, self.ctx).await;
        self.retry_at(None);
        Ok(Some(Action::await_change()))
    }

    /// Pending again, the next attempt after the backoff; `None` when the guard refused
    /// the write.
    async fn retrying(&self, failure: &Failure) -> Result<Option<Action>> {
        let attempt = self.attempt;
        let retry_in = self
            .ctx
            .state
            .backoff
            .jittered_delay(u32::try_from(attempt - 1).unwrap_or(0));
        tracing::info!(
            reason = %failure.reason,
            attempt,
            ?retry_in,
            "attempt failed; retrying: {}",
            failure.message
        );
        let retrying = Standing::Retrying {
            failure,
            attempt,
            of: allowed(self.latest),
            retry_in,
        };
        if !self.publish(&retrying).await? {
            return Ok(None);
        }
        self.retry_at(Some(Instant::now() + retry_in));
        Ok(Some(Action::requeue(retry_in)))
    }
}

/// The metrics of a completed Backup: its size, how long it took, when it ended.
fn record_completed(backup: &Backup, ctx: &Context<State>, done: &Completed) {
    let metrics = &ctx.state.metrics;
    let started = backup.status.as_ref().and_then(|s| s.started_at.as_ref());
    let seconds = started.map_or(0.0, |s| {
        done.completed_at
            .0
            .duration_since(s.0)
            .as_secs_f64()
            .max(0.0)
    });
    metrics.record_completed(
        &backup.namespace().unwrap_or_default(),
        &backup.spec.database_ref.name,
        u64::try_from(done.size_bytes).unwrap_or(0),
        seconds,
        done.completed_at.0.as_second(),
    );
}

async fn discard_partial(backup: &Backup, ctx: &Context<State>) {
    let (store, key) = (&ctx.state.store, object_key(backup));
    let discarded = traced(
        "discard_partial",
        store.location(&key),
        store.discard_partial(&key),
    );
    if let Err(e) = discarded.await {
        tracing::warn!(error = %e, "could not remove a partial artifact");
    }
}
