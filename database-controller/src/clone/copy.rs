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
    Error::Reported {
        reason: DatabaseReason::CloneFailed.into(),
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

/// psql as the owner `into`: one transaction, stopping at the first error, SQL on its
/// stdin.
pub fn load_command(
    psql: &Path,
    into: &Connection<'_>,
) -> std::io::Result<(Command, Option<RootCertFile>)> {
    let (mut load, ca) = pg_tools::command(psql, into)?;
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

/// Runs the copy from the live source; `tally` follows its progress.
pub async fn run(p: &Programs<'_>, filter: Filter, tally: &watch::Sender<Tally>) -> Result<Tally> {
    // The CA files live until both programs have ended.
    let (dump, _dump_ca) = dump_command(p).map_err(|e| could_not_run(p.pg_dump, e))?;
    let (load, _load_ca) = load_command(p.psql, &p.into).map_err(|e| could_not_run(p.psql, e))?;
    let source = Source {
        command: dump,
        program: p.pg_dump,
    };
    pipeline(source, load, |_| async { Ok(()) }, filter, tally).await
}

pub fn could_not_run(program: &Path, e: std::io::Error) -> Error {
    failed(format!("could not run {}: {e}", program.display()))
}

/// The program whose plain SQL output is masked into psql: pg_dump of the live source,
/// or pg_restore of a Backup's artifact (`--file=-`).
pub struct Source<'a> {
    pub command: Command,
    pub program: &'a Path,
}

/// `source` (fed on its stdin by `feed`, if it takes one) → the filter → psql (`load`):
/// psql's input ends, and it commits, only when the source ended well, the feeding went
/// through and every line was masked; otherwise psql is killed first.
pub async fn pipeline<F, Fut>(
    mut source: Source<'_>,
    load: Command,
    feed: F,
    mut filter: Filter,
    tally: &watch::Sender<Tally>,
) -> Result<Tally>
where
    F: FnOnce(Option<tokio::process::ChildStdin>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let name = source.program.display().to_string();
    let mut out = source
        .command
        .spawn()
        .map_err(|e| could_not_run(source.program, e))?;
    let mut load = { load }
        .spawn()
        .map_err(|e| failed(format!("could not run psql: {e}")))?;
    let out_errors = pg_tools::keep_stderr(out.stderr.take());
    let load_errors = pg_tools::keep_stderr(load.stderr.take());
    let (Some(from), Some(into)) = (out.stdout.take(), load.stdin.take()) else {
        return Err(failed(format!(
            "{name}'s output or psql's input is not piped"
        )));
    };
    let (piped, fed) = tokio::join!(pipe(from, into, &mut filter, tally), feed(out.stdin.take()));
    let ended = out.wait().await;
    let out_stderr = out_errors.await.unwrap_or_default();
    let ended_ok = matches!(&ended, Ok(s) if s.success()) && fed.is_ok();
    let input = match piped {
        // Only now, with the source ended well, does psql's input end: it commits.
        Ok(input) if ended_ok => {
            drop(input);
            None
        }
        Ok(input) => Some(Ok(input)),
        Err(e) => Some(Err(e)),
    };
    if let Some(unfinished) = input {
        // psql's input has not ended: killed now, its transaction ends unfinished.
        let _ = load.kill().await;
        let load_stderr = load_errors.await.unwrap_or_default();
        return Err(failed(match (unfinished, ended, fed) {
            (Err(e), _, _) if !load_stderr.is_empty() => format!("{e}; psql: {load_stderr}"),
            (Err(e), _, _) => e,
            (Ok(_), _, Err(e)) => format!("{e}; {name}: {out_stderr}"),
            (Ok(_), Ok(status), _) => format!("{name} failed ({status}): {out_stderr}"),
            (Ok(_), Err(e), _) => format!("waiting for {name}: {e}"),
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

/// Lines from the source through the filter into psql, flushed; psql's input is returned
/// open, to be closed (psql then commits) only once the source is known to have ended
/// well. On an error the source's output is dropped, so a source still writing ends.
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
