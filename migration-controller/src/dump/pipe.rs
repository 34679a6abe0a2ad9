//! The copy's pipe (CopyData, and the Logical mode's schema copy): `pg_dump --format=custom` of the frozen source streamed straight into
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
//! process plumbing is `dbops_shared::pg_tools`); a server's own CA through a 0600 file
//! named by `PGSSLROOTCERT`, kept until both programs have exited, then removed.

use std::path::Path;
use std::process::{ExitStatus, Stdio};

use dbops_shared::pg_tools::{self, Connection, RootCertFile};
use dbops_shared::postgres::{Credentials, Endpoint};
use tokio::process::{Child, Command};

use crate::error::CopyError;

/// One end of the copy: a server (address and TLS), its admin credentials, the database.
pub struct Side<'a> {
    pub server: &'a Endpoint,
    pub credentials: &'a Credentials,
    pub database: &'a str,
}

/// Programs and what to do with them.
pub struct Programs<'a> {
    pub pg_dump: &'a Path,
    pub pg_restore: &'a Path,
}

/// `program` connected to `side`, and the server's CA file it reads (keep it until the
/// program has exited).
fn command(program: &Path, side: &Side<'_>) -> Result<(Command, Option<RootCertFile>), CopyError> {
    let to = Connection::of(
        side.server,
        side.credentials,
        side.database,
        "dbops-migration",
    );
    pg_tools::command(program, &to).map_err(|source| CopyError::Spawn {
        program: program.display().to_string(),
        source,
    })
}

/// What is copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contents {
    /// Schema and data (Dump mode's CopyData).
    Everything,
    /// The schema only, without the source's own publications and subscriptions (the
    /// Logical mode: the data follows by replication).
    SchemaOnly,
}

/// Streams the source database into the (empty) target database, owned by `owner`.
pub async fn copy(
    programs: &Programs<'_>,
    source: &Side<'_>,
    target: &Side<'_>,
    owner: &str,
    contents: Contents,
) -> Result<(), CopyError> {
    // The CA files live until both programs have exited (the end of this function, or an
    // early return, which kills the programs first: they were spawned later).
    let (mut dump, dump_ca) = spawn_dump(programs.pg_dump, source, contents)?;
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
    let (mut restore, restore_ca) = spawn_restore(programs.pg_restore, target, owner, pipe)?;
    let restore_errors = pg_tools::keep_stderr(restore.stderr.take());

    let restored = wait(&mut restore, "pg_restore").await?;
    // pg_restore stopped reading: pg_dump ends on the broken pipe if it has not already.
    let dumped = wait(&mut dump, "pg_dump").await?;
    // Both programs have exited: their CA files go.
    drop((dump_ca, restore_ca));
    let (dump_stderr, restore_stderr) = (dump_errors.await, restore_errors.await);
    for (program, status, stderr) in [
        ("pg_dump", dumped, dump_stderr),
        ("pg_restore", restored, restore_stderr),
    ] {
        if !status.success() {
            return Err(CopyError::Failed {
                program,
                status,
                stderr: stderr.unwrap_or_default(),
            });
        }
    }
    Ok(())
}

/// pg_dump of `source` (custom format) to a pipe, and the server's CA file it reads.
fn spawn_dump(
    pg_dump: &Path,
    source: &Side<'_>,
    contents: Contents,
) -> Result<(Child, Option<RootCertFile>), CopyError> {
    let (mut command, ca) = command(pg_dump, source)?;
    command
        .args([
            "--format=custom",
            "--no-password",
            "--extension=plpgsql",
            "--no-privileges",
        ])
        .args(match contents {
            Contents::Everything => &[][..],
            Contents::SchemaOnly => {
                &["--schema-only", "--no-publications", "--no-subscriptions"][..]
            }
        })
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    Ok((spawn(&mut command, pg_dump)?, ca))
}

/// pg_restore reading `pipe` into `target` in one transaction, as `owner`, and the
/// server's CA file it reads.
fn spawn_restore(
    pg_restore: &Path,
    target: &Side<'_>,
    owner: &str,
    pipe: Stdio,
) -> Result<(Child, Option<RootCertFile>), CopyError> {
    let (mut command, ca) = command(pg_restore, target)?;
    command
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
        .stdout(Stdio::null());
    Ok((spawn(&mut command, pg_restore)?, ca))
}

fn spawn(command: &mut Command, program: &Path) -> Result<Child, CopyError> {
    command.spawn().map_err(|source| CopyError::Spawn {
        program: program.display().to_string(),
        source,
    })
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

    /// A self-signed CA certificate (no key anywhere): what a server's CA Secret holds.
    const CA: &str = "-----BEGIN CERTIFICATE-----
MIIBhzCCAS2gAwIBAgIUM5mde2RM8sW39EY9Ba4hkg01GpowCgYIKoZIzj0EAwIw
GDEWMBQGA1UEAwwNZGJvcHMtdGVzdC1jYTAgFw0yNjExMjMxNjAyMzRaGA8yMTI2
MTAzMDE2MDIzNFowGDEWMBQGA1UEAwwNZGJvcHMtdGVzdC1jYTBZMBMGByqGSM49
AgEGCCqGSM49AwEHA0IABKQOr5+5TXJln10AG2/VcZapFi/vjtL7p8W7Ypmh1Jk7
bKaBWEt31H0MKhJOiG9Hc3GWgbrHIBMsfZrQIRO9WdGjUzBRMB0GA1UdDgQWBBSB
dnxKuXBDHx7O5jx+q0txKoHHwTAfBgNVHSMEGDAWgBSBdnxKuXBDHx7O5jx+q0tx
KoHHwTAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCIQDC0Cai1/GK
Ol98fJ8FRuGWtAumYCddWS/63BBiUTWWpwIgQijv8hPxnqBJzcpqui7zAzXpb0xz
+CVlVXECg9mtgIQ=
-----END CERTIFICATE-----
";

    /// An executable shell script `name` in `dir`.
    fn script(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn each_program_reads_its_servers_ca_which_is_removed_after_both_exited() {
        let dir = std::env::temp_dir().join(format!("dbops-copy-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.display();
        // pg_dump "dumps" its CA file; pg_restore keeps what it reads and its own CA file.
        let pg_dump = script(
            &dir,
            "pg_dump",
            &format!("echo \"$PGSSLROOTCERT\" > {d}/dump-ca-path\ncat \"$PGSSLROOTCERT\"\n"),
        );
        let pg_restore = script(
            &dir,
            "pg_restore",
            &format!(
                "cat > {d}/restored\ncp \"$PGSSLROOTCERT\" {d}/restore-ca\necho \"$PGSSLROOTCERT\" > {d}/restore-ca-path\n"
            ),
        );
        let mut server = Endpoint::new("db.example", 5432, dbops_api::TlsMode::VerifyFull);
        server.tls.ca = Some(dbops_shared::postgres::CaBundle::from_pem(CA.as_bytes()).unwrap());
        let credentials = Credentials {
            username: "admin".into(),
            password: "secret".into(),
        };
        let side = Side {
            server: &server,
            credentials: &credentials,
            database: "orders",
        };
        copy(
            &Programs {
                pg_dump: &pg_dump,
                pg_restore: &pg_restore,
            },
            &side,
            &side,
            "orders_owner",
            Contents::Everything,
        )
        .await
        .unwrap();
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        assert_eq!(read("restored"), CA, "pg_dump read the CA");
        assert_eq!(read("restore-ca"), CA, "pg_restore read the CA");
        for path in [read("dump-ca-path"), read("restore-ca-path")] {
            let path = std::path::PathBuf::from(path.trim());
            assert!(!path.exists(), "{} is removed", path.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
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
