//! The migration-controller against a real control plane, two real PostgreSQL servers
//! (source and target) and the other two controllers as processes: the saga moves a
//! Database with pgbench data while a writer keeps inserting, without losing a write the
//! writer saw committed; failures at Preflight, Snapshot and after the freeze roll back;
//! a controller killed at every step resumes to Succeeded without repeating DDL; Manual
//! cutover waits for approval; a second Migration of the same Database is refused, and
//! deleting an active Migration rolls it back.
//!
//! Each test has its own namespace, two servers, a backup store and the three controllers
//! (watching only that namespace, resync 5 s, backoff 1 s..5 s). No test prints a
//! password: logs are redacted before they are shown.

mod deletion;
mod moves;
mod preflight;
mod rollback;
