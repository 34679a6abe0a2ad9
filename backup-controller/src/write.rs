//! The Backup's status writes, all through the shared status path
//! ([`dbops_shared::status`]): a pure [`status::desired`], then one JSON patch guarded by
//! the uid and the resourceVersion the decision was made on ([`Guard::ResourceVersion`]:
//! a Backup's attempts are a state machine), the Events only once written.
//!
//! Each write is decided on [`StatusWriter::latest`](dbops_shared::status::StatusWriter::latest): the status this process wrote last
//! until the watch cache shows it (the shared answer to a cache older than our own
//! write), else the cached one. With two replicas that answer alone would not do (the
//! other replica writes too), so every write also holds the guarantees of
//! [`crate::runner`]:
//! - [`Over::Read`]: over the version decided on, or nothing (of two replicas that saw a
//!   Backup Pending, one claims the attempt and the other gets [`Published::Refused`]);
//! - [`Over::Runner`]: the status is read afresh (a GET) and written only while it names
//!   this replica the runner of that attempt; a conflict (a progress report or renewal
//!   of our own in between) reads again, up to five times;
//! - progress: over the version this process wrote last, or not at all.

use std::time::Duration;

use dbops_api::{Backup, BackupRunner, BackupStatus};
use dbops_shared::conditions::now;
use dbops_shared::status::{Desired, Guard, Note, Write};
use kube::ResourceExt;
use kube::api::Api;

use crate::error::Result;
use crate::runner;
use crate::state::State;
use crate::status::{self, Standing};

/// How soon a reconcile whose guarded write met a newer version looks again (the watch
/// usually brings that version sooner).
pub const CHANGED_UNDER_US: Duration = Duration::from_secs(1);

/// What a status write may overwrite (see [`crate::runner`]).
#[derive(Debug, Clone, Copy)]
pub enum Over<'a> {
    /// Only the version the reconcile decided on: a replica that decided on an older
    /// version writes nothing.
    Read,
    /// Only a status that still names `identity` the runner of attempt `attempt`, read
    /// afresh; the new status is derived from that one.
    Runner { identity: &'a str, attempt: i32 },
}

/// What a status write did.
#[derive(Debug)]
pub enum Published {
    /// The status was the desired one already: nothing written.
    Unchanged,
    /// Written; the Backup as the API server returned it.
    Stored(Box<Backup>),
    /// The guard refused it: another replica (or a person) changed the Backup first, it
    /// names another runner, or it is gone.
    Refused,
}

impl Published {
    pub fn refused(&self) -> bool {
        matches!(self, Published::Refused)
    }
}

impl From<Write<Backup>> for Published {
    fn from(write: Write<Backup>) -> Self {
        match write {
            Write::Unchanged => Published::Unchanged,
            Write::Written(backup) => Published::Stored(backup),
            Write::Conflict | Write::Gone => Published::Refused,
        }
    }
}

/// Writes the status for `standing` as `over` allows, with the Event that tells about
/// attempts that start, fail or end.
pub async fn publish(
    backup: &Backup,
    state: &State,
    api: &Api<Backup>,
    standing: &Standing<'_>,
    over: Over<'_>,
) -> Result<Published> {
    match over {
        Over::Read => {
            let current = state.statuses.latest(backup);
            let desired = status::desired(backup, &current, standing, now());
            Ok(write(state, api, backup, desired).await?.into())
        }
        Over::Runner { identity, attempt } => {
            as_runner(
                state,
                api,
                &backup.name_any(),
                identity,
                attempt,
                |fresh, current| status::desired(fresh, current, standing, now()),
            )
            .await
        }
    }
}

/// The runner's renewal of its hold on attempt `attempt`: `false` once the status names
/// another runner or attempt.
pub async fn renew(
    state: &State,
    api: &Api<Backup>,
    name: &str,
    identity: &str,
    attempt: i32,
) -> Result<bool> {
    let renewed = as_runner(state, api, name, identity, attempt, |_, current| {
        let mut status = current.clone();
        status.runner = Some(BackupRunner {
            identity: identity.to_string(),
            renew_time: now(),
        });
        Desired::new(status)
    })
    .await?;
    Ok(!renewed.refused())
}

/// Writes `make(fresh, latest)` while the freshly read status names `identity` the runner
/// of `attempt`; a conflict (a progress report of our own in between) reads again.
async fn as_runner(
    state: &State,
    api: &Api<Backup>,
    name: &str,
    identity: &str,
    attempt: i32,
    make: impl Fn(&Backup, &BackupStatus) -> Desired<BackupStatus>,
) -> Result<Published> {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let fresh = api.get_status(name).await?;
        if !runner::holds(fresh.status.as_ref(), identity, attempt) {
            return Ok(Published::Refused);
        }
        let current = state.statuses.latest(&fresh);
        match write(state, api, &fresh, make(&fresh, &current)).await? {
            Write::Conflict => {}
            written => return Ok(written.into()),
        }
    }
    tracing::warn!(
        attempts = TRIES,
        "the Backup kept changing under its runner's status write; leaving it"
    );
    Ok(Published::Refused)
}

/// Claims the verification of `backup` for this replica: `status.verification` Running,
/// written over the version read (of two replicas, one claims it).
pub async fn claim_verification(
    backup: &Backup,
    state: &State,
    api: &Api<Backup>,
) -> Result<Published> {
    let current = state.statuses.latest(backup);
    let server = state.verification.server.as_deref();
    let desired = status::verifying(backup, &current, &state.identity, server, now());
    Ok(write(state, api, backup, desired).await?.into())
}

/// Records the outcome of the verification this replica claimed at `started_at`: read
/// afresh, and written only while the status still names this replica its runner (a
/// replica that took it over after `--verify-timeout` writes its own).
pub async fn record_verification(
    state: &State,
    api: &Api<Backup>,
    name: &str,
    started_at: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    outcome: &status::Outcome,
) -> Result<Published> {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let fresh = api.get_status(name).await?;
        let current = state.statuses.latest(&fresh);
        // The same claim: this replica's, started at the same second (the API server
        // keeps Times to the second; the memo of our own write has them finer).
        let second = |t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
            t.map(|t| t.0.as_second())
        };
        let ours = current.verification.as_ref().is_some_and(|v| {
            v.runner.as_deref() == Some(state.identity.as_str())
                && second(v.started_at.as_ref()) == second(started_at)
        });
        if !ours {
            return Ok(Published::Refused);
        }
        let desired = status::verified(&fresh, &current, outcome, now());
        match write(state, api, &fresh, desired).await? {
            Write::Conflict => {}
            written => return Ok(written.into()),
        }
    }
    Ok(Published::Refused)
}

/// Records that the current generation was seen, without changing anything else (for a
/// Backup that has ended); a Backup that changed meanwhile is left to the next reconcile.
pub async fn observe_generation(backup: &Backup, state: &State, api: &Api<Backup>) -> Result<()> {
    let mut new = state.statuses.latest(backup);
    let generation = backup.metadata.generation;
    new.observed_generation = generation;
    for c in &mut new.conditions {
        c.observed_generation = generation;
    }
    write(state, api, backup, Desired::new(new)).await?;
    Ok(())
}

/// `status.progressBytes` of a running attempt, written over the version this process
/// wrote last about `runner` (the Backup as its attempt's claim returned it) and only
/// then: a Backup changed by anyone else since, or deleted and created again under its
/// name, is not written (the next renewal reads it again).
pub async fn progress(state: &State, api: &Api<Backup>, runner: &Backup, bytes: u64) {
    let mut new = state.statuses.latest(runner);
    new.progress_bytes = Some(i64::try_from(bytes).unwrap_or(i64::MAX));
    match write(state, api, runner, Desired::new(new)).await {
        Ok(Write::Unchanged | Write::Written(_)) => {}
        Ok(Write::Conflict | Write::Gone) => {
            tracing::debug!("progress not reported: the Backup changed since our last write");
        }
        Err(e) => tracing::debug!(error = %e, "could not report progress"),
    }
}

/// The one write: over the version `read` was decided on (uid and resourceVersion).
async fn write(
    state: &State,
    api: &Api<Backup>,
    read: &Backup,
    desired: Desired<BackupStatus>,
) -> kube::Result<Write<Backup>> {
    let recorder = &state.recorder;
    let guard = Guard::ResourceVersion;
    state
        .statuses
        .write(api, read, desired, guard, recorder, Some(&state.cache))
        .await
}

/// Publishes an Event about the Backup that no status write carries (the artifact's
/// removal on deletion); failures are logged, never fatal.
pub async fn publish_event(state: &State, backup: &Backup, reason: &str, note: &str) {
    let note = Note::normal(status::ACTION, reason, note);
    dbops_shared::status::announce(&state.recorder, backup, &note).await;
}
