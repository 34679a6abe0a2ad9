//! CopyData's pipe: `pg_dump --format=custom` of the frozen source streamed straight into
//! `pg_restore` on the target, through an OS pipe (nothing of the database is held in this
//! process or written to disk).
//!
//! - The restore runs in one transaction (`--single-transaction --exit-on-error`): it
//!   commits everything or nothing, so a retry after a crash or a failure starts clean.
//! - Objects belong to the Database's owner role: pg_restore connects as the target's
//!   admin and runs `SET ROLE <owner>` (`--role`), with `--no-owner`.
//! - Privileges are not copied (`--no-privileges`): the roles they name other than the
//!   owner do not exist on the target.
//! - Extensions are created by ProvisionTarget as the admin (some are untrusted) and left
//!   out of the dump: `--extension=plpgsql` selects only the built-in plpgsql, of which
//!   pg_dump writes nothing but ACLs, so no `CREATE/COMMENT ON EXTENSION` runs as the
//!   owner (who may not own them).
//!
//! Passwords reach the programs through `PGPASSWORD` in their environment only.

use std::path::Path;
use std::process::{ExitStatus, Stdio};

use dbops_api::ServerSpec;
use dbops_shared::postgres::Credentials;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStderr, Command};

/// How much of each program's stderr is kept for the error message.
const STDERR_KEPT: usize = 2048;

/// Why the copy failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("could not run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} failed ({status}): {stderr}")]
    Failed {
        program: &'static str,
        status: ExitStatus,
        stderr: String,
    },
    #[error("waiting for {program}: {source}")]
    Wait {
        program: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl CopyError {
    /// The CamelCase condition reason.
    pub fn reason(&self) -> &'static str {
        match self {
            CopyError::Failed { stderr, .. } if is_connection_failure(stderr) => {
                "ServerUnreachable"
            }
            CopyError::Failed {
                program: "pg_dump", ..
            } => "DumpFailed",
            CopyError::Failed { .. } => "RestoreFailed",
            CopyError::Spawn { .. } | CopyError::Wait { .. } => "CopyFailed",
        }
    }
}

fn is_connection_failure(stderr: &str) -> bool {
    [
        "could not connect",
        "Connection refused",
        "server closed the connection",
        "timeout expired",
        "the database system is shutting down",
        "the database system is starting up",
        "terminating connection",
    ]
    .iter()
    .any(|s| stderr.contains(s))
}

/// One end of the copy: a server, the admin credentials, the database.
pub struct Endpoint<'a> {
    pub server: &'a ServerSpec,
    pub credentials: &'a Credentials,
    pub database: &'a str,
}

/// Programs and what to do with them.
pub struct Programs<'a> {
    pub pg_dump: &'a Path,
    pub pg_restore: &'a Path,
}

fn command(program: &Path, end: &Endpoint<'_>, app: &str) -> Command {
    let mut c = Command::new(program);
    c.env("PGHOST", &end.server.host)
        .env("PGPORT", end.server.port.to_string())
        .env("PGUSER", &end.credentials.username)
        .env("PGPASSWORD", &end.credentials.password)
        .env("PGDATABASE", end.database)
        .env("PGSSLMODE", end.server.ssl_mode.as_str())
        .env("PGCONNECT_TIMEOUT", "10")
        .env("PGAPPNAME", app)
        // Nothing from this process's environment may redirect the connection.
        .env_remove("PGSERVICE")
        .env_remove("PGSERVICEFILE")
        .env_remove("PGPASSFILE")
        .env_remove("PGOPTIONS")
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

/// Streams the source database into the (empty) target database, owned by `owner`.
pub async fn copy(
    programs: &Programs<'_>,
    source: &Endpoint<'_>,
    target: &Endpoint<'_>,
    owner: &str,
) -> Result<(), CopyError> {
    let mut dump = command(programs.pg_dump, source, "dbops-migration")
        .args([
            "--format=custom",
            "--no-password",
            "--extension=plpgsql",
            "--no-privileges",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|source| CopyError::Spawn {
            program: programs.pg_dump.display().to_string(),
            source,
        })?;
    let dump_errors = keep_stderr(dump.stderr.take());
    let pipe: Stdio = match dump.stdout.take().map(TryInto::try_into) {
        Some(Ok(pipe)) => pipe,
        Some(Err(source)) => {
            return Err(CopyError::Wait {
                program: "pg_dump",
                source,
            });
        }
        None => {
            return Err(CopyError::Wait {
                program: "pg_dump",
                source: std::io::Error::other("pg_dump's output is not piped"),
            });
        }
    };
    let mut restore = command(programs.pg_restore, target, "dbops-migration")
        .args([
            "--no-password",
            "--no-owner",
            "--no-privileges",
            "--single-transaction",
            "--exit-on-error",
        ])
        .arg(format!("--role={owner}"))
        .arg(format!("--dbname={}", target.database))
        .stdin(pipe)
        .stdout(Stdio::null())
        .spawn()
        .map_err(|source| CopyError::Spawn {
            program: programs.pg_restore.display().to_string(),
            source,
        })?;
    let restore_errors = keep_stderr(restore.stderr.take());

    let restored = wait(&mut restore, "pg_restore").await?;
    // pg_restore stopped reading: pg_dump ends on the broken pipe if it has not already.
    let dumped = wait(&mut dump, "pg_dump").await?;
    let (dump_stderr, restore_stderr) = (dump_errors.await, restore_errors.await);
    if !dumped.success() {
        return Err(CopyError::Failed {
            program: "pg_dump",
            status: dumped,
            stderr: dump_stderr.unwrap_or_default(),
        });
    }
    if !restored.success() {
        return Err(CopyError::Failed {
            program: "pg_restore",
            status: restored,
            stderr: restore_stderr.unwrap_or_default(),
        });
    }
    Ok(())
}

async fn wait(child: &mut Child, program: &'static str) -> Result<ExitStatus, CopyError> {
    child
        .wait()
        .await
        .map_err(|source| CopyError::Wait { program, source })
}

/// Reads a program's stderr to the end, keeping its last [`STDERR_KEPT`] bytes.
fn keep_stderr(stderr: Option<ChildStderr>) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let Some(mut stderr) = stderr else {
            return String::new();
        };
        let mut kept = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stderr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    kept.extend_from_slice(&buf[..n]);
                    if kept.len() > 2 * STDERR_KEPT {
                        kept.drain(..kept.len() - STDERR_KEPT);
                    }
                }
            }
        }
        let text = String::from_utf8_lossy(&kept).into_owned();
        let start = text.len().saturating_sub(STDERR_KEPT);
        let start = (start..text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(text.len());
        text[start..].trim().to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(program: &'static str, stderr: &str) -> CopyError {
        use std::os::unix::process::ExitStatusExt;
        CopyError::Failed {
            program,
            status: ExitStatus::from_raw(1 << 8),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn copy_failures_are_sorted_by_what_fixes_them() {
        assert_eq!(
            failed(
                "pg_restore",
                "connection to server at \"127.0.0.1\", port 1 failed: Connection refused"
            )
            .reason(),
            "ServerUnreachable"
        );
        assert_eq!(
            failed(
                "pg_restore",
                "error: could not execute query: ERROR:  relation exists"
            )
            .reason(),
            "RestoreFailed"
        );
        assert_eq!(
            failed("pg_dump", "error: query failed").reason(),
            "DumpFailed"
        );
    }
}
