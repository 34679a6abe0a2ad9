//! Throwaway PostgreSQL servers from Debian's `postgresql` package: `initdb` in a
//! temporary directory, the `postgres` user when this process is root, a free loopback
//! port, and a superuser `postgres` with a random password (scram-sha-256 over TCP).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::distr::{Alphanumeric, SampleString};
use tokio_postgres::{Client, NoTls};

use crate::paths;
use crate::process::{Spec, Supervised, free_port, is_root, log_tail};

/// The superuser the harness creates.
pub const SUPERUSER: &str = "postgres";

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
}

impl PgServer {
    /// initdb and start a server in a new temporary directory.
    pub async fn start(name: &str) -> Result<Self> {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("dbops-pg-{name}-"))
            .tempdir()?;
        let dir = tmp.path().to_path_buf();
        let mut server = Self::init_in(name, &dir, None)?;
        server._tmp = Some(tmp);
        server.start_again().await?;
        Ok(server)
    }

    /// initdb (unless already done) into `dir` and start; for the dev environment, where
    /// the directory and port outlive one process.
    pub async fn start_in(name: &str, dir: &Path, port: Option<u16>) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut server = Self::init_in(name, dir, port)?;
        server.start_again().await?;
        Ok(server)
    }

    fn init_in(name: &str, dir: &Path, port: Option<u16>) -> Result<Self> {
        let bin = paths::postgres_bin_dir()?;
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
        })
    }

    /// Starts the server (again, after [`PgServer::stop`]) on the same port and data.
    pub async fn start_again(&mut self) -> Result<()> {
        if self.process.is_some() {
            return Ok(());
        }
        let spec = Spec::new(format!("postgres-{}", self.name), self.bin.join("postgres"))
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
            ])
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

    /// A libpq connection string for the superuser and database `dbname`.
    pub fn conn_string(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={SUPERUSER} password={} dbname={dbname} connect_timeout=5",
            self.port, self.password
        )
    }

    /// A connection as the superuser to the `postgres` database.
    pub async fn connect_as_superuser(&self) -> Result<Client> {
        self.connect(SUPERUSER, &self.password, "postgres").await
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
        let (client, connection) = config.connect(NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// The server's log, for failure reports.
    pub fn log_tail(&self, max_bytes: u64) -> String {
        log_tail(
            &self.dir.join(format!("postgres-{}.log", self.name)),
            max_bytes,
        )
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn chown_to_postgres(dir: &Path) -> Result<()> {
    let status = std::process::Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .status()?;
    if !status.success() {
        bail!("chown -R postgres {} failed", dir.display());
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(())
}
