//! The work the disruption tests run through: a Logical Migration with a live writer, a
//! Backup, and 20 Databases being created; then what must hold once it settles.

use std::collections::BTreeSet;
use std::time::Duration;

use dbops_api::{Backup, Database, Migration, MigrationPhase};
use dbops_e2e::fixtures::{Connection, manifest};
use dbops_e2e::live_writer::{LiveWriter, Options};
use dbops_e2e::wait::{Want, database_has, wait_for};
use dbops_shared::postgres::tls::{Verify, connector, roots_from_pem};
use futures::future::try_join_all;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::bed::{Bed, MAIN, SYSTEM, TARGET, Tenant};
use crate::runtime::{backup_ready, migration_ended, ready_database};

const SETTLE: Duration = Duration::from_secs(300);
pub const DATABASES: usize = 20;

/// Work under way in a tenant namespace.
pub struct Work {
    pub tenant: Tenant,
    writer: LiveWriter,
    databases: usize,
}

/// How much work, and whether the Migration may cut over by itself.
pub struct Shape {
    /// `spec.approved` of the Migration (`cutover: Manual`): false leaves it
    /// AwaitingApproval until [`Work::approve`].
    pub approved: bool,
    /// Databases `d00`.. created at once, not waited for.
    pub databases: usize,
    /// Megabytes of rows (not compressible) in `kept` before its Backup.
    pub kept_mb: u32,
    /// Whether the Backup of `kept` is created with the rest (else by [`Work::back_up`]).
    pub backup: bool,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            approved: true,
            databases: DATABASES,
            kept_mb: 0,
            backup: true,
        }
    }
}

/// Starts the work: Database `src` with a live writer and a Logical Migration of it to
/// pg-target (approved: it cuts over by itself), Database `kept` and a Backup of it, and
/// 20 Databases `d00`..`d19` (not waited for).
pub async fn start(bed: &Bed, prefix: &str) -> Work {
    start_with(bed, prefix, Shape::default()).await
}

/// [`start`] with `shape`.
pub async fn start_with(bed: &Bed, prefix: &str, shape: Shape) -> Work {
    let tenant = Tenant::create(bed, prefix).await.unwrap();
    let ns = tenant.name.clone();
    let (src, kept) = (tenant.db("src"), tenant.db("kept"));
    ready_database(bed, &ns, &src).await;
    ready_database(bed, &ns, &kept).await;
    let ca = ca_pem(bed).await;
    let c = Connection::of_database(&bed.client, &ns, &src)
        .await
        .unwrap();
    let (client, conn) = tls_config(&c).connect(tls(&ca)).await.unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(
            "CREATE TABLE writes (n bigint PRIMARY KEY); \
             CREATE TABLE kept_rows (id int PRIMARY KEY); \
             INSERT INTO kept_rows SELECT generate_series(1, 1000)",
        )
        .await
        .unwrap();
    if shape.kept_mb > 0 {
        fill(bed, &ns, &kept, &ca, shape.kept_mb).await;
    }
    let writer = start_writer(bed.client.clone(), ns.clone(), src.clone(), ca.clone());
    wait_for(
        "the writer's first commits",
        Duration::from_secs(60),
        || async { Ok(writer.commits()) },
        |n: &usize| *n >= 10,
    )
    .await
    .unwrap();

    let migration: Migration = manifest(
        "move",
        json!({"databaseRef": {"name": src}, "target": {"serverRef": {"name": TARGET}},
               "mode": "Logical", "cutover": "Manual", "approved": shape.approved}),
    )
    .unwrap();
    let migrations: Api<Migration> = bed.api(&ns);
    migrations
        .create(&PostParams::default(), &migration)
        .await
        .unwrap();
    let mut work = Work {
        tenant,
        writer,
        databases: 0,
    };
    if shape.backup {
        work.back_up(bed).await;
    }
    work.create_databases(bed, shape.databases).await;
    work
}

/// `mb` megabytes of random rows (1 KiB each: a dump cannot shrink them much) in table
/// `bulk` of Database `db`.
async fn fill(bed: &Bed, ns: &str, db: &str, ca: &[u8], mb: u32) {
    let c = Connection::of_database(&bed.client, ns, db).await.unwrap();
    let (client, conn) = tls_config(&c).connect(tls(ca)).await.unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "CREATE TABLE bulk (id int PRIMARY KEY, pad text); \
             INSERT INTO bulk SELECT g, (SELECT string_agg(md5(random()::text), '') \
               FROM generate_series(1, 32) WHERE g > 0) FROM generate_series(1, {}) g",
            mb * 1024
        ))
        .await
        .unwrap();
    let size: i64 = client
        .query_one("SELECT pg_total_relation_size('bulk')", &[])
        .await
        .unwrap()
        .get(0);
    println!("{db}: table bulk holds {} MB", size / (1024 * 1024));
}

impl Work {
    /// Creates `n` more Databases `dNN` at once (not waited for).
    pub async fn create_databases(&mut self, bed: &Bed, n: usize) {
        let databases: Api<Database> = bed.api(self.ns());
        let first = self.databases;
        let tenant = &self.tenant;
        try_join_all((first..first + n).map(|i| {
            let db: Database = manifest(
                &tenant.db(&format!("d{i:02}")),
                json!({"serverRef": {"name": MAIN}, "deletionPolicy": "Delete"}),
            )
            .unwrap();
            let databases = databases.clone();
            async move { databases.create(&PostParams::default(), &db).await }
        }))
        .await
        .unwrap();
        self.databases += n;
    }

    /// Creates the Backup `kept-1` of Database `kept`.
    pub async fn back_up(&self, bed: &Bed) {
        let kept = self.tenant.db("kept");
        let backup: Backup = manifest("kept-1", json!({"databaseRef": {"name": kept}})).unwrap();
        let backups: Api<Backup> = bed.api(self.ns());
        backups
            .create(&PostParams::default(), &backup)
            .await
            .unwrap();
    }

    /// Approves the Migration (`spec.approved: true`).
    pub async fn approve(&self, bed: &Bed) {
        let approve = json!({"spec": {"approved": true}});
        bed.api::<Migration>(self.ns())
            .patch(
                "move",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&approve),
            )
            .await
            .unwrap();
    }

    pub fn ns(&self) -> &str {
        &self.tenant.name
    }

    /// What has not settled yet: "Migration" while it has not ended, "Backup" while it
    /// is not Ready, and how many Databases are not Ready.
    pub async fn under_way(&self, bed: &Bed) -> String {
        let ns = self.ns();
        let mut out = Vec::new();
        let m = bed.api::<Migration>(ns).get("move").await.unwrap();
        let phase = m.status.as_ref().and_then(|s| s.phase);
        if !phase.is_some_and(MigrationPhase::is_final) {
            out.push(format!("Migration ({phase:?})"));
        }
        let b = bed.api::<Backup>(ns).get("kept-1").await.unwrap();
        if !b.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        }) {
            out.push("Backup".to_owned());
        }
        let dbs = bed
            .api::<Database>(ns)
            .list(&Default::default())
            .await
            .unwrap();
        let pending = dbs
            .items
            .iter()
            .filter(|d| !database_has(d, Want::new("Ready", "True", None)))
            .count();
        out.push(format!("{pending} Databases not Ready"));
        out.join(", ")
    }

    /// Waits for everything to settle, then checks: every Database Ready, the Backup Ready
    /// with one artifact and one manifest in the store, the Migration Succeeded with every
    /// write the writer saw committed on the target.
    pub async fn settles(self, bed: &Bed, store: Option<&std::path::Path>) {
        let ns = self.ns().to_owned();
        let migrations: Api<Migration> = bed.api(&ns);
        let moved = migration_ended(&migrations, "move", SETTLE).await;
        assert_eq!(
            moved.status.as_ref().and_then(|s| s.phase),
            Some(MigrationPhase::Succeeded),
            "{:?}",
            moved.status
        );
        let log = self.writer.finish().await;
        let committed = log.numbers();
        assert!(
            committed.len() >= 10,
            "the writer committed {}",
            committed.len()
        );

        let databases: Api<Database> = bed.api(&ns);
        let all = wait_for(
            "every Database Ready",
            SETTLE,
            || async { Ok(databases.list(&Default::default()).await?.items) },
            |ds: &Vec<Database>| {
                ds.len() == self.databases + 2
                    && ds
                        .iter()
                        .all(|d| database_has(d, Want::new("Ready", "True", None)))
            },
        )
        .await
        .unwrap();
        let src_name = self.tenant.db("src");
        let src = all.iter().find(|d| d.name_any() == src_name).unwrap();
        let server = serde_json::to_value(&src.spec).unwrap()["serverRef"]["name"].clone();
        assert_eq!(server, json!(TARGET), "src moved to {TARGET}");

        // Every committed write is on the target, read through the same Secret.
        let ca = ca_pem(bed).await;
        let c = Connection::of_database(&bed.client, &ns, &src_name)
            .await
            .unwrap();
        assert!(
            c.host.starts_with(TARGET),
            "the Secret points at {}",
            c.host
        );
        let (client, conn) = tls_config(&c).connect(tls(&ca)).await.unwrap();
        tokio::spawn(conn);
        let rows = client.query("SELECT n FROM writes", &[]).await.unwrap();
        let on_target: BTreeSet<i64> = rows.iter().map(|r| r.get(0)).collect();
        let lost: Vec<_> = committed
            .iter()
            .filter(|n| !on_target.contains(n))
            .collect();
        assert!(
            lost.is_empty(),
            "{} committed writes are not on the target: {lost:?} (failed attempts: {})",
            lost.len(),
            log.failures()
        );

        let backups: Api<Backup> = bed.api(&ns);
        let backup = backup_ready(&backups, "kept-1", SETTLE).await;
        if let Some(store) = store {
            // Every Backup of the namespace (kept-1, and the Migration's snapshot) has
            // exactly one artifact and one manifest, and nothing else is there: no copy
            // written twice under another name, no partial file left by a killed writer.
            let mut want: Vec<String> = backups
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .iter()
                .flat_map(|b| {
                    let stem = format!("{}-{}", b.name_any(), b.uid().unwrap());
                    [format!("{stem}.dump"), format!("{stem}.manifest.json")]
                })
                .collect();
            want.sort();
            let mut files: Vec<String> = std::fs::read_dir(store.join(&ns))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            files.sort();
            assert!(want.len() >= 2, "{want:?}");
            assert_eq!(
                files, want,
                "the store: one artifact and one manifest per Backup"
            );
            assert!(files.contains(&format!("kept-1-{}.dump", backup.uid().unwrap())));
        }
    }
}

async fn ca_pem(bed: &Bed) -> Vec<u8> {
    let secret = bed.api::<Secret>(SYSTEM).get("pg-ca").await.unwrap();
    secret.data.unwrap()["ca.crt"].0.clone()
}

fn tls(ca: &[u8]) -> tokio_postgres_rustls::MakeRustlsConnect {
    connector(Verify::ChainAndHost, Some(roots_from_pem(ca).unwrap())).unwrap()
}

fn tls_config(c: &Connection) -> tokio_postgres::Config {
    let mut config = c.config();
    config
        .ssl_mode(tokio_postgres::config::SslMode::Require)
        .connect_timeout(Duration::from_secs(5));
    config
}

/// Inserts 1, 2, 3, ... into `writes`, one autocommit statement each, through the
/// connection Secret of Database `db` as it is when it (re)connects (TLS, verify-full
/// against `ca`), until finished; paced (20 ms after each insert, 200 ms after a failed
/// connect) so that a refused connection never spins.
fn start_writer(kube: kube::Client, ns: String, db: String, ca: Vec<u8>) -> LiveWriter {
    let connect = move || {
        let (kube, ns, db, ca) = (kube.clone(), ns.clone(), db.clone(), ca.clone());
        async move {
            let c = Connection::of_database(&kube, &ns, &db).await?;
            let (client, conn) = tls_config(&c).connect(tls(&ca)).await?;
            tokio::spawn(conn);
            anyhow::Ok(client)
        }
    };
    let options = Options::new("writes")
        .pause(Duration::from_millis(20))
        .retry(Duration::from_millis(200));
    LiveWriter::start(connect, options)
}
