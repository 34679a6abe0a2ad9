//! The backup-controller against a real control plane, real PostgreSQL and a real
//! `file://` store: pg_dump of pgbench data into one checksummed artifact per Backup,
//! whatever crashes or retries happen; retries then Failed when the store cannot be
//! written; deletion policies; a missing Database; and the database-controller's
//! `deletionPolicy: Snapshot` completed by a real final Backup.
//!
//! Each test has its own namespace, PostgreSQL server, store directory and both
//! controllers (watching only that namespace, resync 5 s, backoff 1 s..5 s). No test
//! prints a password: logs are redacted before they are shown.

mod deletion;
mod dump;
mod encrypted;
mod restore;
mod s3;
mod verified;
mod waits;
