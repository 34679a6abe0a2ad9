//! Scheduled Backups: the second controller of the backup-controller process (metrics
//! label and Event reporter `backup-scheduler`), reconciling Databases that have
//! `spec.backup`. Its reconcile, as a pipeline of named steps:
//!
//! 1. nothing for a Database without `spec.backup` or being deleted;
//! 2. `parse_schedule` (pure): a schedule that is not a cron expression is an invalid
//!    spec: one Warning Event per generation, then wait for a change;
//! 3. `scheduled_backups`: this Database's scheduled Backups, read from a reflector store
//!    (label `dbops.dev/schedule-of=<database>` and this Database's UID in the annotation
//!    `dbops.dev/database-uid`), never from the API;
//! 4. `plan` (pure): the slot to take, the slots skipped, the Backups retention prunes,
//!    the next slot;
//! 5. apply: create the slot's Backup (AlreadyExists is success), delete the pruned ones,
//!    and give the existing ones an owner reference to the Database exactly when
//!    `onDatabaseDeletion` is Delete; an Event for each create and delete;
//! 6. requeue at the next slot.
//!
//! The slot is the latest scheduled time (UTC) at or before now that is not before the
//! Database's creation. Its Backup is `<database>-<YYYYMMDDHHMM>`: two replicas, or a
//! crash right after the create, compute the same name and the API server refuses the
//! second create, so one slot never gets two Backups. Slots missed while no controller
//! ran are not taken, only the latest (one catch-up Backup), and an Event counts them. A
//! slot is only taken when it is newer than every scheduled Backup of the Database
//! (a pruned slot is never taken again, a replica whose clock lags creates nothing) and
//! while none is still unfinished (a Database that cannot be dumped gets one waiting
//! Backup, not one per slot).
//!
//! Retention (`keepLast: N`): the N newest Completed scheduled Backups stay; older
//! Completed ones are deleted, and so are Failed ones older than the newest Completed
//! one; Pending and Running ones never are. Without `retention` nothing is pruned.
//! Deleting a Backup runs its own finalizer: scheduled Backups are created with
//! `deletionPolicy: Delete`, so their artifacts leave the store with them.
//!
//! Scheduled Backups outlive their Database: they are not owned by it unless
//! `spec.backup.onDatabaseDeletion` is Delete (then garbage collection deletes them, and
//! their artifacts, with the Database). Retention prunes only while the Database exists
//! and is not being deleted; a Database created again under the same name has a new UID
//! and never prunes the Backups of the earlier one.
//!
//! A converged Database costs no API request: a reconcile reads only the stores.
//!
//! The labels and annotations of scheduled Backups are [`dbops_api::names`]'s. The files,
//! each depending only on those above it: `cron` (parsing a schedule, its slots), `scheduled` (a
//! scheduled Backup as the plan sees it), `retention`, `plan` (pure: what one reconcile
//! does), `desired` (the Backup to create), `error` and `state`, `apply` (the API writes
//! and Events of a plan), `reconcile`, `watch`.

/// Metrics label and Event reporter (`dbops-backup-scheduler`) of this controller.
pub const CONTROLLER: &str = "backup-scheduler";

mod apply;
mod cron;
mod desired;
mod error;
mod plan;
mod reconcile;
mod retention;
mod scheduled;
mod state;
#[cfg(test)]
mod testing;
mod watch;

pub use reconcile::reconcile;
pub use state::State;
pub use watch::watches;
