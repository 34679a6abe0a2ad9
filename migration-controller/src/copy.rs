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
//! Passwords reach the programs through `PGPASSWORD` in their environment only (the
//! process plumbing is `dbops_shared::pg_tools`).

use std::path::Path;
use std::process::{ExitStatus, Stdio};

use dbops_api::ServerSpec;
use dbops_shared::pg_tools::{self, Connection, is_connection_failure};
use dbops_shared::postgres::Credentials;
use tokio::process::{Child, Command};

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

fn command(program: &Path, end: &Endpoint<'_>) -> Command {
    let to = Connection::of(end.server, end.credentials, end.database, "dbops-migration");
    pg_tools::command(program, &to)
}

/// Streams the source database into the (empty) target database, owned by `owner`.
pub async fn copy(
    programs: &Programs<'_>,
    source: &Endpoint<'_>,
    target: &Endpoint<'_>,
    owner: &str,
) -> Result<(), CopyError> {
    let mut dump = command(programs.pg_dump, source)
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
    let dump_errors = pg_tools::keep_stderr(dump.stderr.take());
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
    let mut restore = command(programs.pg_restore, target)
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
    let restore_errors = pg_tools::keep_stderr(restore.stderr.take());

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
