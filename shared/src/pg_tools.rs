//! Running PostgreSQL's client programs (`pg_dump`, `pg_restore`) as child processes: the
//! connection in their environment, the tail of their stderr, and what that stderr says
//! went wrong. Each caller keeps its own flow (what it pipes where, what it makes of a
//! failure).
//!
//! The password reaches the program through `PGPASSWORD` in its environment only: never on
//! its command line (visible in `ps`), never in a log line. Variables of this process's
//! environment that could redirect the connection (`PGSERVICE`, `PGSERVICEFILE`,
//! `PGPASSFILE`, `PGOPTIONS`) are removed. The child is killed when its handle is dropped.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::postgres::{Credentials, Endpoint};
use dbops_api::SharedReason;
use tokio::io::AsyncReadExt;
use tokio::process::{ChildStderr, Command};
use tokio::task::JoinHandle;

/// pg_restore's flags for a restore as the database's owner (the controllers restore as
/// the role that is to own everything, never as the admin): stop at the first error, no
/// ownership or privileges from the archive, never a password prompt.
pub const RESTORE_AS_OWNER: [&str; 4] = [
    "--exit-on-error",
    "--no-owner",
    "--no-privileges",
    "--no-password",
];

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

/// How long `<program> --version` may take.
const VERSION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A client program's version, as `<program> --version` prints it: for example
/// `pg_dump (PostgreSQL) 18.6` or `pg_restore (PostgreSQL) 15.14 (Debian 15.14-0+deb12u1)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientVersion {
    /// The version itself: `18.6`, `15.14`.
    pub version: String,
    /// Its major version, comparable with a server's `server_version_num / 10000` (`18`;
    /// `9` for 9.6).
    pub major: u32,
}

impl ClientVersion {
    /// The first word of `line` that starts with a digit, and its leading number.
    pub fn parse(line: &str) -> Option<Self> {
        let version = line
            .split_whitespace()
            .find(|w| w.starts_with(|c: char| c.is_ascii_digit()))?;
        let major = version
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()?;
        Some(Self {
            version: version.to_string(),
            major,
        })
    }
}

/// `<program> --version` could not be run or read.
#[derive(Debug, thiserror::Error)]
#[error("{program} --version: {message}")]
pub struct VersionError {
    pub program: String,
    pub message: String,
}

/// Runs `<program> --version` (at most [`VERSION_TIMEOUT`]) and reads its version.
pub async fn client_version(program: &Path) -> Result<ClientVersion, VersionError> {
    let error = |message: String| VersionError {
        program: program.display().to_string(),
        message,
    };
    let run = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(VERSION_TIMEOUT, run)
        .await
        .map_err(|_| error(format!("no answer within {VERSION_TIMEOUT:?}")))?
        .map_err(|e| error(e.to_string()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(error(format!(
            "{}: {}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stderr))
        )));
    }
    ClientVersion::parse(&stdout).ok_or_else(|| error(format!("no version in {:?}", stdout.trim())))
}

/// The first major whose pg_restore (and pg_dump's plain output) sets `transaction_timeout`,
/// which servers before it do not have: `SET transaction_timeout = 0` fails there, and with
/// it a restore in one transaction.
pub const SETS_TRANSACTION_TIMEOUT: u32 = 17;

/// A client program whose version was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub path: PathBuf,
    pub version: ClientVersion,
}

impl std::fmt::Display for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.version.version, self.path.display())
    }
}

/// Why no client program fits: a CamelCase reason and a message naming the versions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub reason: SharedReason,
    pub message: String,
}

/// The client programs a controller may run, of one major or several: the `--pg-dump`
/// and `--pg-restore` programs and those in each `--pg-bin-dir` (for example
/// `/usr/lib/postgresql/13/bin` … `/usr/lib/postgresql/18/bin`). Each operation takes the
/// major that suits its servers ([`pick_dump`], [`pick_restore`], [`pick_copy`]); the
/// versions are asked of the programs (`--version`) at each use.
#[derive(Debug, Clone, Default)]
pub struct Clients {
    pg_dump: Vec<PathBuf>,
    pg_restore: Vec<PathBuf>,
}

impl Clients {
    /// `pg_dump` and `pg_restore` first (either may be absent: a controller that runs
    /// only one of them), then the programs of each directory in `bin_dirs`.
    pub fn new(
        pg_dump: Option<PathBuf>,
        pg_restore: Option<PathBuf>,
        bin_dirs: &[PathBuf],
    ) -> Self {
        let of = |first: Option<PathBuf>, name: &str| {
            first
                .into_iter()
                .chain(bin_dirs.iter().map(|dir| dir.join(name)))
                .collect()
        };
        Self {
            pg_dump: of(pg_dump, "pg_dump"),
            pg_restore: of(pg_restore, "pg_restore"),
        }
    }

    /// Every pg_dump whose version could be read; the others are logged and left out.
    pub async fn pg_dumps(&self) -> Vec<Program> {
        probe(&self.pg_dump).await
    }

    /// Every pg_restore whose version could be read; the others are logged and left out.
    pub async fn pg_restores(&self) -> Vec<Program> {
        probe(&self.pg_restore).await
    }

    /// The pg_restore for an archive of pg_dump `archive_major` (unknown: taken as the
    /// newest pg_restore's) into a server of `server_version_num` (`server_version`
    /// in words): [`pick_restore`] among [`Clients::pg_restores`].
    pub async fn pg_restore_for(
        &self,
        archive_major: Option<u32>,
        server_version_num: i32,
        server_version: &str,
    ) -> Result<PathBuf, Refusal> {
        let target_major = u32::try_from(server_version_num / 10000).unwrap_or(0);
        let pg_restores = self.pg_restores().await;
        let archive_major = archive_major
            .or_else(|| pg_restores.iter().map(|p| p.version.major).max())
            .unwrap_or(0);
        pick_restore(&pg_restores, archive_major, target_major, server_version)
            .map(|p| p.path.clone())
    }
}

async fn probe(paths: &[PathBuf]) -> Vec<Program> {
    let mut found = Vec::new();
    for path in paths {
        match client_version(path).await {
            Ok(version) => found.push(Program {
                path: path.clone(),
                version,
            }),
            Err(error) => tracing::warn!(%error, "a client program is left out"),
        }
    }
    found
}

/// Whether pg_restore of `restore_major` can restore into a server of `target_major`: its
/// fixed settings exist there ([`SETS_TRANSACTION_TIMEOUT`]).
pub fn restores_into(restore_major: u32, target_major: u32) -> bool {
    restore_major < SETS_TRANSACTION_TIMEOUT || target_major >= SETS_TRANSACTION_TIMEOUT
}

/// The pg_dump for a Backup of a server of `server_major`: the oldest major that dumps it
/// (pg_dump refuses servers newer than itself), so that the pg_restore of the server's own
/// major, or of any newer one, reads the archive. `PgDumpTooOld` when every one is older.
pub fn pick_dump<'a>(
    pg_dumps: &'a [Program],
    server_major: u32,
    server_version: &str,
) -> Result<&'a Program, Refusal> {
    pg_dumps
        .iter()
        .filter(|p| p.version.major >= server_major)
        .min_by_key(|p| p.version.major)
        .ok_or_else(|| Refusal {
            reason: SharedReason::PgDumpTooOld,
            message: match pg_dumps.iter().max_by_key(|p| p.version.major) {
                Some(newest) => format!(
                    "pg_dump {} cannot dump PostgreSQL {server_version}: pg_dump dumps servers of its own major version or older only, and no pg_dump here is newer (one of major {server_major} or newer is needed)",
                    newest.version.version
                ),
                None => format!("no pg_dump here could be run to dump PostgreSQL {server_version}"),
            },
        })
}

/// The pg_restore for an archive written by pg_dump of `archive_major` into a server of
/// `target_major`: one that reads the archive (of that major or newer) and whose settings
/// the target has ([`restores_into`]); the target's own major first, else the newest older
/// one, else the oldest newer one.
pub fn pick_restore<'a>(
    pg_restores: &'a [Program],
    archive_major: u32,
    target_major: u32,
    target_version: &str,
) -> Result<&'a Program, Refusal> {
    let readers: Vec<&Program> = pg_restores
        .iter()
        .filter(|p| p.version.major >= archive_major)
        .collect();
    if readers.is_empty() {
        return Err(Refusal {
            reason: SharedReason::PgRestoreTooOld,
            message: match pg_restores.iter().max_by_key(|p| p.version.major) {
                Some(newest) => format!(
                    "pg_restore {} cannot read an archive of pg_dump {archive_major}: pg_restore reads archives of its own major version or older only, and no pg_restore here is newer",
                    newest.version.version
                ),
                None => "no pg_restore here could be run".to_string(),
            },
        });
    }
    let fit = |p: &&Program| restores_into(p.version.major, target_major);
    let exact = readers
        .iter()
        .copied()
        .find(|p| p.version.major == target_major);
    let older = readers
        .iter()
        .copied()
        .filter(|p| p.version.major < target_major)
        .filter(fit)
        .max_by_key(|p| p.version.major);
    let newer = readers
        .iter()
        .copied()
        .filter(|p| p.version.major > target_major)
        .filter(fit)
        .min_by_key(|p| p.version.major);
    exact.or(older).or(newer).ok_or_else(|| Refusal {
        reason: SharedReason::PgRestoreTooNew,
        message: format!(
            "no pg_restore here restores an archive of pg_dump {archive_major} into PostgreSQL {target_version}: the ones that read it ({}) set transaction_timeout, which servers before {SETS_TRANSACTION_TIMEOUT} do not have (a pg_restore of a major from {archive_major} to {} is needed)",
            readers
                .iter()
                .map(|p| p.version.version.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            SETS_TRANSACTION_TIMEOUT - 1
        ),
    })
}

/// The pg_dump and pg_restore that copy a database from a server of `source_major` into
/// one of `target_major` (a newer major, or the same): a pg_dump that dumps the source,
/// the target's own major first, else the newest older one, else the oldest newer one;
/// with the pg_restore [`pick_restore`] takes for its archive.
pub fn pick_copy<'a>(
    pg_dumps: &'a [Program],
    pg_restores: &'a [Program],
    (source_major, source_version): (u32, &str),
    (target_major, target_version): (u32, &str),
) -> Result<(&'a Program, &'a Program), Refusal> {
    let mut dumps: Vec<&Program> = pg_dumps
        .iter()
        .filter(|p| p.version.major >= source_major)
        .collect();
    // The target's major, then older ones newest first, then newer ones oldest first.
    dumps.sort_by_key(|p| {
        let major = p.version.major;
        match major.cmp(&target_major) {
            std::cmp::Ordering::Equal => (0, 0),
            std::cmp::Ordering::Less => (1, u32::MAX - major),
            std::cmp::Ordering::Greater => (2, major),
        }
    });
    let mut first_refusal = None;
    for dump in dumps {
        match pick_restore(
            pg_restores,
            dump.version.major,
            target_major,
            target_version,
        ) {
            Ok(restore) => return Ok((dump, restore)),
            Err(refusal) => {
                first_refusal.get_or_insert(refusal);
            }
        }
    }
    Err(match first_refusal {
        Some(refusal) => refusal,
        None => pick_dump(pg_dumps, source_major, source_version)
            .err()
            .unwrap_or_else(|| Refusal {
                reason: SharedReason::PgDumpTooOld,
                message: format!("no pg_dump here dumps PostgreSQL {source_version}"),
            }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sh` as [`command`] sets it up to reach `server` as `u` (with `password`) in `db`.
    fn sh(server: &Endpoint, password: &str) -> (Command, Option<RootCertFile>) {
        command(
            Path::new("sh"),
            &Connection {
                server,
                username: "u",
                password,
                database: "db",
                application: "test",
            },
        )
        .unwrap()
    }

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
        let (mut c, _) = sh(&server, "s3cret");
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
        let (mut c, file) = sh(&server, "p");
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
        let (c, file) = sh(&server, "p");
        assert!(file.is_none());
        let root = c
            .as_std()
            .get_envs()
            .find(|(k, _)| *k == "PGSSLROOTCERT")
            .and_then(|(_, v)| v);
        assert_eq!(root, Some(std::ffi::OsStr::new("system")));
    }

    #[test]
    fn client_versions_are_read_from_what_the_programs_print() {
        let v = ClientVersion::parse("pg_dump (PostgreSQL) 18.6\n").unwrap();
        assert_eq!((v.version.as_str(), v.major), ("18.6", 18));
        let v =
            ClientVersion::parse("pg_restore (PostgreSQL) 15.14 (Debian 15.14-0+deb12u1)").unwrap();
        assert_eq!((v.version.as_str(), v.major), ("15.14", 15));
        let v = ClientVersion::parse("pg_dump (PostgreSQL) 18beta1").unwrap();
        assert_eq!(v.major, 18);
        let v = ClientVersion::parse("pg_dump (PostgreSQL) 9.6.24").unwrap();
        assert_eq!(v.major, 9);
        assert_eq!(ClientVersion::parse("pg_dump (PostgreSQL)"), None);
        assert_eq!(ClientVersion::parse(""), None);
    }

    fn programs(versions: &[&str], name: &str) -> Vec<Program> {
        versions
            .iter()
            .map(|v| Program {
                path: PathBuf::from(format!("/pg/{v}/{name}")),
                version: ClientVersion::parse(v).unwrap(),
            })
            .collect()
    }

    #[test]
    fn a_backup_takes_the_oldest_pg_dump_that_dumps_the_server() {
        let dumps = programs(&["18.6", "15.14"], "pg_dump");
        let pick = |major, version| pick_dump(&dumps, major, version).map(|p| p.version.major);
        assert_eq!(
            pick(13, "13.23"),
            Ok(15),
            "restorable into 13 by pg_restore 15"
        );
        assert_eq!(pick(15, "15.14"), Ok(15));
        assert_eq!(pick(17, "17.10"), Ok(18));
        assert_eq!(pick(18, "18.4"), Ok(18));
        let only15 = programs(&["15.14"], "pg_dump");
        let refusal = pick_dump(&only15, 18, "18.4").unwrap_err();
        assert_eq!(refusal.reason, "PgDumpTooOld");
        assert!(
            refusal.message.contains("PostgreSQL 18.4") && refusal.message.contains("15.14"),
            "names both versions: {refusal}"
        );
    }

    #[test]
    fn a_restore_takes_a_pg_restore_that_reads_the_archive_and_speaks_the_targets_settings() {
        let restores = programs(&["15.14", "18.6"], "pg_restore");
        let pick = |archive, target| {
            pick_restore(&restores, archive, target, &format!("{target}.0"))
                .map(|p| p.version.major)
                .map_err(|r| r.reason)
        };
        // pg_restore 18 sets transaction_timeout: not into 13 or 15.
        assert_eq!(pick(15, 13), Ok(15));
        assert_eq!(pick(15, 15), Ok(15));
        assert_eq!(pick(15, 17), Ok(15), "the newest older than the target");
        assert_eq!(pick(15, 18), Ok(18), "the target's own");
        assert_eq!(pick(18, 18), Ok(18));
        assert_eq!(pick(17, 17), Ok(18), "the oldest newer one that reads it");
        assert_eq!(
            pick(18, 13),
            Err(SharedReason::PgRestoreTooNew),
            "18's archive never goes into 13"
        );
        let only15 = programs(&["15.14"], "pg_restore");
        let refusal = pick_restore(&only15, 18, 18, "18.4").unwrap_err();
        assert_eq!(refusal.reason, "PgRestoreTooOld");
        assert!(refusal.message.contains("pg_dump 18") && refusal.message.contains("15.14"));
        assert!(restores_into(16, 13) && restores_into(18, 17) && !restores_into(17, 16));
    }

    #[test]
    fn a_copy_takes_the_targets_major_or_the_nearest_that_works() {
        let dumps = programs(&["15.14", "18.6"], "pg_dump");
        let restores = programs(&["15.14", "18.6"], "pg_restore");
        let pick = |source: u32, target: u32| {
            pick_copy(
                &dumps,
                &restores,
                (source, &format!("{source}.1")),
                (target, &format!("{target}.1")),
            )
            .map(|(d, r)| (d.version.major, r.version.major))
            .map_err(|r| r.reason)
        };
        assert_eq!(pick(13, 18), Ok((18, 18)));
        assert_eq!(pick(15, 17), Ok((15, 15)));
        assert_eq!(
            pick(13, 14),
            Ok((15, 15)),
            "none of 14: the oldest newer one"
        );
        assert_eq!(pick(17, 18), Ok((18, 18)));
        assert_eq!(pick(16, 17), Ok((18, 18)), "only 18 dumps 16");
        let newest = programs(&["18.6"], "pg_dump");
        let newest_restore = programs(&["18.6"], "pg_restore");
        let only = |source: u32, target: u32| {
            pick_copy(&newest, &newest_restore, (source, "s"), (target, "t"))
                .map(|(d, r)| (d.version.major, r.version.major))
                .map_err(|r| r.reason)
        };
        assert_eq!(only(13, 18), Ok((18, 18)));
        assert_eq!(only(13, 16), Err(SharedReason::PgRestoreTooNew));
        let old = programs(&["15.14"], "pg_dump");
        let refusal = pick_copy(&old, &restores, (17, "17.10"), (18, "18.4")).unwrap_err();
        assert_eq!(refusal.reason, "PgDumpTooOld");
        assert!(refusal.message.contains("17.10") && refusal.message.contains("15.14"));
    }

    #[test]
    fn clients_list_the_flag_programs_first_then_each_directory() {
        let c = Clients::new(
            Some("/opt/pg_dump".into()),
            None,
            &[
                "/usr/lib/postgresql/13/bin".into(),
                "/usr/lib/postgresql/18/bin".into(),
            ],
        );
        assert_eq!(
            c.pg_dump,
            [
                PathBuf::from("/opt/pg_dump"),
                "/usr/lib/postgresql/13/bin/pg_dump".into(),
                "/usr/lib/postgresql/18/bin/pg_dump".into()
            ]
        );
        assert_eq!(
            c.pg_restore,
            [
                PathBuf::from("/usr/lib/postgresql/13/bin/pg_restore"),
                "/usr/lib/postgresql/18/bin/pg_restore".into()
            ]
        );
    }

    #[tokio::test]
    async fn a_programs_version_is_asked_of_the_program() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        let good = script(
            "pg_dump",
            "[ \"$1\" = --version ] && echo 'pg_dump (PostgreSQL) 17.2'",
        );
        let v = client_version(&good).await.unwrap();
        assert_eq!((v.version.as_str(), v.major), ("17.2", 17));
        let failing = script("broken", "echo 'no such library' >&2; exit 3");
        let e = client_version(&failing).await.unwrap_err().to_string();
        assert!(
            e.contains("broken --version") && e.contains("no such library"),
            "{e}"
        );
        let missing = client_version(&dir.path().join("absent")).await;
        assert!(missing.is_err());
    }
}
