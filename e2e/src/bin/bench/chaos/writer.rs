//! Writers: an application per migrated Database that inserts numbered rows through the
//! connection Secret (whatever it says at the moment: the source, then the target),
//! reconnecting on any failure, and records which inserts committed (the server
//! acknowledged the autocommit INSERT): `dbops_e2e::live_writer`, one per Database. The
//! check then looks for every committed row on the server the Database ends on.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use dbops_e2e::live_writer::{LiveWriter, Options};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;

use super::world::{NS, World, spawn};

/// The table every writer inserts into (one writer per database; its numbers start at
/// `base`, so rows of a Database restored from another one's Backup never collide).
pub(crate) const TABLE: &str = "chaos_writes";

pub(crate) struct Writer {
    pub database: String,
    pub uid: String,
    pub base: i64,
    live: LiveWriter,
}

impl Writer {
    /// Committed inserts so far: (n, when the commit was acknowledged).
    pub fn committed(&self) -> Vec<(i64, Timestamp)> {
        self.live
            .log()
            .committed
            .iter()
            .map(|c| (c.n, c.time))
            .collect()
    }
}

#[derive(Default)]
pub(crate) struct Writers {
    by_uid: Mutex<BTreeMap<String, Arc<Writer>>>,
    next: AtomicU64,
}

impl Writers {
    /// Starts a writer on Database `name` (UID `uid`) unless one runs already: numbers
    /// from its base on, the table created on each new session, 200 ms after each insert,
    /// 500 ms after a failed connect, each insert bounded to 5 s.
    pub fn ensure(&self, world: &Arc<World>, name: &str, uid: &str) {
        let Ok(mut map) = self.by_uid.lock() else {
            return;
        };
        if map.contains_key(uid) {
            return;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed) as i64 + 1;
        let base = n * 1_000_000_000;
        let secrets: Api<Secret> = Api::namespaced(world.client.clone(), NS);
        let secret_name = format!("{name}-connection");
        let connect = move || {
            let (secrets, secret_name) = (secrets.clone(), secret_name.clone());
            async move {
                let secret =
                    tokio::time::timeout(Duration::from_secs(10), secrets.get_opt(&secret_name))
                        .await;
                let login = match secret {
                    Ok(Ok(Some(s))) => login_of(&s),
                    _ => None,
                };
                connect(&login.context("no usable connection Secret")?).await
            }
        };
        let options = Options::new(TABLE)
            .first(base + 1)
            .create_table()
            .pause(Duration::from_millis(200))
            .retry(Duration::from_millis(500))
            .insert_timeout(Duration::from_secs(5));
        let writer = Arc::new(Writer {
            database: name.to_string(),
            uid: uid.to_string(),
            base,
            live: LiveWriter::start(connect, options),
        });
        world
            .journal
            .line("WRITER", format!("writer starts on Database {name}"));
        map.insert(uid.to_string(), writer);
    }

    pub fn all(&self) -> Vec<Arc<Writer>> {
        self.by_uid
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Stops every writer (15 s each at most) and prints what each did.
    pub async fn stop_all(&self, world: &World) {
        for w in self.all() {
            let _ = tokio::time::timeout(Duration::from_secs(15), w.live.stop()).await;
            let log = w.live.log();
            world.journal.line(
                "WRITER",
                format!(
                    "writer on {} stops: {} committed, {} failed or unknown (last error: {})",
                    w.database,
                    log.committed.len(),
                    log.failed_inserts,
                    log.last_failure
                        .as_ref()
                        .map_or("none", |f| f.error.as_str())
                ),
            );
        }
    }
}

/// The libpq keys of a connection Secret.
pub(crate) struct Login {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: String,
    pub dbname: String,
}

pub(crate) fn login_of(secret: &Secret) -> Option<Login> {
    let data = secret.data.as_ref()?;
    let get = |k: &str| {
        data.get(k)
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
    };
    Some(Login {
        host: get("PGHOST")?,
        port: get("PGPORT")?.parse().ok()?,
        user: get("PGUSER")?,
        password: get("PGPASSWORD")?,
        dbname: get("PGDATABASE")?,
    })
}

/// A session with a connection Secret's keys, bounded.
pub(crate) async fn connect(login: &Login) -> anyhow::Result<tokio_postgres::Client> {
    let mut config = tokio_postgres::Config::new();
    config
        .host(&login.host)
        .port(login.port)
        .user(&login.user)
        .password(&login.password)
        .dbname(&login.dbname)
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = tokio::time::timeout(
        Duration::from_secs(10),
        config.connect(tokio_postgres::NoTls),
    )
    .await??;
    spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}
