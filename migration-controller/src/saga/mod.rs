//! The Migration reconcile: the saga, as a state machine over `status`.
//!
//! - `crate::progress` (below `steps/` and `replication/`, which record through it too):
//!   the status as pure functions (which step is next; a step starting, succeeding,
//!   failing; the rollback and the end);
//! - [`next_move`]: what the driver does next, decided purely from the Migration, its
//!   status and its Database;
//! - [`drive`]: the reconcile, which executes the moves (status writes, Events, the
//!   steps of `steps`, `dump` and `replication`);
//! - [`rollback`]: the compensations in reverse order.
//!
//! Each reconcile reads the Migration fresh from the API (a status write carries the
//! resourceVersion it was computed from, so a stale view or a second replica gets a 409
//! instead of overwriting progress), then:
//!
//! 1. a finished Migration (Succeeded, Failed, RolledBack) only loses its finalizer;
//! 2. one not started yet is refused if another Migration of its Database is active;
//! 3. the finalizer `dbops.dev/migration-rollback` goes on before the first step, so a
//!    Migration deleted mid-flight is rolled back first (or, once SwitchTraffic has begun,
//!    finished first);
//! 4. then step after step: the step's record is written `Running` before its side
//!    effects and `Succeeded` after them; a step that must wait (the snapshot Backup, the
//!    Database Ready on the target) returns and its watch brings the reconcile back;
//! 5. a step that cannot succeed, or fails `--step-max-attempts` times, before
//!    SwitchTraffic starts the rollback: compensations in reverse order, each recorded as
//!    it completes, ending `RolledBack`. From SwitchTraffic on there is no way back:
//!    failures are retried with backoff.
//!
//! The step list is the mode's (`crate::progress::saga_steps`): Dump's until Preflight records
//! the mode. A Manual cutover waits before SwitchTraffic in Dump mode and before
//! FreezeSource in Logical mode, where each reconcile (every resync interval) checks the
//! replication meanwhile and rolls back from Replicate when it fails.

pub mod drive;
pub mod next_move;
pub mod rollback;

pub use drive::reconcile;
