//! PgBouncer from Debian's package (`e2e/install` installs it), run by the harness on a
//! loopback port with the configuration dbops renders (`dbops_shared::pooler`), as the
//! pooler's Pods will run it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_shared::pooler::{self, Route, Settings, Userlist};
use tokio_postgres::{Client, NoTls};

use crate::process::{Spec, Supervised, free_port, is_root};

/// A login with a new password set by dbops's own statement (`ddl::password_statement`:
/// the login's salt, whose verifier the pooler can make again) and its database, CONNECT
/// revoked from PUBLIC, as dbops makes them. Returns the password.
pub async fn tenant(pg: &crate::PgServer, login: &str, db: &str) -> Result<String> {
    use crate::postgres::quote_ident;
    let password = dbops_shared::postgres::generate_password();
    let su = pg.connect_as_superuser().await?;
    su.batch_execute(&format!("CREATE ROLE {} LOGIN", quote_ident(login)))
        .await?;
    su.batch_execute(&dbops_shared::postgres::ddl::password_statement(
        login, &password,
    ))
    .await?;
    su.batch_execute(&format!(
        "CREATE DATABASE {} OWNER {}",
        quote_ident(db),
        quote_ident(login)
    ))
    .await?;
    su.batch_execute(&format!(
        "REVOKE CONNECT ON DATABASE {} FROM PUBLIC",
        quote_ident(db)
    ))
    .await?;
    Ok(password)
}

/// The Debian package's binary.
pub fn binary() -> Result<PathBuf> {
    ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .context("pgbouncer is not installed: run e2e/install (Debian package pgbouncer)")
}

/// A running PgBouncer; stopped when dropped.
pub struct PgBouncer {
    dir: PathBuf,
    settings: Settings,
    /// Lines appended to the `[pgbouncer]` section (a benchmark's alternatives).
    extra: String,
    process: Supervised,
}

impl PgBouncer {
    /// Settings for a pooler on a free loopback port whose files live in `dir`.
    pub fn settings_in(dir: &Path, admin_user: &str) -> Result<Settings> {
        Ok(Settings {
            listen_addr: "127.0.0.1".into(),
            listen_port: free_port()?,
            pool_mode: pooler::PoolMode::Transaction,
            max_client_conn: 200,
            default_pool_size: 5,
            max_db_connections: 0,
            auth_file: dir.join("userlist.txt"),
            admin_user: admin_user.into(),
            server_tls: pooler::ServerTls {
                sslmode: "disable".into(),
                ca_file: None,
            },
            client_tls: None,
        })
    }

    /// Writes the configuration into `dir` (given to `postgres` when this is root: PgBouncer
    /// refuses to run as root) and starts PgBouncer on it, waiting until it answers.
    pub async fn start(
        dir: &Path,
        settings: Settings,
        routes: &[Route],
        userlist: &Userlist,
    ) -> Result<Self> {
        Self::start_with(dir, settings, routes, userlist, "").await
    }

    /// [`PgBouncer::start`] with `extra` lines after what dbops renders (the last section
    /// is `[pgbouncer]`, so they are settings of it), e.g. `auth_query` for a comparison.
    pub async fn start_with(
        dir: &Path,
        settings: Settings,
        routes: &[Route],
        userlist: &Userlist,
        extra: &str,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let ini = Self::write(dir, &settings, routes, userlist, extra)?;
        let spec = Spec::new("pgbouncer", binary()?).args([ini.display().to_string()]);
        Self::launch(dir, spec, settings, extra).await
    }

    /// Runs `spec` (as `postgres` when this is root: PgBouncer refuses to run as root,
    /// SIGINT its safe shutdown) and waits until it listens.
    async fn launch(dir: &Path, spec: Spec, settings: Settings, extra: &str) -> Result<Self> {
        let spec = spec
            .stop_signal("INT")
            .run_as(is_root().then(|| "postgres".to_string()));
        let process = Supervised::start(&spec, dir)?;
        let mut bouncer = Self {
            dir: dir.to_path_buf(),
            settings,
            extra: extra.to_string(),
            process,
        };
        bouncer.wait_listening().await?;
        Ok(bouncer)
    }

    /// [`PgBouncer::start`] through the pooler Pods' entrypoint
    /// (`deploy/docker/pgbouncer/dbops-pgbouncer-run`), which runs PgBouncer and reloads it
    /// when its files change, looking every `interval_secs`.
    pub async fn start_through_entrypoint(
        dir: &Path,
        settings: Settings,
        routes: &[Route],
        userlist: &Userlist,
        interval_secs: u32,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let ini = Self::write(dir, &settings, routes, userlist, "")?;
        let entrypoint =
            crate::paths::repo_root().join("deploy/docker/pgbouncer/dbops-pgbouncer-run");
        let spec = Spec::new("pgbouncer", "/bin/sh")
            .args([entrypoint.display().to_string(), ini.display().to_string()])
            .env("PGBOUNCER", binary()?.display().to_string())
            .env("DBOPS_RELOAD_INTERVAL", interval_secs.to_string());
        // The entrypoint traps SIGINT as it traps a Pod's SIGTERM.
        Self::launch(dir, spec, settings, "").await
    }

    /// Replaces the userlist the way the kubelet updates a Secret volume: a new file
    /// renamed over the old one.
    pub fn swap_userlist(&self, userlist: &Userlist) -> Result<()> {
        let next = self.dir.join(".userlist.next");
        std::fs::write(&next, userlist.render())?;
        if is_root() {
            crate::postgres::chown_to_postgres(&self.dir)?;
        }
        std::fs::rename(&next, &self.settings.auth_file)?;
        Ok(())
    }

    /// SIGTERM, as a Pod's stop sends it, and the exit status within `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        self.process.signal_and_wait("TERM", timeout)
    }

    /// PgBouncer on the files a pooler Pod mounts from the Secret dbops keeps (`files`: the
    /// Secret's data, `pgbouncer.ini` among it): dbops's routes, settings, userlist and
    /// certificate as they are, but for what only a Pod has, here replaced: the address
    /// and port it listens on (loopback, a free port) and the directory the files are in
    /// (`dir` for the Pod's `/etc/pgbouncer`).
    pub async fn start_from_rendered(
        dir: &Path,
        files: &std::collections::BTreeMap<String, String>,
        admin_user: &str,
    ) -> Result<Self> {
        Self::start_from_rendered_on(dir, files, admin_user, free_port()?).await
    }

    /// [`PgBouncer::start_from_rendered`] on loopback port `port`.
    pub async fn start_from_rendered_on(
        dir: &Path,
        files: &std::collections::BTreeMap<String, String>,
        admin_user: &str,
        port: u16,
    ) -> Result<Self> {
        let path = write_rendered(dir, files, port)?;
        let mut settings = Self::settings_in(dir, admin_user)?;
        settings.listen_port = port;
        let spec = Spec::new("pgbouncer", binary()?).args([path.display().to_string()]);
        Self::launch(dir, spec, settings, "").await
    }

    /// What a pooler Pod's kubelet and entrypoint do with its Secret volume, for this
    /// PgBouncer started by [`PgBouncer::start_from_rendered`]: the files of the Secret
    /// `name` written again whenever its data changes (looked at every 100 ms), then
    /// SIGHUP (PgBouncer reads them again), until the task is aborted.
    pub fn follow_secret(
        &self,
        secrets: kube::Api<k8s_openapi::api::core::v1::Secret>,
        name: &str,
    ) -> tokio::task::JoinHandle<()> {
        let (dir, port, name) = (self.dir.clone(), self.port(), name.to_string());
        let pid = self.process.pid().to_string();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                if let Ok(Some(secret)) = secrets.get_opt(&name).await
                    && secret.data != last
                {
                    if let Err(e) = write_rendered(&dir, &files_of(&secret), port) {
                        tracing::warn!("the pooler's files were not written again: {e:#}");
                    } else if last.is_some() {
                        let _ = std::process::Command::new("kill")
                            .args(["-HUP", &pid])
                            .status();
                    }
                    last = secret.data;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    }

    /// This PgBouncer as the one ready Pod of the pooler `name` in `namespace`: a Pod
    /// labelled `dbops.dev/pooler=<name>` whose status (no kubelet runs here) says Ready at
    /// 127.0.0.1, its container port `pgbouncer` this PgBouncer's. Controlled by the
    /// pooler's Secret (`owner`), so the pooler Deployment's ReplicaSet never adopts it.
    pub async fn publish_pod(
        &self,
        client: &kube::Client,
        namespace: &str,
        name: &str,
        owner: &k8s_openapi::api::core::v1::Secret,
    ) -> Result<()> {
        use k8s_openapi::api::core::v1::Pod;
        let pods = kube::Api::<Pod>::namespaced(client.clone(), namespace);
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": format!("{name}-harness"), "namespace": namespace,
                "labels": {dbops_api::names::label::POOLER: name},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Secret",
                    "name": owner.metadata.name, "uid": owner.metadata.uid,
                    "controller": true}],
            },
            "spec": {"containers": [{"name": "pgbouncer", "image": "dbops-e2e/harness-pgbouncer",
                "ports": [{"name": "pgbouncer", "containerPort": self.port()}]}]},
        }))?;
        pods.create(&kube::api::PostParams::default(), &pod)
            .await
            .context("the pooler's Pod")?;
        let status = serde_json::json!({"status": {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        }});
        pods.patch_status(
            &format!("{name}-harness"),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .context("the pooler Pod's status")?;
        Ok(())
    }

    /// A client through the pooler over TLS, the pooler's certificate checked against
    /// `ca_pem` (`verify-ca`: this pooler listens on loopback, not on its Service's name).
    pub async fn connect_tls(
        &self,
        user: &str,
        password: &str,
        dbname: &str,
        ca_pem: &[u8],
    ) -> Result<Client> {
        use dbops_shared::postgres::tls::{Verify, connector, roots_from_pem};
        let roots = roots_from_pem(ca_pem).map_err(anyhow::Error::msg)?;
        let (client, connection) = self
            .config(user, password, dbname)
            .ssl_mode(tokio_postgres::config::SslMode::Require)
            .connect(connector(Verify::Chain, Some(roots))?)
            .await?;
        tokio::spawn(connection);
        Ok(client)
    }

    async fn wait_listening(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.process.try_exit()? {
                bail!(
                    "pgbouncer exited ({status}):\n{}",
                    self.process.log_tail(3000)
                );
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port()))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "pgbouncer did not listen on {} within 20 s:\n{}",
                    self.port(),
                    self.process.log_tail(3000)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn write(
        dir: &Path,
        settings: &Settings,
        routes: &[Route],
        users: &Userlist,
        extra: &str,
    ) -> Result<PathBuf> {
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(&ini, pooler::render(settings, routes)? + extra)?;
        std::fs::write(&settings.auth_file, users.render())?;
        if is_root() {
            crate::postgres::chown_to_postgres(dir)?;
        }
        Ok(ini)
    }

    /// Rewrites the configuration; PgBouncer reads it on the admin console's `RELOAD`.
    pub fn rewrite(&mut self, routes: &[Route], userlist: &Userlist) -> Result<()> {
        Self::write(&self.dir, &self.settings, routes, userlist, &self.extra).map(|_| ())
    }

    pub fn port(&self) -> u16 {
        self.settings.listen_port
    }

    pub fn log_tail(&self, max_bytes: u64) -> String {
        self.process.log_tail(max_bytes)
    }

    /// A session's settings through this pooler.
    fn config(&self, user: &str, password: &str, dbname: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port())
            .user(user)
            .password(password)
            .dbname(dbname)
            .connect_timeout(Duration::from_secs(10));
        config
    }

    /// A client through the pooler (plain TCP), as an application connects.
    pub async fn connect(&self, user: &str, password: &str, dbname: &str) -> Result<Client> {
        let (client, connection) = self.config(user, password, dbname).connect(NoTls).await?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// The admin console over TLS ([`PgBouncer::connect_tls`]).
    pub async fn admin_tls(&self, password: &str, ca_pem: &[u8]) -> Result<Client> {
        let user = self.settings.admin_user.clone();
        self.connect_tls(&user, password, "pgbouncer", ca_pem).await
    }

    /// The admin console (`pgbouncer` database; simple queries only).
    pub async fn admin(&self, password: &str) -> Result<Client> {
        let user = self.settings.admin_user.clone();
        self.connect(&user, password, "pgbouncer").await
    }
}

/// The files a pooler Pod mounts from its Secret: each key with its (UTF-8) value.
pub fn files_of(
    secret: &k8s_openapi::api::core::v1::Secret,
) -> std::collections::BTreeMap<String, String> {
    secret
        .data
        .iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), String::from_utf8(v.0.clone()).ok()?)))
        .collect()
}

/// Where a pooler Pod mounts its server's CA Secret (`render::SERVER_CA_DIR` of the
/// database-controller).
const SERVER_CA_DIR: &str = "/etc/pgbouncer-server-ca/";

/// Writes the files of a pooler's Secret (`files`, `pgbouncer.ini` among them) into `dir`
/// as a Pod would mount them, but for what only a Pod has, here replaced: the address and
/// port PgBouncer listens on (loopback, `port`) and the directories the files are in
/// (`dir` for the Pod's `/etc/pgbouncer`, `dir/server-ca` for its server CA, given as
/// the file `server-ca/ca.crt`). Returns the path of `pgbouncer.ini`.
fn write_rendered(
    dir: &Path,
    files: &std::collections::BTreeMap<String, String>,
    port: u16,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let ini = files
        .get("pgbouncer.ini")
        .context("the pooler's Secret has no pgbouncer.ini")?;
    let mut replaced = 0;
    let ini: String = ini
        .lines()
        .map(|line| {
            let key = line.split('=').next().unwrap_or_default().trim();
            let new = match key {
                "listen_addr" => Some("listen_addr = 127.0.0.1".to_string()),
                "listen_port" => Some(format!("listen_port = {port}")),
                _ => None,
            };
            replaced += usize::from(new.is_some());
            new.unwrap_or_else(|| {
                line.replace(SERVER_CA_DIR, &format!("{}/server-ca/", dir.display()))
                    .replace("/etc/pgbouncer/", &format!("{}/", dir.display()))
            }) + "\n"
        })
        .collect();
    if replaced != 2 {
        bail!("the rendered pgbouncer.ini lacks listen_addr or listen_port:\n{ini}");
    }
    for (name, content) in files {
        if let Some(ca) = name.strip_prefix("server-ca/") {
            std::fs::create_dir_all(dir.join("server-ca"))?;
            std::fs::write(dir.join("server-ca").join(ca), content)?;
        } else if name != "pgbouncer.ini" && !name.contains('/') {
            std::fs::write(dir.join(name), content)?;
        }
    }
    let path = dir.join("pgbouncer.ini");
    std::fs::write(&path, ini)?;
    if is_root() {
        crate::postgres::chown_to_postgres(dir)?;
    }
    Ok(path)
}
