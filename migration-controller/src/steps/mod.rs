//! The saga's steps and their compensations, one small function each. Every step checks
//! what already exists before it acts, so running it again after a crash at any line
//! repeats no side effect; whatever a compensation must know is in the status, written
//! before the step acted.
//!
//! The steps both modes run, one file each, and the dispatch from a step to its function
//! and compensation. The Dump mode's own step, CopyData, is in `dump`; the Logical mode's
//! Replicate and CatchUp are in `replication` (the Logical mode shares the others,
//! FreezeSource sparing the subscription's WAL sender, Cleanup taking the replication
//! down once more):
//!
//! | step | does | compensation |
//! |---|---|---|
//! | Preflight | records the source (the Database's `spec.serverRef`); refuses a target DatabaseServer that does not exist, is being deleted, does not allow the namespace, is the source (by name or `host:port`) or would exceed its `databasesPerNamespace`; reads both servers: reachable, target major ≥ source, extensions available, no foreign role/database of those names on the target; chooses the mode once (`Auto`: Logical when the Logical Preflight of `logical` passes, else Dump with the reason in the ModeChosen condition and an Event; `Logical`: refused with that reason) | none (read only) |
//! | Snapshot | Backup `<migration>-snapshot`, owned by the Migration; waits for it | none: the Backup stays as the rollback point |
//! | FreezeSource | on a pooled source, has its pooler hold the database's new transactions (`crate::pooled`); records the connection limit and `default_transaction_read_only`, then sets them to 0 and on and ends every session | restores the recorded values; the pooler lets its clients go on |
//! | ProvisionTarget | role (a password nobody knows: the database-controller sets the connection Secret's when the Database arrives) and database on the target, marked with this Migration, and the source's extensions | drops the role and database if they carry this Migration's mark |
//! | CopyData | `pg_dump` of the frozen source piped into `pg_restore` on the target, in one transaction | none of its own: the data is in the target database |
//! | Verify | the same tables, with the same row counts, on both | none (read only) |
//! | SwitchTraffic | patches the Database's `spec.serverRef` to the target (field manager `dbops-migration-controller`), waits until it is Ready at the new generation; then, if the source's pooler held the database, until every pooler Pod routes it to the target, and resumes it | none: the point of no return |
//! | Cleanup | `sourceRetention: Drop` drops the source database and role (if marked by the Database) | none |
//!
//! Servers are DatabaseServers, resolved from the caches of `dbops_shared::server` at
//! each step (address, TLS and the admin credentials of the controllers' namespace): the
//! source as Preflight recorded it, the target from `spec.target.serverRef`.

mod preflight;
mod snapshot;
mod source;
mod switch;
mod target;
mod verify;

use dbops_api::{Database, MigrationStep};

use crate::context::{Saga, StepOutcome};
use crate::error::Result;
use crate::replication;
use crate::servers::names;

pub use source::cleanup;

/// Runs `step` (the saga records it Running before and its outcome after).
///
/// Each step's future is boxed: the reconcile's future then holds one pointer instead of
/// the largest step's state, and a debug build's poll frames stay within a Tokio worker's
/// 2 MiB stack even under a TLS handshake at the bottom of a step.
pub async fn run(saga: &mut Saga<'_>, step: MigrationStep, db: &Database) -> Result<StepOutcome> {
    match step {
        MigrationStep::Preflight => Box::pin(preflight::preflight(saga, db)).await,
        MigrationStep::Snapshot => Box::pin(snapshot::snapshot(saga, db)).await,
        MigrationStep::FreezeSource => Box::pin(source::freeze_source(saga, db)).await,
        MigrationStep::ProvisionTarget => Box::pin(target::provision_target(saga, db)).await,
        MigrationStep::CopyData => Box::pin(crate::dump::copy_data(saga, db)).await,
        MigrationStep::Replicate => Box::pin(replication::replicate(saga, db)).await,
        MigrationStep::CatchUp => Box::pin(replication::catch_up(saga, db)).await,
        MigrationStep::Verify => Box::pin(verify::verify(saga, db)).await,
        MigrationStep::SwitchTraffic => Box::pin(switch::switch_traffic(saga, db)).await,
        MigrationStep::Cleanup => Box::pin(source::cleanup(saga, Some(db)))
            .await
            .map(StepOutcome::Done),
    }
}

/// Undoes the step's effects (idempotent); returns what was done.
pub async fn compensate(
    saga: &mut Saga<'_>,
    step: MigrationStep,
    db: Option<&Database>,
) -> Result<String> {
    match step {
        MigrationStep::Preflight => Ok("nothing to undo: Preflight only reads".into()),
        MigrationStep::Snapshot => Ok(match saga.status().snapshot_ref {
            Some(r) => format!("snapshot Backup {} kept as the rollback point", r.name),
            None => "no snapshot was taken".into(),
        }),
        MigrationStep::FreezeSource => Box::pin(source::unfreeze_source(saga, db)).await,
        MigrationStep::ProvisionTarget => target::clean_target(saga, db).await,
        MigrationStep::CopyData => Ok(
            "nothing of its own to undo: the copy is in the target database, which the compensation of ProvisionTarget drops"
                .into(),
        ),
        MigrationStep::Replicate | MigrationStep::CatchUp => {
            let (database, _) = names(saga, db)?;
            let counts = replication::baseline::forget(saga, &database).await;
            let torn = replication::teardown(saga, &database).await?;
            Ok(counts.map_or(torn.clone(), |dropped| format!("{torn}, {dropped}")))
        }
        MigrationStep::Verify => Ok("nothing to undo: Verify only reads".into()),
        MigrationStep::SwitchTraffic | MigrationStep::Cleanup => {
            Ok("nothing to undo: the step never ran".into())
        }
    }
}
