//! Verify: the same tables, with the same row counts, on both servers (read only). In
//! Logical mode the rows may have been counted before the freeze
//! (`replication::baseline`): then only the changes since are added up here, and
//! anything that keeps them from adding up makes Verify count every table as before.

use dbops_api::{ChosenMode, Database, MigrationReason};
use dbops_shared::postgres::Session;

use crate::context::{Saga, StepOutcome};
use crate::error::{Error, Result};
use crate::replication::{baseline, sql as replication_sql};
use crate::servers::{migration_uid, session, source_server, target_server};
use crate::sql;

pub async fn verify(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let source = source_server(saga).await?;
    let target = target_server(saga).await?;
    let database = db.database_name();
    let s = session(saga, &source, &database).await?;
    let t = session(saga, &target, &database).await?;
    // The two servers answer at the same time: the source is frozen while this runs.
    let (on_source, on_target) = tokio::try_join!(sql::tables(&s), sql::tables(&t))?;
    if on_source != on_target {
        let missing: Vec<_> = on_source
            .iter()
            .filter(|x| !on_target.contains(x))
            .collect();
        let extra: Vec<_> = on_target
            .iter()
            .filter(|x| !on_source.contains(x))
            .collect();
        return Err(Error::step(
            MigrationReason::VerifyFailed,
            format!(
                "tables differ: missing on the target {missing:?}, only on the target {extra:?}"
            ),
        ));
    }
    let ((source_rows, target_rows), how) = rows(saga, &s, &t, &on_source).await?;
    drop((s, t));
    if saga.status().mode == Some(ChosenMode::Logical) {
        // Their work is done either way; Cleanup and the rollback drop them too.
        baseline::forget(saga, &database).await;
    }
    let mut rows = 0;
    let mut mismatches = Vec::new();
    for (((schema, table), a), b) in on_source.iter().zip(source_rows).zip(target_rows) {
        if a != b {
            mismatches.push(format!(
                "{schema}.{table}: {a} on the source, {b} on the target"
            ));
        }
        rows += a;
    }
    if !mismatches.is_empty() {
        return Err(Error::step(
            MigrationReason::VerifyFailed,
            format!("row counts differ ({how}): {}", mismatches.join("; ")),
        ));
    }
    Ok(StepOutcome::Done(format!(
        "{} tables, {rows} rows: the same on both servers ({how})",
        on_source.len()
    )))
}

/// The rows of `tables` on the source and the target, and how they were had: from the
/// baseline and the changes since when there is one for exactly these tables, else
/// counted.
async fn rows(
    saga: &Saga<'_>,
    s: &Session,
    t: &Session,
    tables: &[(String, String)],
) -> Result<((Vec<i64>, Vec<i64>), String)> {
    let uid = migration_uid(saga);
    let logical = saga.status().mode == Some(ChosenMode::Logical);
    let found = if logical {
        saga.ctx.state.baselines.take(&uid)
    } else {
        None
    };
    let why = match found {
        // Dump mode: the source has been frozen since before the copy.
        None if !logical => String::new(),
        None => ": no counts from before the freeze in this process".to_string(),
        Some(b) if b.tables != tables => ": the tables changed since the counts".to_string(),
        Some(b) => {
            let slot = baseline::slot(&replication_sql::name(&uid));
            match baseline::rows_now(s, t, &slot, &b).await? {
                Ok(rows) => {
                    return Ok((
                        rows,
                        format!(
                            "counted before the freeze at the source's {}, the changes since added up",
                            b.at
                        ),
                    ));
                }
                Err(why) => format!(": {why}"),
            }
        }
    };
    let counted = tokio::try_join!(count_all(s, tables), count_all(t, tables))?;
    Ok((counted, format!("counted in the freeze{why}")))
}

/// `count(*)` of each table, one after the other on the session, with row security off:
/// for an admin that is not a superuser, a tenant's policy raises an error rather than
/// running the tenant's function as the admin.
async fn count_all(
    s: &Session,
    tables: &[(String, String)],
) -> Result<Vec<i64>, dbops_shared::postgres::PgError> {
    s.batch_execute("SET row_security = off").await.map_err(
        dbops_shared::postgres::PgError::sql("turning row security off"),
    )?;
    let mut counts = Vec::with_capacity(tables.len());
    for (schema, table) in tables {
        counts.push(sql::count_rows(s, schema, table).await?);
    }
    Ok(counts)
}
