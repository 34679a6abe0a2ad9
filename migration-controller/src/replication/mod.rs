//! The Logical mode's own steps and their compensation (SQL in [`sql`]); its other steps
//! are the ones both modes run (`steps`), and whether a source can replicate at all is
//! the Logical Preflight (`logical`):
//!
//! | step | does | compensation |
//! |---|---|---|
//! | Replicate | the schema (`pg_dump --schema-only` into the target database, in one transaction); a publication of the database's tables, a replication role (LOGIN REPLICATION, a random password, read access) on the source; a subscription on the target whose slot has the Migration's name; waits for the initial copy of every table and a lag under [`replicate::LAG_BOUND`] | [`teardown`] |
//! | CatchUp | after FreezeSource: records the source's WAL position, waits until the target has confirmed it, copies the sequences' values, then [`teardown`] | [`teardown`] |
//!
//! [`teardown`] drops the subscription (disabled and detached from its slot first, so it
//! never waits for the source), then on the source the slot (and the subscription's
//! table-synchronization slots), the publication and the role: every one found by the
//! name derived from the Migration's UID, so it runs the same after a crash at any line.
//! The source's part runs even when the target cannot be reached: a slot is never left
//! holding the source's WAL.
//!
//! While it replicates (and while a Manual cutover waits), every check fails the
//! Migration with a clear reason rather than letting the copies diverge: an apply or
//! table-synchronization error on the target (`ReplicationApplyFailed`, PostgreSQL 15+
//! counts them; the subscription is disabled on error), the subscription or the slot
//! gone, the slot's WAL lost, and a schema change on the source (`SchemaChanged`: the
//! tables published, or any table's columns, differ between the servers).

pub mod baseline;
mod catch_up;
mod observe;
mod pause;
mod replicate;
pub mod sql;
mod teardown;

pub use catch_up::catch_up;
pub use observe::watch_replication;
pub use replicate::replicate;
pub use teardown::teardown;
