//! Throwaway PostgreSQL servers from Debian's `postgresql` package: `initdb` in a
//! temporary directory, the `postgres` user when this process is root, a free loopback
//! port, and a superuser `postgres` with a random password (scram-sha-256 over TCP).
//!
//! Servers of other major versions ([`PgServer::start_major`]) come from the packages
//! pinned in `e2e/postgres.versions`, which `e2e/install` puts into the cache
//! ([`bin_dir`], [`client_bin_dir`], [`server_majors`]).
//!
//! Every DDL statement the server runs is logged (`log_statement=ddl`), so a test can see
//! what a controller did to the schema and when ([`PgServer::ddl_statements`]).

pub mod admin;
mod binaries;
mod catalog;
mod text;

pub use binaries::{bin_dir, client_bin_dir, server_majors};
pub use text::{quote_ident, quote_literal, redact_passwords};

pub(crate) use binaries::chown_to_postgres;
use binaries::runnable_by_postgres;
use text::is_statement_line;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::distr::{Alphanumeric, SampleString};
use tokio_postgres::{Client, NoTls};

use crate::paths;
use crate::process::{Spec, Supervised, free_port, is_root, log_tail};

/// The superuser the harness creates.
pub const SUPERUSER: &str = "postgres";

/// Settings for a server that Migrations in Logical mode can replicate from
/// ([`PgServer::start_with_settings`]): `wal_level=logical`, and room for the replication
/// slots and WAL senders of several Migrations at once.
pub const LOGICAL_REPLICATION: &[(&str, &str)] = &[
    ("wal_level", "logical"),
    ("max_replication_slots", "10"),
    ("max_wal_senders", "10"),
];

/// Settings for a server whose every statement is recorded, to show that none carries a
/// secret (the dev environment's servers, [`statement_recording`]): every statement and
/// every connection with its authentication method in the log.
pub const LOG_EVERYTHING: &[(&str, &str)] = &[("log_statement", "all"), ("log_connections", "on")];

/// `pg_stat_statements`, loaded at start and keeping every statement, utility statements
/// included ([`statement_recording`], where the server's installation has the module).
pub const PG_STAT_STATEMENTS: &[(&str, &str)] = &[
    ("shared_preload_libraries", "pg_stat_statements"),
    ("pg_stat_statements.track", "all"),
    ("pg_stat_statements.track_utility", "on"),
];

/// [`LOG_EVERYTHING`], and [`PG_STAT_STATEMENTS`] when the installation of `bin` ships the
/// module ([`ships_library`]).
pub fn statement_recording(bin: &Path) -> Vec<(&'static str, &'static str)> {
    let mut settings = LOG_EVERYTHING.to_vec();
    if ships_library(bin, "pg_stat_statements") {
        settings.extend_from_slice(PG_STAT_STATEMENTS);
    }
    settings
}

/// Whether the installation whose programs are in `bin` has the loadable module `library`
/// (Debian's `lib/`, the cached packages' `lib/postgresql/`).
pub fn ships_library(bin: &Path, library: &str) -> bool {
    let file = format!("{library}.so");
    ["lib", "lib/postgresql"]
        .iter()
        .any(|dir| bin.join("..").join(dir).join(&file).is_file())
}

/// Each server log line starts with time, pid, user@database and the session's
/// application_name.
const LOG_LINE_PREFIX: &str = "%m [%p] %q%u@%d app=%a ";

/// A PostgreSQL server; stopped (fast shutdown) and deleted when dropped.
#[derive(Debug)]
pub struct PgServer {
    name: String,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    port: u16,
    password: String,
    bin: PathBuf,
    process: Option<Supervised>,
    /// `ssl=on` with this certificate and key (files in the server's directory).
    tls: bool,
    /// Extra `-c name=value` settings of every start ([`PgServer::start_with_settings`]).
    settings: Vec<(String, String)>,
}

/// Connects with `config`, without TLS; the connection task runs on the current runtime.
pub async fn connect_config(config: &tokio_postgres::Config) -> Result<Client> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The one value of a query that returns one row of one column (`SELECT count(*) ...`,
/// `SHOW ...`).
pub async fn try_scalar<T: tokio_postgres::types::FromSqlOwned>(
    client: &Client,
    sql: &str,
) -> std::result::Result<T, tokio_postgres::Error> {
    Ok(client.query_one(sql, &[]).await?.get(0))
}

/// [`try_scalar`] for a test: an error panics with the query.
pub async fn scalar<T: tokio_postgres::types::FromSqlOwned>(client: &Client, sql: &str) -> T {
    try_scalar(client, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

impl PgServer {
    /// initdb and start a server in a new temporary directory.
    pub async fn start(name: &str) -> Result<Self> {
        Self::start_with_tls(name, None).await
    }

    /// [`PgServer::start`], with TLS (`ssl=on`) on this certificate when given; plain TCP
    /// stays allowed, as in a default `pg_hba.conf`.
    pub async fn start_with_tls(name: &str, cert: Option<&crate::tls::ServerCert>) -> Result<Self> {
        Self::start_tmp(name, paths::postgres_bin_dir()?, cert).await
    }

    /// [`PgServer::start`] with extra settings passed as `-c name=value` at every start
    /// (for example `wal_level=logical`, `max_replication_slots`, `max_wal_senders`).
    pub async fn start_with_settings(name: &str, settings: &[(&str, &str)]) -> Result<Self> {
        Self::start_tmp_with(name, paths::postgres_bin_dir()?, None, settings).await
    }

    /// [`PgServer::start_major`] with extra settings, as [`PgServer::start_with_settings`].
    pub async fn start_major_with_settings(
        name: &str,
        major: u32,
        settings: &[(&str, &str)],
    ) -> Result<Self> {
        let bin = runnable_by_postgres(&bin_dir(major)?)?;
        Self::start_tmp_with(name, bin, None, settings).await
    }

    /// [`PgServer::start`] with a server of this major version ([`bin_dir`]): Debian's
    /// package for its own major, else the package `e2e/install` put into the cache.
    pub async fn start_major(name: &str, major: u32) -> Result<Self> {
        Self::start_major_with_tls(name, major, None).await
    }

    /// [`PgServer::start_major`], with TLS as [`PgServer::start_with_tls`] does.
    pub async fn start_major_with_tls(
        name: &str,
        major: u32,
        cert: Option<&crate::tls::ServerCert>,
    ) -> Result<Self> {
        let bin = runnable_by_postgres(&bin_dir(major)?)?;
        Self::start_tmp(name, bin, cert).await
    }

    async fn start_tmp(
        name: &str,
        bin: PathBuf,
        cert: Option<&crate::tls::ServerCert>,
    ) -> Result<Self> {
        Self::start_tmp_with(name, bin, cert, &[]).await
    }

    async fn start_tmp_with(
        name: &str,
        bin: PathBuf,
        cert: Option<&crate::tls::ServerCert>,
        settings: &[(&str, &str)],
    ) -> Result<Self> {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("dbops-pg-{name}-"))
            .tempdir()?;
        let mut server = Self::start_in_bin(name, tmp.path(), None, cert, settings, bin).await?;
        server._tmp = Some(tmp);
        Ok(server)
    }

    /// From now on every TCP login but the harness's own superuser must use TLS
    /// (`hostssl`; plain TCP is rejected), so whatever else connects is proven to speak
    /// TLS. Needs a server started with a certificate.
    pub async fn require_tls_except_superuser(&self) -> Result<()> {
        if !self.tls {
            bail!("{}: started without a certificate", self.name);
        }
        let hba = format!(
            "local all all trust\n\
             host all {SUPERUSER} 127.0.0.1/32 scram-sha-256\n\
             hostssl all all 127.0.0.1/32 scram-sha-256\n\
             hostssl all all ::1/128 scram-sha-256\n\
             host all all 0.0.0.0/0 reject\n\
             host all all ::/0 reject\n"
        );
        let path = self.dir.join("data").join("pg_hba.conf");
        std::fs::write(&path, hba).with_context(|| format!("writing {}", path.display()))?;
        let client = self.connect_as_superuser().await?;
        let reloaded: bool = client
            .query_one("SELECT pg_reload_conf()", &[])
            .await?
            .get(0);
        if !reloaded {
            bail!("{}: pg_reload_conf() failed", self.name);
        }
        Ok(())
    }

    /// Writes the certificate and key where the server reads them (the key readable by
    /// the server's user only, as PostgreSQL demands).
    fn install_tls(&mut self, cert: &crate::tls::ServerCert) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let (crt, key) = (self.dir.join("server.crt"), self.dir.join("server.key"));
        std::fs::write(&crt, &cert.cert_pem)?;
        std::fs::write(&key, &cert.key_pem)?;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
        if is_root() {
            chown_to_postgres(&crt)?;
            chown_to_postgres(&key)?;
        }
        self.tls = true;
        Ok(())
    }

    /// initdb (unless already done) into `dir` and start; for the dev environment, where
    /// the directory and port outlive one process.
    pub async fn start_in(name: &str, dir: &Path, port: Option<u16>) -> Result<Self> {
        Self::start_in_with_tls(name, dir, port, None).await
    }

    /// [`PgServer::start_in`], with TLS (`ssl=on`) on this certificate when given, as
    /// [`PgServer::start_with_tls`] does.
    pub async fn start_in_with_tls(
        name: &str,
        dir: &Path,
        port: Option<u16>,
        cert: Option<&crate::tls::ServerCert>,
    ) -> Result<Self> {
        Self::start_in_with(name, dir, port, cert, &[]).await
    }

    /// [`PgServer::start_in_with_tls`] with extra settings, as
    /// [`PgServer::start_with_settings`] (the dev environment's [`LOGICAL_REPLICATION`]).
    pub async fn start_in_with(
        name: &str,
        dir: &Path,
        port: Option<u16>,
        cert: Option<&crate::tls::ServerCert>,
        settings: &[(&str, &str)],
    ) -> Result<Self> {
        Self::start_in_bin(name, dir, port, cert, settings, paths::postgres_bin_dir()?).await
    }

    /// [`PgServer::start_in_with`] with a server of this major version ([`bin_dir`]), as
    /// [`PgServer::start_major`] (the dev environment's migration target).
    pub async fn start_major_in_with(
        name: &str,
        major: u32,
        dir: &Path,
        port: Option<u16>,
        cert: Option<&crate::tls::ServerCert>,
        settings: &[(&str, &str)],
    ) -> Result<Self> {
        let bin = runnable_by_postgres(&bin_dir(major)?)?;
        Self::start_in_bin(name, dir, port, cert, settings, bin).await
    }

    async fn start_in_bin(
        name: &str,
        dir: &Path,
        port: Option<u16>,
        cert: Option<&crate::tls::ServerCert>,
        settings: &[(&str, &str)],
        bin: PathBuf,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut server = Self::init_in(name, dir, port, bin)?;
        server.settings = settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if let Some(cert) = cert {
            server.install_tls(cert)?;
        }
        server.start_again().await?;
        Ok(server)
    }

    fn init_in(name: &str, dir: &Path, port: Option<u16>, bin: PathBuf) -> Result<Self> {
        let password_file = dir.join("superuser-password");
        let data = dir.join("data");
        let user = is_root().then(|| "postgres".to_string());
        if !data.join("PG_VERSION").is_file() {
            let password = Alphanumeric.sample_string(&mut rand::rng(), 24);
            std::fs::write(&password_file, &password)?;
            std::fs::create_dir_all(dir.join("socket"))?;
            std::fs::create_dir_all(&data)?;
            if user.is_some() {
                chown_to_postgres(dir)?;
            }
            let mut initdb = std::process::Command::new(if user.is_some() {
                PathBuf::from("setpriv")
            } else {
                bin.join("initdb")
            });
            if user.is_some() {
                initdb.args([
                    "--reuid",
                    "postgres",
                    "--regid",
                    "postgres",
                    "--init-groups",
                    "--",
                ]);
                initdb.arg(bin.join("initdb"));
            }
            let out = initdb
                .arg("-D")
                .arg(&data)
                .args([
                    "-U",
                    SUPERUSER,
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                ])
                .args(["-E", "UTF8", "--locale=C.UTF-8", "--no-sync"])
                .arg(format!("--pwfile={}", password_file.display()))
                .output()
                .context("running initdb")?;
            if !out.status.success() {
                bail!(
                    "initdb for {name} failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        let password = std::fs::read_to_string(&password_file)?.trim().to_string();
        let port = match port {
            Some(p) => p,
            None => free_port()?,
        };
        Ok(Self {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            _tmp: None,
            port,
            password,
            bin,
            process: None,
            tls: false,
            settings: Vec::new(),
        })
    }

    /// Starts the server (again, after [`PgServer::stop`]) on the same port and data.
    pub async fn start_again(&mut self) -> Result<()> {
        if self.process.is_some() {
            return Ok(());
        }
        let tls = if self.tls {
            vec![
                "-c".to_string(),
                "ssl=on".to_string(),
                "-c".to_string(),
                format!("ssl_cert_file={}", self.dir.join("server.crt").display()),
                "-c".to_string(),
                format!("ssl_key_file={}", self.dir.join("server.key").display()),
            ]
        } else {
            vec![]
        };
        let settings = self
            .settings
            .iter()
            .flat_map(|(k, v)| ["-c".to_string(), format!("{k}={v}")]);
        let spec = Spec::new(format!("postgres-{}", self.name), self.bin.join("postgres"))
            .args(tls)
            .args([
                "-D".to_string(),
                self.dir.join("data").display().to_string(),
                "-p".to_string(),
                self.port.to_string(),
                "-k".to_string(),
                self.dir.join("socket").display().to_string(),
                "-c".to_string(),
                "listen_addresses=127.0.0.1".to_string(),
                "-c".to_string(),
                "max_connections=300".to_string(),
                // Test servers: durability across power loss is not needed.
                "-c".to_string(),
                "fsync=off".to_string(),
                "-c".to_string(),
                "full_page_writes=off".to_string(),
                // Every CREATE, ALTER, DROP, COMMENT, GRANT in the log, with time, pid,
                // user and database.
                "-c".to_string(),
                "log_statement=ddl".to_string(),
                "-c".to_string(),
                format!("log_line_prefix={LOG_LINE_PREFIX}"),
            ])
            // The server's own settings last: the last `-c` of a name wins (for example
            // `log_statement=all` over the `ddl` above).
            .args(settings)
            // The server's own directory as HOME: run as `postgres` from root, it would
            // otherwise keep root's, and libpq in its subscriptions' workers stops at
            // "could not open certificate file /root/.postgresql/postgresql.crt:
            // Permission denied" when it connects to a publisher with TLS.
            .env("HOME", self.dir.display().to_string())
            // SIGINT is PostgreSQL's fast shutdown; SIGTERM would wait for clients.
            .stop_signal("INT")
            .run_as(is_root().then(|| "postgres".to_string()));
        let mut process = Supervised::start(&spec, &self.dir)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = process.try_exit()? {
                bail!(
                    "postgres {} exited ({status}):\n{}",
                    self.name,
                    process.log_tail(3000)
                );
            }
            if self.connect_as_superuser().await.is_ok() {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "postgres {} not accepting connections after 30s:\n{}",
                    self.name,
                    process.log_tail(3000)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.process = Some(process);
        Ok(())
    }

    /// Fast shutdown; the data stays for [`PgServer::start_again`].
    pub fn stop(&mut self) -> Result<()> {
        if let Some(mut process) = self.process.take() {
            process.stop()?;
        }
        Ok(())
    }

    /// The directory of the server's programs (initdb, postgres).
    pub fn bin_dir(&self) -> &Path {
        &self.bin
    }

    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    pub fn host(&self) -> &'static str {
        "127.0.0.1"
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn superuser_password(&self) -> &str {
        &self.password
    }

    /// A client program's (`pg_dump`, `pg_receivewal`, …) arguments to reach this server as
    /// the superuser over TCP (`-h -p -U`); the password goes in `PGPASSWORD`.
    pub fn superuser_login_args(&self) -> [String; 6] {
        [
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            SUPERUSER,
        ]
        .map(String::from)
    }

    /// The superuser's login as the shared client (`dbops_shared::postgres`) takes it.
    pub fn superuser_credentials(&self) -> dbops_shared::postgres::Credentials {
        dbops_shared::postgres::Credentials {
            username: SUPERUSER.into(),
            password: self.password.clone(),
        }
    }

    /// A session of the shared client, as a controller opens one, for the superuser on
    /// database `dbname` over 127.0.0.1 with TLS `mode`.
    pub async fn superuser_session(
        &self,
        mode: dbops_api::TlsMode,
        dbname: &str,
    ) -> std::result::Result<dbops_shared::postgres::Session, dbops_shared::postgres::PgError> {
        let endpoint = dbops_shared::postgres::Endpoint::new("127.0.0.1", self.port, mode);
        dbops_shared::postgres::Servers::new(1, 5, Duration::from_secs(30))
            .connect(&endpoint, &self.superuser_credentials(), dbname)
            .await
    }

    /// A libpq connection string for the superuser and database `dbname`.
    pub fn conn_string(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={SUPERUSER} password={} dbname={dbname} connect_timeout=5",
            self.port, self.password
        )
    }

    /// A connection as the superuser to the `postgres` database.
    pub async fn connect_as_superuser(&self) -> Result<Client> {
        self.connect_as_superuser_to("postgres").await
    }

    /// A superuser connection to database `dbname`.
    pub async fn connect_as_superuser_to(&self, dbname: &str) -> Result<Client> {
        self.connect(SUPERUSER, &self.password, dbname).await
    }

    /// A connection as any role; the connection task runs on the current runtime.
    pub async fn connect(&self, user: &str, password: &str, dbname: &str) -> Result<Client> {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(user)
            .password(password)
            .dbname(dbname)
            .connect_timeout(Duration::from_secs(5));
        connect_config(&config).await
    }

    /// The server's log, for failure reports (passwords in logged statements redacted).
    pub fn log_tail(&self, max_bytes: u64) -> String {
        redact_passwords(&log_tail(&self.log_path(), max_bytes))
    }

    /// The server's log file (stdout and stderr of `postgres`).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join(format!("postgres-{}.log", self.name))
    }

    /// Every DDL statement logged so far, oldest first: the log lines containing
    /// `statement:` (simple query protocol) or `execute <name>:` (extended protocol),
    /// each from the log line prefix on. Only the first line of a multi-line statement is
    /// kept. Passwords (`PASSWORD '...'`) are redacted.
    pub fn ddl_statements(&self) -> Result<Vec<String>> {
        let path = self.log_path();
        let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let text = String::from_utf8_lossy(&text);
        Ok(text
            .lines()
            .filter(|line| is_statement_line(line))
            .map(redact_passwords)
            .collect())
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
