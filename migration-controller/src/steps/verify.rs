//! Verify: the same tables, with the same row counts, on both servers (read only).

use dbops_api::{Database, MigrationReason};

use crate::context::{Saga, StepOutcome};
use crate::error::{Error, Result};
use crate::servers::{session, source_server, target_server};
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
        return Err(Error::permanent(
            MigrationReason::VerifyFailed,
            format!(
                "tables differ: missing on the target {missing:?}, only on the target {extra:?}"
            ),
        ));
    }
    let (source_rows, target_rows) =
        tokio::try_join!(count_all(&s, &on_source), count_all(&t, &on_source))?;
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
        return Err(Error::permanent(
            MigrationReason::VerifyFailed,
            format!("row counts differ: {}", mismatches.join("; ")),
        ));
    }
    Ok(StepOutcome::Done(format!(
        "{} tables, {rows} rows: the same on both servers",
        on_source.len()
    )))
}

/// `count(*)` of each table, one after the other on the session.
async fn count_all(
    s: &dbops_shared::postgres::Session,
    tables: &[(String, String)],
) -> Result<Vec<i64>, dbops_shared::postgres::PgError> {
    let mut counts = Vec::with_capacity(tables.len());
    for (schema, table) in tables {
        counts.push(sql::count_rows(s, schema, table).await?);
    }
    Ok(counts)
}
