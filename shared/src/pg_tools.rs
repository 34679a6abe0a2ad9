//! Running PostgreSQL's client programs (`pg_dump`, `pg_restore`) as child processes: the
//! connection in their environment, the tail of their stderr, and what that stderr says
//! went wrong. Each caller keeps its own flow (what it pipes where, what it makes of a
//! failure).
//!
//! The password reaches the program through `PGPASSWORD` in its environment only: never on
//! its command line (visible in `ps`), never in a log line. Variables of this process's
//! environment that could redirect the connection (`PGSERVICE`, `PGSERVICEFILE`,
//! `PGPASSFILE`, `PGOPTIONS`) are removed. The child is killed when its handle is dropped.

use std::path::Path;
use std::process::Stdio;

use crate::postgres::{Credentials, Endpoint};
use tokio::io::AsyncReadExt;
use tokio::process::{ChildStderr, Command};
use tokio::task::JoinHandle;

/// How much of a program's stderr is kept for an error message: its last 4 KiB.
pub const STDERR_KEPT: usize = 4096;

/// Where a client program connects, as whom, to which database, under which
/// `application_name`.
pub struct Connection<'a> {
    pub server: &'a Endpoint,
    pub username: &'a str,
    pub password: &'a str,
    pub database: &'a str,
    pub application: &'a str,
}

impl<'a> Connection<'a> {
    /// A connection as the role of `credentials` (an admin Secret's).
    pub fn of(
        server: &'a Endpoint,
        credentials: &'a Credentials,
        database: &'a str,
        application: &'a str,
    ) -> Self {
        Self {
            server,
            username: &credentials.username,
            password: &credentials.password,
            database,
            application,
        }
    }
}

/// The server's CA in a file for libpq's `PGSSLROOTCERT`: mode 0600, in a directory of
/// its own, removed when dropped (after the program ended).
pub struct RootCertFile {
    dir: tempfile::TempDir,
}

impl RootCertFile {
    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.crt")
    }
}

/// `program` with the connection in its environment, stderr piped and killed on drop;
/// the caller adds the arguments, stdin and stdout. With a CA of the server's own, the
/// returned file holds it: keep it until the program has ended.
pub fn command(
    program: &Path,
    to: &Connection<'_>,
) -> std::io::Result<(Command, Option<RootCertFile>)> {
    let mut c = Command::new(program);
    let tls = &to.server.tls;
    let root_cert = match &tls.ca {
        Some(ca) if tls.mode != dbops_api::TlsMode::Disable => {
            let dir = tempfile::Builder::new().prefix("dbops-ca-").tempdir()?;
            let file = RootCertFile { dir };
            write_private(&file.path(), ca.pem())?;
            c.env("PGSSLROOTCERT", file.path());
            Some(file)
        }
        // libpq's own default for verify-ca/verify-full is ~/.postgresql/root.crt: the
        // system's roots are asked for by name.
        _ if tls.mode.verifies() => {
            c.env("PGSSLROOTCERT", "system");
            None
        }
        _ => {
            c.env_remove("PGSSLROOTCERT");
            None
        }
    };
    c.env("PGHOST", &to.server.key.host)
        .env("PGPORT", to.server.key.port.to_string())
        .env("PGUSER", to.username)
        .env("PGPASSWORD", to.password)
        .env("PGDATABASE", to.database)
        .env("PGSSLMODE", tls.mode.as_str())
        .env("PGCONNECT_TIMEOUT", "10")
        .env("PGAPPNAME", to.application)
        // Nothing from this process's environment may redirect the connection.
        .env_remove("PGSERVICE")
        .env_remove("PGSERVICEFILE")
        .env_remove("PGPASSFILE")
        .env_remove("PGOPTIONS")
        .env_remove("PGSSLCERT")
        .env_remove("PGSSLKEY")
        .env_remove("PGSSLCRL")
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    Ok((c, root_cert))
}

/// Writes `bytes` to a new file readable by this user only (0600).
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Reads a program's stderr to the end in a task, which returns its last [`STDERR_KEPT`]
/// bytes (cut at a character boundary), trimmed; empty when stderr was not piped.
pub fn keep_stderr(stderr: Option<ChildStderr>) -> JoinHandle<String> {
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
        tail(&String::from_utf8_lossy(&kept))
    })
}

/// The last [`STDERR_KEPT`] bytes of `text`, starting at a character boundary, trimmed.
fn tail(text: &str) -> String {
    let start = text.len().saturating_sub(STDERR_KEPT);
    let start = (start..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(text.len());
    text[start..].trim().to_string()
}

/// Whether a program's stderr says the server refused the credentials (retrying cannot
/// help).
pub fn is_auth_failure(stderr: &str) -> bool {
    stderr.contains("password authentication failed")
        || stderr.contains("no password supplied")
        || stderr.contains("role") && stderr.contains("does not exist") && stderr.contains("FATAL")
}

/// Whether a program's stderr says the server could not be reached or went away.
pub fn is_connection_failure(stderr: &str) -> bool {
    [
        "could not connect",
        "Connection refused",
        "could not translate host name",
        "server closed the connection",
        "timeout expired",
        "the database system is shutting down",
        "the database system is starting up",
        "terminating connection",
    ]
    .iter()
    .any(|s| stderr.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_is_sorted_by_what_fixes_it() {
        let auth = "pg_dump: error: connection to server at \"127.0.0.1\", port 5432 failed: \
                    FATAL:  password authentication failed for user \"postgres\"";
        assert!(is_auth_failure(auth));
        assert!(!is_connection_failure(auth));
        let down = "pg_restore: error: connection to server at \"127.0.0.1\", port 1 failed: \
                    Connection refused";
        assert!(is_connection_failure(down));
        assert!(!is_auth_failure(down));
        let other = "pg_dump: error: query failed: ERROR:  permission denied";
        assert!(!is_auth_failure(other) && !is_connection_failure(other));
    }

    #[test]
    fn the_tail_keeps_the_last_bytes_on_a_character_boundary() {
        assert_eq!(tail("  short\n"), "short");
        let long = format!("{}é{}", "a".repeat(10), "b".repeat(STDERR_KEPT - 1));
        let kept = tail(&long);
        assert_eq!(kept, "b".repeat(STDERR_KEPT - 1));
    }

    #[tokio::test]
    async fn the_password_is_in_the_environment_never_on_the_command_line() {
        let server = Endpoint::new("127.0.0.1", 5432, dbops_api::TlsMode::Disable);
        let (mut c, _) = command(
            Path::new("sh"),
            &Connection {
                server: &server,
                username: "u",
                password: "s3cret",
                database: "db",
                application: "test",
            },
        )
        .unwrap();
        let out = c
            .args([
                "-c",
                "echo \"$PGPASSWORD $PGUSER $PGDATABASE $PGPORT $PGSSLMODE\" >&2; echo \"$0 $*\"",
            ])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stderr).trim(),
            "s3cret u db 5432 disable"
        );
        assert!(!String::from_utf8_lossy(&out.stdout).contains("s3cret"));
    }

    #[tokio::test]
    async fn a_servers_ca_reaches_the_program_in_a_private_file_removed_after() {
        use std::os::unix::fs::PermissionsExt;
        let ca = rcgen::generate_simple_self_signed(vec!["db.example".to_string()])
            .unwrap()
            .cert
            .pem();
        let mut server = Endpoint::new("db.example", 5432, dbops_api::TlsMode::VerifyFull);
        server.tls.ca = Some(crate::postgres::CaBundle::from_pem(ca.as_bytes()).unwrap());
        let (mut c, file) = command(
            Path::new("sh"),
            &Connection {
                server: &server,
                username: "u",
                password: "p",
                database: "db",
                application: "test",
            },
        )
        .unwrap();
        let file = file.expect("a CA file");
        let path = file.path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let out = c
            .args(["-c", "echo \"$PGSSLMODE\"; cat \"$PGSSLROOTCERT\""])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.starts_with("verify-full\n-----BEGIN CERTIFICATE-----"),
            "{stdout}"
        );
        drop(file);
        assert!(!path.exists(), "the CA file is removed");

        // Without a CA of its own, verify-full asks libpq for the system's roots.
        server.tls.ca = None;
        let (c, file) = command(
            Path::new("sh"),
            &Connection {
                server: &server,
                username: "u",
                password: "p",
                database: "db",
                application: "test",
            },
        )
        .unwrap();
        assert!(file.is_none());
        let root = c
            .as_std()
            .get_envs()
            .find(|(k, _)| *k == "PGSSLROOTCERT")
            .and_then(|(_, v)| v);
        assert_eq!(root, Some(std::ffi::OsStr::new("system")));
    }
}
