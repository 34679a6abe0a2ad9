//! The copy itself: `pg_dump` (plain format, as the source server's admin, in the
//! snapshot the clone exported) → the mask filter → `psql` (as the new database's owner,
//! one transaction, stopping at the first error). Nothing is committed unless pg_dump
//! ended well and every line went through: otherwise psql is killed before its input
//! ends, and its transaction with it.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use dbops_api::reasons::DatabaseReason;
use dbops_shared::pg_tools::{self, Connection, RootCertFile};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::process::Command;
use tokio::sync::watch;

use super::mask::{Filter, Tally};
use crate::error::{Error, Result};

/// The two programs and where each connects.
pub struct Programs<'a> {
    pub pg_dump: &'a Path,
    pub psql: &'a Path,
    /// pg_dump's major: 18 and newer are told not to dump statistics (they hold values).
    pub pg_dump_major: u32,
    pub from: Connection<'a>,
    pub into: Connection<'a>,
    pub snapshot: &'a str,
}

pub fn failed(message: String) -> Error {
    Error::Retry {
        reason: DatabaseReason::CloneFailed.as_str(),
        message,
    }
}

/// pg_dump of the snapshot, plain SQL on its stdout.
fn dump_command(p: &Programs<'_>) -> std::io::Result<(Command, Option<RootCertFile>)> {
    let (mut dump, ca) = pg_tools::command(p.pg_dump, &p.from)?;
    dump.args([
        "--format=plain",
        "--no-owner",
        "--no-privileges",
        "--no-password",
        "--no-tablespaces",
        "--no-publications",
        "--no-subscriptions",
        "--no-security-labels",
    ])
    .args((p.pg_dump_major >= 18).then_some("--no-statistics"))
    .arg(format!("--snapshot={}", p.snapshot))
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    Ok((dump, ca))
}

/// psql as the owner: one transaction, stopping at the first error, SQL on its stdin.
fn load_command(p: &Programs<'_>) -> std::io::Result<(Command, Option<RootCertFile>)> {
    let (mut load, ca) = pg_tools::command(p.psql, &p.into)?;
    load.args([
        "--no-psqlrc",
        "--quiet",
        "--no-password",
        "--single-transaction",
        "--set=ON_ERROR_STOP=1",
        "--file=-",
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::null());
    Ok((load, ca))
}

/// Runs the copy; `tally` follows its progress.
pub async fn run(
    p: &Programs<'_>,
    mut filter: Filter,
    tally: &watch::Sender<Tally>,
) -> Result<Tally> {
    let could_not_run = |program: &Path, e: std::io::Error| {
        failed(format!("could not run {}: {e}", program.display()))
    };
    // The CA files live until both programs have ended.
    let (mut dump, _dump_ca) = dump_command(p).map_err(|e| could_not_run(p.pg_dump, e))?;
    let (mut load, _load_ca) = load_command(p).map_err(|e| could_not_run(p.psql, e))?;
    let mut dump = dump.spawn().map_err(|e| could_not_run(p.pg_dump, e))?;
    let mut load = load.spawn().map_err(|e| could_not_run(p.psql, e))?;
    let dump_errors = pg_tools::keep_stderr(dump.stderr.take());
    let load_errors = pg_tools::keep_stderr(load.stderr.take());
    let (Some(from), Some(into)) = (dump.stdout.take(), load.stdin.take()) else {
        return Err(failed(
            "pg_dump's output or psql's input is not piped".into(),
        ));
    };
    let piped = pipe(from, into, &mut filter, tally).await;
    let dumped = dump.wait().await;
    let dump_stderr = dump_errors.await.unwrap_or_default();
    let dump_ok = matches!(&dumped, Ok(s) if s.success());
    let piped = match piped {
        // Only now, with pg_dump ended well, does psql's input end: it commits.
        Ok(input) if dump_ok => {
            drop(input);
            Ok(())
        }
        Ok(input) => {
            let _ = load.kill().await;
            drop(input);
            Ok(())
        }
        Err(e) => Err(e),
    };
    if !dump_ok || piped.is_err() {
        // psql's input has not ended: killed now, its transaction ends unfinished.
        let _ = load.kill().await;
        let load_stderr = load_errors.await.unwrap_or_default();
        return Err(failed(match (piped, dumped) {
            (Err(e), _) if !load_stderr.is_empty() => format!("{e}; psql: {load_stderr}"),
            (Err(e), _) => e,
            (Ok(_), Ok(status)) => format!("pg_dump failed ({status}): {dump_stderr}"),
            (Ok(_), Err(e)) => format!("waiting for pg_dump: {e}"),
        }));
    }
    let loaded = load
        .wait()
        .await
        .map_err(|e| failed(format!("waiting for psql: {e}")))?;
    let load_stderr = load_errors.await.unwrap_or_default();
    if !loaded.success() {
        return Err(failed(format!("psql failed ({loaded}): {load_stderr}")));
    }
    Ok(filter.tally)
}

/// Lines from pg_dump through the filter into psql, flushed; psql's input is returned
/// open, to be closed (psql then commits) only once pg_dump is known to have ended well.
async fn pipe(
    from: tokio::process::ChildStdout,
    into: tokio::process::ChildStdin,
    filter: &mut Filter,
    tally: &watch::Sender<Tally>,
) -> Result<BufWriter<tokio::process::ChildStdin>, String> {
    let mut reader = BufReader::with_capacity(1 << 18, from);
    let mut writer = BufWriter::with_capacity(1 << 20, into);
    let (mut line, mut out) = (Vec::with_capacity(1 << 12), Vec::with_capacity(1 << 12));
    let mut last = std::time::Instant::now();
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| format!("reading pg_dump's output: {e}"))?;
        if n == 0 {
            break;
        }
        out.clear();
        filter.line(&line, &mut out).map_err(|e| e.to_string())?;
        writer
            .write_all(&out)
            .await
            .map_err(|e| format!("writing to psql: {e}"))?;
        if last.elapsed() >= Duration::from_millis(500) {
            tally.send_replace(filter.tally);
            last = std::time::Instant::now();
        }
    }
    tally.send_replace(filter.tally);
    let unmasked = filter.unmasked();
    if !unmasked.is_empty() {
        return Err(format!(
            "pg_dump's output copied no rows of {}, which the mask names: nothing was committed",
            unmasked.join(", ")
        ));
    }
    writer
        .flush()
        .await
        .map_err(|e| format!("writing to psql: {e}"))?;
    Ok(writer)
}
