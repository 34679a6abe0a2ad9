//! The Backup's status writes, each guarded so that two replicas cannot both start or
//! end one attempt (see [`crate::runner`]), and the Events that go with them.

use std::time::Duration;

use dbops_api::{Backup, BackupRunner, BackupStatus};
use dbops_shared::conditions::now;
use dbops_shared::events::Recorder;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::error::Result;
use crate::runner;
use crate::status::{self, Standing};

/// How soon a reconcile whose guarded write met a newer version looks again (the watch
/// usually brings that version sooner).
pub const CHANGED_UNDER_US: Duration = Duration::from_secs(1);

/// What a status write may overwrite (see [`crate::runner`]).
#[derive(Debug, Clone, Copy)]
pub enum Guard<'a> {
    /// Only the Backup as it was read (its resourceVersion): a replica that decided on an
    /// older version writes nothing.
    AsRead,
    /// Only a status that still names `identity` the runner of attempt `attempt`, read
    /// afresh; the new status is derived from that one.
    Runner { identity: &'a str, attempt: i32 },
}

/// Writes the status for `standing` if it differs from the stored one, and returns it;
/// `None` when `guard` refused the write (another replica changed the Backup first).
/// An Event tells about attempts that start, fail or end.
pub async fn publish(
    backup: &Backup,
    recorder: &Recorder,
    api: &Api<Backup>,
    standing: &Standing<'_>,
    guard: Guard<'_>,
) -> Result<Option<BackupStatus>> {
    let new = match guard {
        Guard::AsRead => {
            let new = status::desired(backup, standing, now());
            if Some(&new) == backup.status.as_ref() {
                return Ok(Some(new));
            }
            if !write_if_unchanged(api, backup, &new).await? {
                return Ok(None);
            }
            new
        }
        Guard::Runner { identity, attempt } => {
            let written = write_as_runner(api, &backup.name_any(), identity, attempt, |fresh| {
                status::desired(fresh, standing, now())
            })
            .await?;
            match written {
                AsRunner::Changed(new) => new,
                AsRunner::Unchanged(new) => return Ok(Some(new)),
                AsRunner::Lost => return Ok(None),
            }
        }
    };
    if let Some((normal, reason, note)) = status::event(standing) {
        publish_event(recorder, backup, normal, reason, &note).await;
    }
    Ok(Some(new))
}

/// The runner's renewal of its hold on attempt `attempt`: `false` once the status names
/// another runner or attempt.
pub async fn renew(api: &Api<Backup>, name: &str, identity: &str, attempt: i32) -> Result<bool> {
    let written = write_as_runner(api, name, identity, attempt, |fresh| {
        let mut status = fresh.status.clone().unwrap_or_default();
        status.runner = Some(BackupRunner {
            identity: identity.to_string(),
            renew_time: now(),
        });
        status
    })
    .await?;
    Ok(!matches!(written, AsRunner::Lost))
}

/// What a write as the attempt's runner did.
enum AsRunner {
    Changed(BackupStatus),
    Unchanged(BackupStatus),
    /// The status names another runner or attempt (or kept changing): nothing written.
    Lost,
}

/// Writes `make(fresh)` while the freshly read status names `identity` the runner of
/// `attempt`; a conflict (a progress report of our own in between) reads again.
async fn write_as_runner(
    api: &Api<Backup>,
    name: &str,
    identity: &str,
    attempt: i32,
    make: impl Fn(&Backup) -> BackupStatus,
) -> Result<AsRunner> {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let fresh = api.get_status(name).await?;
        if !runner::holds(fresh.status.as_ref(), identity, attempt) {
            return Ok(AsRunner::Lost);
        }
        let new = make(&fresh);
        if Some(&new) == fresh.status.as_ref() {
            return Ok(AsRunner::Unchanged(new));
        }
        if write_if_unchanged(api, &fresh, &new).await? {
            return Ok(AsRunner::Changed(new));
        }
    }
    tracing::warn!(
        attempts = TRIES,
        "the Backup kept changing under its runner's status write; leaving it"
    );
    Ok(AsRunner::Lost)
}

/// Records that the current generation was seen, without changing anything else (for a
/// Backup that has ended).
pub async fn observe_generation(backup: &Backup, api: &Api<Backup>) -> Result<()> {
    let old = backup.status.clone().unwrap_or_default();
    let generation = backup.metadata.generation;
    let mut new = old.clone();
    new.observed_generation = generation;
    for c in &mut new.conditions {
        c.observed_generation = generation;
    }
    if new != old {
        write_if_unchanged(api, backup, &new).await?;
    }
    Ok(())
}

/// Only `status.progressBytes` of a running attempt, on the Backup `uid` only: a JSON
/// patch whose test makes the UID a precondition (a Backup deleted and created again under
/// that name while the dump runs is not written; a merge patch's `metadata.uid` is no
/// precondition on the status subresource).
pub async fn progress(api: &Api<Backup>, name: &str, uid: &str, bytes: u64) {
    let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
    let patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "add", "path": "/status/progressBytes", "value": bytes},
    ]));
    let written = match patch {
        Ok(patch) => {
            api.patch_status(name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
        }
        Err(e) => {
            tracing::debug!(error = %e, "could not build the progress patch");
            return;
        }
    };
    if let Err(e) = written {
        tracing::debug!(error = %e, "could not report progress");
    }
}

/// Writes `new` over the status of `read` unless the Backup changed since it was read
/// (the resourceVersion in a merge patch is a precondition): `false` on a conflict.
async fn write_if_unchanged(api: &Api<Backup>, read: &Backup, new: &BackupStatus) -> Result<bool> {
    let patch = json!({
        "metadata": {"resourceVersion": read.metadata.resource_version},
        "status": new,
    });
    match api
        .patch_status(
            &read.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Publishes an Event about the Backup; failures are logged, never fatal.
pub async fn publish_event(
    recorder: &Recorder,
    backup: &Backup,
    normal: bool,
    reason: &str,
    note: &str,
) {
    dbops_shared::events::publish(recorder, backup, normal, "Backup", reason, note).await;
}
