//! The subscription paused for Verify's counts (`baseline`) and resumed. The pause is
//! marked (a comment, in the DISABLE's transaction; cleared in the ENABLE's), so that a
//! controller that dies in between leaves a subscription [`resume_paused`] tells from one
//! an apply error disabled (which fails the Migration: `observe`).

use dbops_shared::postgres::{PgError, Session, quote_ident, quote_literal};

use crate::error::Result;

/// The comment on a subscription paused for the counts.
const PAUSED: &str = "dbops.dev/paused-for-verify";

/// Disables the subscription `name` (of the session's database), marked as paused.
pub async fn pause(t: &Session, name: &str) -> std::result::Result<(), PgError> {
    let n = quote_ident(name);
    t.batch_execute(&format!(
        "BEGIN; ALTER SUBSCRIPTION {n} DISABLE; COMMENT ON SUBSCRIPTION {n} IS {}; COMMIT",
        quote_literal(PAUSED)
    ))
    .await
    .map_err(PgError::sql("pausing the subscription"))
}

/// Enables the subscription `name` and clears the mark.
pub async fn resume(t: &Session, name: &str) -> std::result::Result<(), PgError> {
    let n = quote_ident(name);
    t.batch_execute(&format!(
        "BEGIN; ALTER SUBSCRIPTION {n} ENABLE; COMMENT ON SUBSCRIPTION {n} IS NULL; COMMIT"
    ))
    .await
    .map_err(PgError::sql("enabling the subscription"))
}

/// Enables the subscription `name` (of the session's database) if the counts paused it
/// and a crash kept them from enabling it again; whether it did.
pub async fn resume_paused(t: &Session, name: &str) -> Result<bool> {
    let paused = t
        .query_opt(
            "SELECT 1 FROM pg_subscription \
             WHERE subname = $1 AND NOT subenabled \
               AND obj_description(oid, 'pg_subscription') = $2",
            &[&name, &PAUSED],
        )
        .await
        .map_err(PgError::sql("reading pg_subscription"))?
        .is_some();
    if paused {
        resume(t, name).await?;
    }
    Ok(paused)
}
