//! Writers: an application per migrated Database that inserts numbered rows through the
//! connection Secret (whatever it says at the moment: the source, then the target),
//! reconnecting on any failure, and records which inserts committed (the server
//! acknowledged the autocommit INSERT). The check then looks for every committed row on
//! the server the Database ends on.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// Committed inserts: (n, when the commit was acknowledged).
    pub committed: Mutex<Vec<(i64, Timestamp)>>,
    /// Inserts that failed or whose outcome is unknown (not counted as committed).
    pub failed: AtomicU64,
    stop: AtomicBool,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Default)]
pub(crate) struct Writers {
    by_uid: Mutex<BTreeMap<String, Arc<Writer>>>,
    next: AtomicU64,
}

impl Writers {
    /// Starts a writer on Database `name` (UID `uid`) unless one runs already.
    pub fn ensure(&self, world: &Arc<World>, name: &str, uid: &str) {
        let Ok(mut map) = self.by_uid.lock() else {
            return;
        };
        if map.contains_key(uid) {
            return;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed) as i64 + 1;
        let writer = Arc::new(Writer {
            database: name.to_string(),
            uid: uid.to_string(),
            base: n * 1_000_000_000,
            committed: Mutex::new(Vec::new()),
            failed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            task: Mutex::new(None),
        });
        let task = spawn(write_loop(world.clone(), writer.clone()));
        if let Ok(mut t) = writer.task.lock() {
            *t = Some(task);
        }
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

    pub async fn stop_all(&self) {
        for w in self.all() {
            w.stop.store(true, Ordering::SeqCst);
            let task = w.task.lock().ok().and_then(|mut t| t.take());
            if let Some(task) = task {
                let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
            }
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

async fn write_loop(world: Arc<World>, w: Arc<Writer>) {
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), NS);
    let secret_name = format!("{}-connection", w.database);
    let mut session: Option<tokio_postgres::Client> = None;
    let mut n = w.base;
    let mut last_error = String::new();
    while !w.stop.load(Ordering::SeqCst) {
        let Some(client) = session.as_ref() else {
            let login =
                match tokio::time::timeout(Duration::from_secs(10), secrets.get_opt(&secret_name))
                    .await
                {
                    Ok(Ok(Some(s))) => login_of(&s),
                    _ => None,
                };
            if let Some(login) = login {
                match connect(&login).await {
                    Ok(c) => {
                        let made = tokio::time::timeout(
                            Duration::from_secs(10),
                            c.batch_execute(&format!(
                                "CREATE TABLE IF NOT EXISTS {TABLE} (n bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
                            )),
                        )
                        .await;
                        match made {
                            Ok(Ok(())) => session = Some(c),
                            Ok(Err(e)) => last_error = e.to_string(),
                            Err(_) => last_error = "CREATE TABLE timed out".into(),
                        }
                    }
                    Err(e) => last_error = format!("{e:#}"),
                }
            }
            if session.is_none() {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            continue;
        };
        n += 1;
        let inserted = tokio::time::timeout(
            Duration::from_secs(5),
            client.execute(&format!("INSERT INTO {TABLE} (n) VALUES ($1)"), &[&n]),
        )
        .await;
        match inserted {
            Ok(Ok(_)) => {
                if let Ok(mut c) = w.committed.lock() {
                    c.push((n, Timestamp::now()));
                }
            }
            Ok(Err(e)) => {
                w.failed.fetch_add(1, Ordering::Relaxed);
                last_error = e.to_string();
                session = None;
            }
            Err(_) => {
                w.failed.fetch_add(1, Ordering::Relaxed);
                last_error = "INSERT timed out".into();
                session = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let committed = w.committed.lock().map(|c| c.len()).unwrap_or(0);
    world.journal.line(
        "WRITER",
        format!(
            "writer on {} stops: {committed} committed, {} failed or unknown (last error: {})",
            w.database,
            w.failed.load(Ordering::Relaxed),
            if last_error.is_empty() {
                "none"
            } else {
                &last_error
            }
        ),
    );
}
