//! The scheduler's reconcile of one Database: the steps of [`crate::schedule`].

use std::sync::Arc;
use std::time::Duration;

use dbops_api::{Backup, Database};
use dbops_shared::controller::{Context, ReconcileError};
use jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use crate::schedule::apply::{self, publish};
use crate::schedule::cron::{Schedule, parse_schedule};
use crate::schedule::error::{Error, STORE_SYNC, check_name};
use crate::schedule::plan::plan;
use crate::schedule::scheduled::scheduled_backups;
use crate::schedule::state::State;

/// The longest wait before a Database is looked at again, whatever its schedule: a
/// wall clock that was stepped is noticed within this time.
const MAX_WAIT: Duration = Duration::from_secs(3600);

pub async fn reconcile(db: Arc<Database>, ctx: Arc<Context<State>>) -> Result<Action, Error> {
    let namespace = db.namespace().unwrap_or_default();
    let forget = || {
        ctx.state
            .metrics
            .forget_schedule(&namespace, &db.name_any());
    };
    let Some(spec) = db.spec.backup.as_ref() else {
        forget();
        return Ok(Action::await_change());
    };
    if db.metadata.deletion_timestamp.is_some() {
        forget();
        // Nothing new starts and nothing is pruned: the scheduled Backups stay (or go
        // with it by their owner references, with `onDatabaseDeletion: Delete`).
        ctx.state.valid_again(&db.uid().unwrap_or_default());
        return Ok(Action::await_change());
    }
    let schedule = valid_schedule(&ctx, &db, &spec.schedule).await?;

    if !dbops_shared::store_ready::ready_within(&ctx.state.backups, STORE_SYNC).await {
        return Err(Error::StoreNotSynced);
    }
    let existing = scheduled_backups(&ctx.state.backups, &db);
    let now = Timestamp::now();
    let created = db.creation_timestamp().map_or(now, |t| t.0);
    let keep_last = spec
        .retention
        .as_ref()
        .map(|r| usize::try_from(r.keep_last).unwrap_or(1).max(1));
    let name = db.name_any();
    let plan = plan(&schedule, &name, created, now, &existing, keep_last);
    if let Some(interval) = schedule.interval_after(now) {
        let metrics = &ctx.state.metrics;
        metrics.set_schedule_interval(&namespace, &name, interval);
        if spec.verify {
            let max_age =
                i64::try_from(ctx.state.verification_max_age.as_secs()).unwrap_or(i64::MAX);
            metrics.expect_verification(&namespace, &name, max_age, created.as_second());
        } else {
            metrics.forget_verification(&namespace, &name);
        }
    }

    let api: Api<Backup> = Api::namespaced(ctx.client.clone(), &namespace);
    apply::apply(
        &ctx,
        &db,
        &api,
        &plan,
        &existing,
        keep_last.unwrap_or_default(),
    )
    .await?;
    Ok(match plan.next {
        Some(next) => Action::requeue(until(now, next)),
        None => Action::await_change(),
    })
}

/// The Database's schedule, parsed; a name too long for scheduled Backups or a schedule
/// that is not one is an invalid spec, with one Warning Event per generation.
async fn valid_schedule(
    ctx: &Context<State>,
    db: &Database,
    text: &str,
) -> Result<Schedule, Error> {
    let uid = db.uid().unwrap_or_default();
    let parsed = check_name(&db.name_any()).and_then(|()| {
        parse_schedule(text).map_err(|reason| Error::InvalidSchedule {
            schedule: text.to_string(),
            reason,
        })
    });
    match parsed {
        Ok(schedule) => {
            ctx.state.valid_again(&uid);
            Ok(schedule)
        }
        Err(error) => {
            if ctx.state.first_warning(&uid, db.metadata.generation) {
                publish(ctx, db, false, error.reason(), &error.to_string()).await;
            }
            Err(error)
        }
    }
}

/// How long from `now` until `next`, at most [`MAX_WAIT`].
fn until(now: Timestamp, next: Timestamp) -> Duration {
    Duration::try_from(next.duration_since(now))
        .unwrap_or(Duration::ZERO)
        .min(MAX_WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::at;

    #[test]
    fn the_requeue_waits_for_the_next_slot_and_at_most_an_hour() {
        assert_eq!(
            until(at("2026-11-22T16:03:40Z"), at("2026-11-22T16:04:00Z")),
            Duration::from_secs(20)
        );
        assert_eq!(
            until(at("2026-11-22T16:03:40Z"), at("2026-11-23T03:00:00Z")),
            MAX_WAIT
        );
        assert_eq!(
            until(at("2026-11-22T16:05:00Z"), at("2026-11-22T16:04:00Z")),
            Duration::ZERO
        );
    }
}
