//! CatchUp (after FreezeSource): waits until the target has applied everything up to the
//! frozen source's WAL position, copies the sequences' values, then takes the replication
//! down.

use std::time::{Duration, Instant};

use dbops_api::{Database, MigrationReason, MigrationStep};

use super::observe::{ends, observe, record, update};
use super::sql;
use super::teardown::teardown;
use crate::context::{Saga, StepOutcome};
use crate::error::{Error, Result};
use crate::servers::session;

/// How long CatchUp waits within one reconcile before it records its progress.
const CATCH_UP_INLINE: Duration = Duration::from_secs(30);
/// How long the source may stay frozen waiting for the catch-up before the Migration is
/// rolled back (and the source unfrozen).
const CATCH_UP_LIMIT: Duration = Duration::from_secs(600);

// ---- CatchUp --------------------------------------------------------------------------

pub async fn catch_up(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let e = ends(saga, &db.database_name()).await?;
    let replication = saga.status().replication.unwrap_or_default();
    let mut sequences = 0;
    if !replication.caught_up {
        let lsn = match replication.catch_up_lsn {
            Some(lsn) => lsn,
            None => {
                // The source is frozen (FreezeSource succeeded): every committed write
                // is before this position.
                let s = session(saga, &e.source, &e.database).await?;
                let lsn = sql::current_lsn(&s).await?;
                let recorded = lsn.clone();
                update(saga, |r| r.catch_up_lsn = Some(recorded)).await?;
                lsn
            }
        };
        let started = Instant::now();
        let seen = loop {
            let seen = observe(saga, &e, Some(&lsn)).await?;
            if seen.reached && seen.copied == seen.total {
                break seen;
            }
            if started.elapsed() >= CATCH_UP_INLINE {
                record(saga, &seen).await?;
                if frozen_for(saga) >= CATCH_UP_LIMIT {
                    return Err(Error::step(
                        MigrationReason::CatchUpTimedOut,
                        format!(
                            "the target did not apply the source's changes up to {lsn} within {} s of the freeze ({})",
                            CATCH_UP_LIMIT.as_secs(),
                            seen.describe()
                        ),
                    ));
                }
                return Ok(StepOutcome::Poll(
                    format!(
                        "waiting for the target to apply up to {lsn}: {}",
                        seen.describe()
                    ),
                    Duration::from_secs(1),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        record(saga, &seen).await?;
        let s = session(saga, &e.source, &e.database).await?;
        let values = sql::sequences(&s).await?;
        drop(s);
        let t = session(saga, &e.target, &e.database).await?;
        sequences = sql::set_sequences(&t, &values).await?;
        drop(t);
        update(saga, |r| r.caught_up = true).await?;
    }
    let lsn = saga
        .status()
        .replication
        .and_then(|r| r.catch_up_lsn)
        .unwrap_or_default();
    let down = teardown(saga, &e.database).await?;
    Ok(StepOutcome::Done(format!(
        "the target applied everything up to the source's {lsn}; {sequences} sequences copied; {down}"
    )))
}

/// How long the CatchUp step has been running (the source is frozen meanwhile).
fn frozen_for(saga: &Saga<'_>) -> Duration {
    let status = saga.status();
    crate::progress::step(&status, MigrationStep::CatchUp)
        .and_then(|s| s.started_at.clone())
        .map(|t| {
            let ms = jiff::Timestamp::now().as_millisecond() - t.0.as_millisecond();
            Duration::from_millis(u64::try_from(ms).unwrap_or_default())
        })
        .unwrap_or_default()
}
