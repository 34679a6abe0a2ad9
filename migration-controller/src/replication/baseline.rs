//! Verify's row counts taken before the freeze (Logical mode), so that the freeze does
//! not grow with the data. Right before FreezeSource freezes the source, [`take`]:
//!
//! 1. on the source, creates the logical slot `<name>_verify` (`test_decoding`), then lists
//!    and counts every table in one snapshot (the source stays writable);
//! 2. on the target, creates a slot of that name too, waits until the subscription has
//!    confirmed a position past the source slot's start, disables it, and once its apply worker is
//!    gone takes a snapshot and reads how far it applied (`L`, the source's commit
//!    position); the subscription is enabled again at once, and the target's tables are
//!    listed and counted in that snapshot while it replicates;
//! 3. brings the source's counts to `L` with the transactions its slot decoded
//!    (`counts::at`) and compares them with the target's: equal, they are the baseline.
//!
//! Verify, in the freeze after CatchUp, then adds to the baseline the transactions each
//! slot decoded since (`counts::after` on the source, `counts::now` on the target): work
//! that follows the writes since the baseline, not the size. Anything that makes the
//! changes not add up (a TRUNCATE, a change to a table not counted, an unlogged table, a
//! slot that cannot be created, a wait that runs out, a difference at `L`) leaves no
//! baseline, and Verify counts every table in the freeze as before: the check is the same
//! either way. The baseline lives in this process only (a restarted or new leader counts
//! in the freeze); the slots are dropped by Verify, by the compensation of Replicate and
//! CatchUp, and by Cleanup ([`forget`]), and a new [`take`] drops any left over first.

use std::time::{Duration, Instant};

use dbops_shared::postgres::{PgError, Session, ddl, quote_ident};
use tokio_postgres::{GenericClient, IsolationLevel};

use dbops_api::MigrationStep;

use super::observe::{Ends, ends};
use super::sql;
use crate::context::Saga;
use crate::counts::{self, Baseline, Change, Lsn, Snapshot, Txn};
use crate::debug::Moment;
use crate::error::Result;
use crate::servers::{at, migration_uid, session};

/// How long the subscription may take to confirm a position past the source slot's start.
const APPLIED_WAIT: Duration = Duration::from_secs(30);
/// How long the apply worker may take to stop once its subscription is disabled.
const STOP_WAIT: Duration = Duration::from_secs(10);
/// How long creating a slot may wait for the transactions running on a server.
const SLOT_TIMEOUT: &str = "10s";
/// How long locking the tables to count may wait for a tenant's DDL.
const LOCK_TIMEOUT: &str = "5s";

/// Tables (schema, name), as `test_decoding` names them, and their OIDs.
type Listed = (Vec<(String, String)>, Vec<String>, Vec<i64>);

/// The slot of the Migration's counts, on both servers.
pub fn slot(name: &str) -> String {
    format!("{name}_verify")
}

/// Takes the baseline (see the module) and keeps it for Verify; `Err` says why there is
/// none (Verify then counts in the freeze). Never leaves the subscription disabled.
pub async fn take(saga: &Saga<'_>, database: &str) -> std::result::Result<String, String> {
    let uid = migration_uid(saga);
    let started = Instant::now();
    let outcome = async {
        let e = ends(saga, database).await?;
        drop_slots(saga, &e).await?;
        measure(saga, &e).await
    }
    .await;
    match outcome {
        Ok(Ok(b)) => {
            let said = format!(
                "{} tables, {} rows: the same on both servers at the source's {} (counted before the freeze in {:.1} s)",
                b.tables.len(),
                b.rows.iter().sum::<i64>(),
                b.at,
                started.elapsed().as_secs_f64()
            );
            saga.ctx.state.baselines.put(&uid, b);
            Ok(said)
        }
        Ok(Err(why)) => {
            forget(saga, database).await;
            Err(why)
        }
        Err(e) => {
            forget(saga, database).await;
            Err(e.to_string())
        }
    }
}

/// Drops the Migration's baseline and its slots, best effort (a slot left behind is
/// dropped by the next [`take`] or [`forget`]); says what it dropped.
pub async fn forget(saga: &Saga<'_>, database: &str) -> Option<String> {
    saga.ctx.state.baselines.take(&migration_uid(saga));
    let e = ends(saga, database).await.ok()?;
    match drop_slots(saga, &e).await {
        Ok(dropped) if !dropped.is_empty() => Some(dropped.join(", ")),
        Ok(_) => None,
        Err(err) => {
            tracing::warn!(error = %err, "dropping the slots of Verify's counts");
            None
        }
    }
}

async fn drop_slots(saga: &Saga<'_>, e: &Ends) -> Result<Vec<String>> {
    let slot = slot(&e.name);
    let mut dropped = Vec::new();
    for server in [&e.source, &e.target] {
        let s = session(saga, server, "postgres").await?;
        let there = s
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(PgError::sql("reading pg_replication_slots"))?
            .is_some();
        if there {
            super::teardown::drop_slot(&s, &slot).await?;
            dropped.push(format!("slot {slot} dropped on {}", at(server)));
        }
    }
    Ok(dropped)
}

/// Why the counts cannot be taken before the freeze (Verify then counts in it).
type Why<T> = std::result::Result<T, String>;

/// The tables of one server listed and counted in one snapshot.
struct Count {
    tables: Vec<(String, String)>,
    names: Vec<String>,
    snapshot: Snapshot,
    rows: Vec<i64>,
}

/// Steps 1-3 of the module; the outer error is a server's, the inner says why the counts
/// do not add up.
async fn measure(saga: &Saga<'_>, e: &Ends) -> Result<Why<Baseline>> {
    let slot = slot(&e.name);
    let mut s = session(saga, &e.source, &e.database).await?;
    let start = match create_slot(&mut s, &slot).await? {
        Ok(l) => l,
        Err(why) => return Ok(Err(why)),
    };
    let source = match counted(&mut s).await? {
        Ok(c) => c,
        Err(why) => return Ok(Err(why)),
    };
    let mut t = session(saga, &e.target, &e.database).await?;
    // A pause a crashed controller left in place ends first.
    super::pause::resume_paused(&t, &e.name).await?;
    if let Err(why) = create_slot(&mut t, &slot).await? {
        return Ok(Err(why));
    }
    let Some(sub) = sql::subscription(&t, &e.name).await? else {
        return Ok(Err(format!("subscription {} is gone", e.name)));
    };
    // Everything the source committed before the slot's start is applied once the
    // subscription confirms a position past it (with nothing pending, the apply worker
    // confirms what it received): none of those transactions is in the slot, and the
    // snapshot saw them all.
    let past_start = start.to_string();
    let (source_session, subscription, past) = (&s, e.name.as_str(), past_start.as_str());
    let applied =
        dbops_shared::poll::until(APPLIED_WAIT, Duration::from_millis(50), || async move {
            let progress = sql::slot_progress(source_session, subscription, Some(past)).await?;
            Ok::<_, PgError>(progress.is_some_and(|p| p.reached).then_some(()))
        })
        .await?;
    if applied.is_none() {
        return Ok(Err(format!(
            "the target did not apply past {start} within {} s",
            APPLIED_WAIT.as_secs()
        )));
    }
    let mut paused = session(saga, &e.target, &e.database).await?;
    let (l, target) = match paused_count(saga, &t, &mut paused, &e.name, sub.oid).await? {
        Ok(x) => x,
        Err(why) => return Ok(Err(why)),
    };
    if source.tables != target.tables {
        return Ok(Err("the servers list different tables".into()));
    }
    let decoded = match decode(&*s, &slot, &source.names).await? {
        Ok(txns) => txns,
        Err(why) => return Ok(Err(why)),
    };
    if counts::at(&source.rows, &source.snapshot, &decoded, l) != target.rows {
        return Ok(Err(format!("the row counts differ at the source's {l}")));
    }
    Ok(Ok(Baseline {
        at: l,
        tables: target.tables,
        names: target.names,
        rows: target.rows,
        target_snapshot: target.snapshot,
    }))
}

/// Creates the logical slot `slot` in the session's database (waiting at most
/// [`SLOT_TIMEOUT`] for the transactions running on the server); its start.
async fn create_slot(s: &mut Session, slot: &str) -> Result<Why<Lsn>> {
    let tx = s
        .client_mut()
        .transaction()
        .await
        .map_err(PgError::sql("starting a transaction"))?;
    tx.batch_execute(&format!("SET LOCAL statement_timeout = '{SLOT_TIMEOUT}'"))
        .await
        .map_err(PgError::sql("setting a statement timeout"))?;
    let row = tx
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'test_decoding')",
            &[&slot],
        )
        .await;
    let row = match row {
        Ok(row) => row,
        // No logical decoding there (wal_level), no right to create slots, no
        // test_decoding, or the server's transactions did not end in time.
        Err(e) => {
            return Ok(Err(
                PgError::sql(format!("creating the slot {slot}"))(e).to_string()
            ));
        }
    };
    tx.commit()
        .await
        .map_err(PgError::sql("committing the slot's creation"))?;
    let lsn: String = row.get(0);
    Ok(Lsn::parse(&lsn).ok_or_else(|| format!("a slot's start {lsn:?}")))
}

async fn snapshot_transaction(s: &mut Session) -> Result<tokio_postgres::Transaction<'_>> {
    Ok(s.client_mut()
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(PgError::sql("starting a snapshot"))?)
}

/// The session's tables listed and counted in one snapshot.
async fn counted(s: &mut Session) -> Result<Why<Count>> {
    let tx = snapshot_transaction(s).await?;
    let count = count_in(&tx).await?;
    tx.commit()
        .await
        .map_err(PgError::sql("ending a snapshot"))?;
    Ok(count)
}

/// Lists and counts in the transaction's snapshot. The source is writable meanwhile, so a
/// tenant must not be able to turn a table into a view (`CREATE RULE "_RETURN"`, possible
/// before PostgreSQL 16) whose query the admin's `count(*)` would run: every table is
/// locked (ACCESS SHARE: writes go on, DDL waits) and then checked to still have storage,
/// before anything is counted; row security is off (a policy raises an error rather than
/// running a tenant's function as the admin).
async fn count_in(tx: &tokio_postgres::Transaction<'_>) -> Result<Why<Count>> {
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'; SET LOCAL row_security = off"
    ))
    .await
    .map_err(PgError::sql(
        "setting the counts' lock timeout and row security",
    ))?;
    // The first query takes the snapshot.
    let (tables, names, oids) = match list(tx).await? {
        Ok(l) => l,
        Err(why) => return Ok(Err(why)),
    };
    let snapshot = match snapshot_of(tx).await? {
        Ok(s) => s,
        Err(why) => return Ok(Err(why)),
    };
    if !tables.is_empty() {
        let each: Vec<String> = tables
            .iter()
            .map(|(schema, table)| format!("ONLY {}.{}", quote_ident(schema), quote_ident(table)))
            .collect();
        let locked = tx
            .batch_execute(&format!(
                "LOCK TABLE {} IN ACCESS SHARE MODE",
                each.join(", ")
            ))
            .await;
        if let Err(e) = locked {
            return Ok(Err(
                PgError::sql("locking the tables to count")(e).to_string()
            ));
        }
        // After the lock, the relation cache is current: a view has no file node.
        let stored: bool = tx
            .query_one(
                "SELECT coalesce(bool_and(pg_relation_filenode(oid) IS NOT NULL), true) \
                 FROM unnest($1::bigint[]::oid[]) AS oid",
                &[&oids],
            )
            .await
            .map_err(PgError::sql("checking the tables to count"))?
            .get(0);
        if !stored {
            return Ok(Err(
                "a table stopped being a table while it was listed".into()
            ));
        }
    }
    let rows = count(tx, &tables).await?;
    Ok(Ok(Count {
        tables,
        names,
        snapshot,
        rows,
    }))
}

/// On the target: the subscription disabled, its apply worker gone, a snapshot taken in
/// `paused` with the source position applied, the subscription enabled again (whatever
/// happened in between), then the tables listed and counted in that snapshot.
async fn paused_count(
    saga: &Saga<'_>,
    t: &Session,
    paused: &mut Session,
    name: &str,
    oid: i64,
) -> Result<Why<(Lsn, Count)>> {
    super::pause::pause(t, name).await?;
    saga.crash_point(MigrationStep::FreezeSource, Moment::SubscriptionPaused);
    let snapped = snap_paused(t, paused, oid).await;
    let enabled = super::pause::resume(t, name).await;
    let snapped = snapped?;
    enabled?;
    let (tx, l) = match snapped {
        Ok(x) => x,
        Err(why) => return Ok(Err(why)),
    };
    let count = count_in(&tx).await?;
    tx.commit()
        .await
        .map_err(PgError::sql("ending a snapshot"))?;
    Ok(count.map(|c| (l, c)))
}

async fn snap_paused<'a>(
    t: &Session,
    paused: &'a mut Session,
    oid: i64,
) -> Result<Why<(tokio_postgres::Transaction<'a>, Lsn)>> {
    let stopped = dbops_shared::poll::until(STOP_WAIT, Duration::from_millis(20), || async move {
        let running = t
            .query_one(
                "SELECT count(*) FROM pg_stat_subscription \
                 WHERE subid = $1::bigint::oid AND pid IS NOT NULL",
                &[&oid],
            )
            .await
            .map_err(PgError::sql("reading pg_stat_subscription"))?;
        Ok::<_, PgError>((running.get::<_, i64>(0) == 0).then_some(()))
    })
    .await?;
    if stopped.is_none() {
        return Ok(Err(format!(
            "the subscription's apply worker did not stop within {} s",
            STOP_WAIT.as_secs()
        )));
    }
    let tx = snapshot_transaction(paused).await?;
    // The first statement takes the snapshot; the worker is stopped, so what it applied
    // is what the snapshot sees.
    let Some(l) = applied(&tx, oid).await? else {
        return Ok(Err("the subscription's origin has no position".into()));
    };
    Ok(Ok((tx, l)))
}

/// How far the subscription `oid` has applied the source's commits (its origin's
/// position); `None` before it has applied any.
async fn applied(c: &impl GenericClient, oid: i64) -> Result<Option<Lsn>> {
    let row = c
        .query_opt(
            "SELECT remote_lsn::text FROM pg_replication_origin_status \
             WHERE external_id = 'pg_' || $1::bigint::text",
            &[&oid],
        )
        .await
        .map_err(PgError::sql("reading pg_replication_origin_status"))?;
    Ok(row
        .and_then(|r| r.get::<_, Option<String>>(0))
        .and_then(|l| Lsn::parse(&l)))
}

async fn snapshot_of(c: &impl GenericClient) -> Result<Why<Snapshot>> {
    let text: String = c
        .query_one("SELECT pg_current_snapshot()::text", &[])
        .await
        .map_err(PgError::sql("reading the snapshot"))?
        .get(0);
    Ok(Snapshot::parse(&text).ok_or_else(|| format!("a snapshot {text:?}")))
}

/// The tables as `sql::tables` lists them, as `test_decoding` names them, and their OIDs;
/// none may be unlogged (its changes are not decoded).
async fn list(c: &impl GenericClient) -> Result<Why<Listed>> {
    let rows = c
        .query(
            &format!(
                "SELECT n.nspname::text, c.relname::text, format('%I.%I', n.nspname, c.relname), \
                        c.relpersistence = 'p', c.oid::bigint {} ORDER BY 1, 2",
                ddl::USER_TABLES
            ),
            &[],
        )
        .await
        .map_err(PgError::sql("listing tables"))?;
    if let Some(r) = rows.iter().find(|r| !r.get::<_, bool>(3)) {
        return Ok(Err(format!("{} is not logged", r.get::<_, String>(2))));
    }
    Ok(Ok((
        rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        rows.iter().map(|r| r.get(2)).collect(),
        rows.iter().map(|r| r.get(4)).collect(),
    )))
}

async fn count(c: &impl GenericClient, tables: &[(String, String)]) -> Result<Vec<i64>> {
    let mut rows = Vec::with_capacity(tables.len());
    for (schema, table) in tables {
        let row = c
            .query_one(&crate::sql::count_statement(schema, table), &[])
            .await
            .map_err(PgError::sql(format!(
                "counting the rows of {schema}.{table}"
            )))?;
        rows.push(row.get(0));
    }
    Ok(rows)
}

/// Every transaction the slot holds (it stays: `peek`), over the tables `names`.
async fn decode(c: &impl GenericClient, slot: &str, names: &[String]) -> Result<counts::Decoded> {
    let rows = c
        .query(
            "SELECT xid::text, coalesce(m[1], ''), \
                    coalesce(m[2], CASE WHEN data LIKE 'COMMIT%' THEN 'COMMIT' ELSE 'OTHER' END), \
                    count(*), max(lsn)::text \
             FROM (SELECT lsn, xid, data, \
                          regexp_match(data, '^table (.*?): (INSERT|UPDATE|DELETE|TRUNCATE):') AS m \
                   FROM pg_logical_slot_peek_changes($1, NULL, NULL, 'skip-empty-xacts', '1')) AS c \
             GROUP BY 1, 2, 3",
            &[&slot],
        )
        .await
        .map_err(PgError::sql(format!("decoding the slot {slot}")))?;
    let mut changes = Vec::with_capacity(rows.len());
    for r in &rows {
        let (xid, lsn): (String, String) = (r.get(0), r.get(4));
        let (Ok(xid), Some(lsn)) = (xid.parse::<u32>(), Lsn::parse(&lsn)) else {
            return Ok(Err(format!("a decoded change of {xid:?} at {lsn:?}")));
        };
        changes.push(Change {
            xid,
            table: r.get(1),
            op: r.get(2),
            count: r.get(3),
            lsn,
        });
    }
    Ok(counts::transactions(&changes, names))
}

/// Verify's rows from the baseline (in the freeze, after CatchUp): the source's and the
/// target's now, per table of `b.tables`; `Err` says why they do not add up (Verify then
/// counts).
pub async fn rows_now(
    s: &Session,
    t: &Session,
    slot_name: &str,
    b: &Baseline,
) -> Result<Why<(Vec<i64>, Vec<i64>)>> {
    let (on_source, on_target) = tokio::try_join!(
        decode(&**s, slot_name, &b.names),
        decode(&**t, slot_name, &b.names)
    )?;
    let (source, target): (Vec<Txn>, Vec<Txn>) = match (on_source, on_target) {
        (Ok(s), Ok(t)) => (s, t),
        (Err(why), _) | (_, Err(why)) => return Ok(Err(why)),
    };
    Ok(Ok((
        counts::after(&b.rows, &source, b.at),
        counts::now(&b.rows, &b.target_snapshot, &target),
    )))
}
