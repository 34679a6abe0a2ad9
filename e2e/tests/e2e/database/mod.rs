//! The database-controller against a real control plane and real PostgreSQL servers: a
//! Database becomes a role, a database and a connection Secret applications can use;
//! deletion policies, crashes, outages, drift, conflicts and bad admin input.
//!
//! Each test has its own namespace, PostgreSQL server and controller process (watching
//! only that namespace, resync 3 s, backoff 1 s..5 s), run with a token of its own
//! ServiceAccount `dbops-system/dbops-database-controller` (the RBAC of `deploy/`), which
//! names it in the apiserver's audit log. No test prints a password:
//! Secrets are compared, never shown, and printed logs are redacted.

mod clone;
mod conflicts;
mod deletion;
mod drift;
mod expiry;
mod faults;
mod provisioning;
mod servers;
