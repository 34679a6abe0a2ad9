//! Running `pg_dump --format=custom` and streaming its output into the backup store,
//! computing the SHA-256 and the size on the way.
//!
//! The process plumbing is `dbops_shared::pg_tools`: the password reaches pg_dump through
//! `PGPASSWORD` in its environment only, never on its command line nor in a log line.
//! pg_dump is killed when the attempt is dropped (a shutdown); when this process dies, it
//! loses its stdout reader and stops on the broken pipe.

use std::future::Future;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use dbops_api::reasons::BackupReason;
use dbops_shared::pg_tools::{self, Connection, is_auth_failure, is_connection_failure};
use dbops_shared::postgres::{Credentials, Endpoint};
use tokio::process::Command;

use dbops_shared::backup_store::{ArtifactWriter, ObjectKey, StoreError};
use dbops_shared::checksum::{ChunkReader, Tally};
use dbops_shared::sealing::Sealer;
use kube::ResourceExt;

/// Why a dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("could not run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading pg_dump's output: {0}")]
    Read(#[source] std::io::Error),
    #[error("pg_dump failed ({status}): {stderr}")]
    Failed { status: ExitStatus, stderr: String },
    /// `--lock-wait-timeout` passed before pg_dump could lock a table: an application
    /// holds a conflicting lock (an open transaction with DDL, `LOCK TABLE`, ...).
    #[error(
        "pg_dump waited longer than {waited:?} for a lock on table {relation}: another session holds a conflicting lock (retried)"
    )]
    LockTimeout { relation: String, waited: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("encrypting the dump: {0}")]
    Seal(#[source] std::io::Error),
}

impl DumpError {
    /// The condition reason.
    pub fn reason(&self) -> BackupReason {
        match self {
            DumpError::Failed { stderr, .. } if is_auth_failure(stderr) => {
                BackupReason::AuthenticationFailed
            }
            DumpError::Failed { stderr, .. } if is_connection_failure(stderr) => {
                BackupReason::ServerUnreachable
            }
            DumpError::Failed { stderr, .. } if is_privilege_failure(stderr) => {
                BackupReason::AdminLacksPrivilege
            }
            DumpError::Store(_) => BackupReason::StoreUnavailable,
            DumpError::LockTimeout { .. } => BackupReason::LockTimeout,
            _ => BackupReason::DumpFailed,
        }
    }
}

/// pg_dump was refused something the admin may not read (an admin that is not a
/// superuser, on a managed server: a table of a role it is not a member of, without
/// `pg_read_all_data`).
fn is_privilege_failure(stderr: &str) -> bool {
    stderr.contains("ERROR:  permission denied")
}

/// Whom pg_dump connects to, as whom, and which database it dumps.
pub struct Source<'a> {
    pub server: &'a Endpoint,
    pub credentials: &'a Credentials,
    pub database: &'a str,
    /// pg_dump's `--lock-wait-timeout`: the longest wait for one table's lock.
    pub lock_wait: Duration,
    /// A snapshot exported by a transaction that stays open until pg_dump has started
    /// (`pg_dump --snapshot`): the dump reads exactly what that transaction sees.
    pub snapshot: Option<String>,
}

/// The table pg_dump could not lock in time, from its stderr: its `--lock-wait-timeout`
/// cancels the `LOCK TABLE <relation> IN ACCESS SHARE MODE` it was waiting in.
pub fn lock_timed_out(stderr: &str) -> Option<String> {
    if !stderr.contains("canceling statement due to") {
        return None;
    }
    let after = stderr.split("LOCK TABLE ").nth(1)?;
    let relation = after.split(" IN ").next()?.trim();
    (!relation.is_empty()).then(|| relation.to_string())
}

/// The store key of a Backup: from its identity, so retries and restarts overwrite.
pub fn object_key(backup: &dbops_api::Backup) -> ObjectKey {
    ObjectKey::new(
        &backup.namespace().unwrap_or_default(),
        &backup.name_any(),
        &backup.uid().unwrap_or_default(),
    )
}

/// What a complete dump produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dumped {
    pub size_bytes: u64,
    /// SHA-256, lower-case hex.
    pub sha256: String,
}

/// `pg_dump --version`, for example `pg_dump (PostgreSQL) 15.14 (Debian 15.14-0+deb12u1)`.
pub async fn pg_dump_version(pg_dump: &Path) -> Result<String, DumpError> {
    let out = Command::new(pg_dump)
        .arg("--version")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|source| DumpError::Spawn {
            program: pg_dump.display().to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(DumpError::Failed {
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs pg_dump against `source`, writing its output to `artifact` (not committed),
/// sealed by `sealer` on the way when there is one, and calls `progress` with the bytes
/// written so far at most once per `progress_every`.
pub async fn run<F, Fut>(
    pg_dump: &Path,
    source: &Source<'_>,
    artifact: &mut ArtifactWriter,
    sealer: Option<Sealer>,
    progress_every: Duration,
    progress: F,
) -> Result<Dumped, DumpError>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    let to = Connection::of(
        source.server,
        source.credentials,
        source.database,
        "dbops-backup",
    );
    let spawn_error = |source| DumpError::Spawn {
        program: pg_dump.display().to_string(),
        source,
    };
    // `_root_cert` (the server's CA for PGSSLROOTCERT) lives until pg_dump has ended.
    let (mut command, _root_cert) = pg_tools::command(pg_dump, &to).map_err(spawn_error)?;
    let mut child = command
        .args(["--format=custom", "--no-password"])
        // Zero: no bound (as PostgreSQL's lock_timeout = 0).
        .args(
            (!source.lock_wait.is_zero())
                .then(|| format!("--lock-wait-timeout={}", source.lock_wait.as_millis())),
        )
        .args(source.snapshot.as_ref().map(|s| format!("--snapshot={s}")))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    let errors = pg_tools::keep_stderr(child.stderr.take());
    let Some(stdout) = child.stdout.take() else {
        return Err(DumpError::Read(std::io::Error::other(
            "pg_dump's output is not piped",
        )));
    };

    let stored = stream_into(stdout, artifact, sealer, progress_every, progress).await?;
    let status = child.wait().await.map_err(DumpError::Read)?;
    let stderr = errors.await.unwrap_or_default();
    if !status.success() {
        if let Some(relation) = lock_timed_out(&stderr) {
            return Err(DumpError::LockTimeout {
                relation,
                waited: source.lock_wait,
            });
        }
        return Err(DumpError::Failed { status, stderr });
    }
    Ok(Dumped {
        size_bytes: stored.size(),
        sha256: stored.sha256_hex(),
    })
}

/// pg_dump's output into `artifact`, sealed on the way when there is a `sealer`; what
/// goes to the store is counted and hashed (the ciphertext when sealed).
async fn stream_into<F, Fut>(
    stdout: tokio::process::ChildStdout,
    artifact: &mut ArtifactWriter,
    mut sealer: Option<Sealer>,
    progress_every: Duration,
    mut progress: F,
) -> Result<Tally, DumpError>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut dump = ChunkReader::new(stdout);
    let mut stored = Tally::default();
    let mut reported = Instant::now();
    while let Some(chunk) = dump.next_chunk().await.map_err(DumpError::Read)? {
        match sealer.as_mut() {
            Some(sealer) => {
                let sealed = sealer.seal(chunk).map_err(DumpError::Seal)?;
                stored.update(&sealed);
                artifact.write(&sealed).await?;
            }
            None => {
                stored.update(chunk);
                artifact.write(chunk).await?;
            }
        }
        if reported.elapsed() >= progress_every {
            progress(stored.size()).await;
            reported = Instant::now();
        }
    }
    if let Some(sealer) = sealer {
        let last = sealer.finish().map_err(DumpError::Seal)?;
        stored.update(&last);
        artifact.write(&last).await?;
    }
    Ok(stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_wait_timeout_names_the_table() {
        let stderr = "pg_dump: error: query failed: ERROR:  canceling statement due to statement timeout\n\
                      pg_dump: detail: Query was: LOCK TABLE public.orders IN ACCESS SHARE MODE";
        assert_eq!(lock_timed_out(stderr).as_deref(), Some("public.orders"));
        assert_eq!(lock_timed_out("pg_dump: error: connection refused"), None);
        let e = DumpError::LockTimeout {
            relation: "public.orders".into(),
            waited: Duration::from_secs(10),
        };
        assert_eq!(e.reason(), BackupReason::LockTimeout);
        assert!(e.reason().class() != dbops_api::ReasonClass::Failed);
        assert!(e.to_string().contains("public.orders"), "{e}");
    }

    fn failed(stderr: &str) -> DumpError {
        use std::os::unix::process::ExitStatusExt;
        DumpError::Failed {
            status: ExitStatus::from_raw(1 << 8),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn pg_dump_failures_are_sorted_by_what_fixes_them() {
        let auth = failed(
            "pg_dump: error: connection to server at \"127.0.0.1\", port 5432 failed: FATAL:  password authentication failed for user \"postgres\"",
        );
        assert_eq!(auth.reason(), BackupReason::AuthenticationFailed);
        assert!(auth.reason().class() == dbops_api::ReasonClass::Failed);
        let down = failed(
            "pg_dump: error: connection to server at \"127.0.0.1\", port 1 failed: Connection refused",
        );
        assert_eq!(down.reason(), BackupReason::ServerUnreachable);
        assert!(down.reason().class() != dbops_api::ReasonClass::Failed);
        let denied = failed("pg_dump: error: query failed: ERROR:  permission denied for table t");
        assert_eq!(denied.reason(), BackupReason::AdminLacksPrivilege);
        assert!(denied.reason().class() == dbops_api::ReasonClass::Failed);
        let other = failed("pg_dump: error: query failed: ERROR:  out of memory");
        assert_eq!(other.reason(), BackupReason::DumpFailed);
        assert!(other.reason().class() != dbops_api::ReasonClass::Failed);
    }
}
