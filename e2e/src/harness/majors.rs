#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The major-version tests' world: one server per supported major a test names (with its
//! admin Secret and DatabaseServer), the three controllers with the client programs of every
//! major, and what the tests do across majors: fill a Database, back it up, restore it,
//! migrate it in either mode, and compare what arrived.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dbops_api::{
    Backup, BackupPhase, ChosenMode, Database, Migration, MigrationPhase, MigrationStep, StepState,
};
use kube::api::Api;
use serde_json::json;

use crate::controllers::ControllerProcess;
use crate::fixtures::approve_migration;
use crate::fixtures::{
    Connection, create_admin_secret_of, create_backup, create_migration, server_name,
};
use crate::harness::bed::{Bed, bed};
use crate::harness::migration::{READY, SAGA, condition, phase_of};
use crate::harness::object::Logged;
use crate::harness::redact::redact;
use crate::postgres::PgServer;
use crate::postgres::admin::AdminKind;
use crate::postgres::{LOGICAL_REPLICATION, client_bin_dir, scalar, server_majors};
use crate::wait::Want;

/// Rows of `items` in every Database of these tests.
pub const ROWS: i64 = 5_000;
/// The value the standalone sequence `tickets` is set to.
pub const TICKETS: i64 = 4_242;

/// One test's world. Dropped in field order: controllers, servers, then the namespace.
pub struct Majors {
    pub migration_controller: Option<ControllerProcess>,
    pub backup_controller: Option<ControllerProcess>,
    pub database_controller: Option<ControllerProcess>,
    /// (major, server), each with the admin Secret and DatabaseServer [`admin`]`(major)`.
    pub servers: Vec<(u32, PgServer)>,
    pub b: Bed,
    pub store: tempfile::TempDir,
    pub logs: tempfile::TempDir,
    /// The newest major's pg_dump, pg_restore and psql.
    pub clients: PathBuf,
    /// The client programs of the other majors there are (`--pg-bin-dir`).
    pub other_clients: Vec<PathBuf>,
    pub identities: &'static std::collections::BTreeMap<String, PathBuf>,
}

/// The admin Secret (and so the DatabaseServer's suffix) of the server of `major`.
pub fn admin(major: u32) -> String {
    format!("pg{major}-admin")
}

/// The directory of the newest supported major's client programs, and those of the
/// other majors this machine has.
pub fn clients() -> (PathBuf, Vec<PathBuf>) {
    let majors = server_majors().unwrap();
    let newest = *majors.last().unwrap();
    assert!(newest >= 18, "the newest major is {newest}: {majors:?}");
    let others = majors[..majors.len() - 1]
        .iter()
        .filter_map(|major| client_bin_dir(*major).ok())
        .collect();
    (client_bin_dir(newest).unwrap(), others)
}

impl Logged for Majors {
    fn logs_of_all(&self) -> String {
        format!(
            "---- migration-controller log ----\n{}\n---- database-controller log ----\n{}\n---- backup-controller log ----\n{}",
            self.log("migration-controller", 10_000),
            self.log("database-controller", 5_000),
            self.log("backup-controller", 4_000),
        )
    }
}

impl Majors {
    /// Servers of `majors` (each a possible Logical source: [`LOGICAL_REPLICATION`]),
    /// their admin Secrets and DatabaseServers, a file backup store and the three
    /// controllers with the newest client programs and the other majors' ([`clients`]).
    pub async fn start(prefix: &str, majors: &[u32]) -> Self {
        Self::start_as(prefix, majors, AdminKind::for_tests()).await
    }

    /// [`Majors::start`] with the admin `kind` in every server's admin Secret.
    pub async fn start_as(prefix: &str, majors: &[u32], kind: AdminKind) -> Self {
        let b = bed(prefix).await;
        let started = futures::future::join_all(majors.iter().map(|&major| async move {
            let pg = start_logical_source(&format!("{prefix}-{major}"), major).await;
            (major, pg)
        }))
        .await;
        let store = crate::harness::bed::test_dir(prefix, "store");
        let logs = crate::harness::bed::test_dir(prefix, "logs");
        let identities = crate::harness::bed::controller_identities(b.cp).await;
        let (clients, other_clients) = clients();
        let mut m = Self {
            migration_controller: None,
            backup_controller: None,
            database_controller: None,
            servers: started,
            b,
            store,
            logs,
            clients,
            other_clients,
            identities,
        };
        for (major, pg) in &m.servers {
            create_admin_secret_of(&m.b.client, m.ns(), &admin(*major), pg, kind)
                .await
                .unwrap();
        }
        let store = format!("--backup-store=file://{}", m.store.path().display());
        let (pg_dump, pg_restore) = (m.client("pg_dump"), m.client("pg_restore"));
        let bin_dirs = m.bin_dirs_arg();
        m.database_controller = Some(m.start_controller(
            "database-controller",
            vec![
                store.clone(),
                format!("--pg-restore={pg_restore}"),
                format!("--pg-dump={pg_dump}"),
                bin_dirs.clone(),
            ],
        ));
        m.backup_controller =
            Some(m.start_backup_controller(&[format!("--pg-dump={pg_dump}"), bin_dirs.clone()]));
        m.migration_controller = Some(m.start_controller(
            "migration-controller",
            vec![
                format!("--pg-dump={pg_dump}"),
                format!("--pg-restore={pg_restore}"),
                bin_dirs,
            ],
        ));
        m
    }

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    pub fn client(&self, program: &str) -> String {
        self.clients.join(program).display().to_string()
    }

    /// `--pg-bin-dir=` with the other majors' client directories.
    pub fn bin_dirs_arg(&self) -> String {
        let dirs: Vec<String> = self
            .other_clients
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        format!("--pg-bin-dir={}", dirs.join(","))
    }

    pub fn pg(&self, major: u32) -> &PgServer {
        self.servers
            .iter()
            .find(|(m, _)| *m == major)
            .map(|(_, pg)| pg)
            .unwrap_or_else(|| panic!("no server of major {major}"))
    }

    pub fn server(&self, major: u32) -> String {
        server_name(self.ns(), &admin(major))
    }

    pub fn start_controller(&self, name: &str, extra: Vec<String>) -> ControllerProcess {
        let mut args = crate::harness::bed::watch_args(self.ns(), "5s");
        args.extend(extra);
        ControllerProcess::start(name, &self.identities[name], self.logs.path(), &args)
            .unwrap_or_else(|e| panic!("starting the {name}: {}", self.redact(&format!("{e:#}"))))
    }

    /// The backup-controller with these client program flags.
    pub fn start_backup_controller(&self, programs: &[String]) -> ControllerProcess {
        let mut args = vec![
            format!("--backup-store=file://{}", self.store.path().display()),
            "--max-concurrent-backups=2".into(),
        ];
        args.extend(programs.iter().cloned());
        self.start_controller("backup-controller", args)
    }

    /// Stops the backup-controller (SIGTERM) and starts it again with these client program
    /// flags.
    pub fn restart_backup_controller(&mut self, programs: &[String]) {
        crate::controllers::end(
            self.backup_controller.take(),
            "TERM",
            Duration::from_secs(20),
        );
        self.backup_controller = Some(self.start_backup_controller(programs));
    }

    /// `pgDumpVersion` in the manifest of Backup `name` (in the file store).
    pub fn pg_dump_of(&self, name: &str) -> String {
        let mut found = Vec::new();
        let mut dirs = vec![self.store.path().to_path_buf()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.to_string_lossy().ends_with(".manifest.json") {
                    let manifest: serde_json::Value =
                        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                    if manifest["backup"]["name"] == name {
                        found.push(manifest["pgDumpVersion"].as_str().unwrap().to_string());
                    }
                }
            }
        }
        assert_eq!(found.len(), 1, "manifests of Backup {name}: {found:?}");
        found.remove(0)
    }

    pub fn log(&self, controller: &str, max_bytes: u64) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        self.redact(&crate::process::log_tail(&path, max_bytes))
    }

    pub fn redact(&self, text: &str) -> String {
        let servers = self
            .servers
            .iter()
            .map(|(major, pg)| (format!("pg{major}"), pg));
        redact(text, servers)
    }

    pub fn databases(&self) -> Api<Database> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn backups(&self) -> Api<Backup> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    pub fn migrations(&self) -> Api<Migration> {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// A Database on the server of `major` with `extra` merged into its spec, Ready.
    pub async fn create_database(
        &self,
        name: &str,
        major: u32,
        extra: serde_json::Value,
    ) -> Database {
        crate::fixtures::create_database(&self.b.client, self.ns(), name, &admin(major), extra)
            .await
            .unwrap();
        let want = Want::provisioned();
        self.wait(self.databases(), name, "Ready", READY, |db| {
            crate::wait::database_has(db, want)
        })
        .await
    }

    /// A Database on `major`, Ready, filled by its own role with [`fill`].
    pub async fn create_filled_database(&self, name: &str, major: u32) -> Database {
        let db = self.create_database(name, major, json!({})).await;
        let app = self.connect_as_app(name).await;
        app.batch_execute(&fill()).await.unwrap();
        db
    }

    /// A session as the Database's own role, with what its connection Secret says now.
    pub async fn connect_as_app(&self, name: &str) -> tokio_postgres::Client {
        Connection::of_database(&self.b.client, self.ns(), name)
            .await
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn create_migration(
        &self,
        name: &str,
        db: &str,
        target: u32,
        extra: serde_json::Value,
    ) {
        create_migration(&self.b.client, self.ns(), name, db, &admin(target), extra)
            .await
            .unwrap();
    }

    pub async fn wait_phase(&self, name: &str, phase: MigrationPhase) -> Migration {
        self.wait(
            self.migrations(),
            name,
            &format!("phase {phase:?}"),
            SAGA,
            |m| phase_of(m) == Some(phase),
        )
        .await
    }

    pub async fn create_backup(&self, name: &str, db: &str) {
        create_backup(&self.b.client, self.ns(), name, db, json!({}))
            .await
            .unwrap();
    }

    pub async fn wait_backup(&self, name: &str, phase: BackupPhase) -> Backup {
        self.wait(
            self.backups(),
            name,
            &format!("phase {phase:?}"),
            READY,
            |b| b.status.as_ref().and_then(|s| s.phase) == Some(phase),
        )
        .await
    }

    /// A Backup of `db`, Completed; checks that it dumped a server of `major` with the
    /// pg_dump of `pg_dump_major`.
    pub async fn backup(&self, name: &str, db: &str, major: u32, pg_dump_major: u32) -> Backup {
        self.create_backup(name, db).await;
        let backup = self.wait_backup(name, BackupPhase::Completed).await;
        let status = backup.status.clone().unwrap();
        assert_major(status.server_version.as_deref(), major, name);
        assert!(status.size_bytes.unwrap_or(0) > 0, "{name}: {status:?}");
        let pg_dump = self.pg_dump_of(name);
        assert!(
            pg_dump.contains(&format!(" {pg_dump_major}.")),
            "Backup {name} of PostgreSQL {major}: {pg_dump}, not pg_dump {pg_dump_major}"
        );
        backup
    }

    /// A Database `name` on `major` restored from Backup `from` (`spec.restoreFrom`),
    /// Ready, holding what [`fill`] wrote, row for row `like`.
    pub async fn restore(&self, name: &str, from: &str, major: u32, like: &(i64, i64, String)) {
        let db = self
            .create_database(
                name,
                major,
                json!({"restoreFrom": {"backupRef": {"name": from}}}),
            )
            .await;
        assert_major(
            db.status.as_ref().and_then(|s| s.server_version.as_deref()),
            major,
            name,
        );
        self.assert_filled(major, name, 0, like).await;
    }

    /// A Database on the server of `major` filled from `spec` (a `cloneFrom`), Ready,
    /// holding row for row what `like` (the source as read by [`Majors::contents`]) holds.
    pub async fn clone_as(
        &self,
        name: &str,
        spec: serde_json::Value,
        major: u32,
        like: &(i64, i64, String),
    ) {
        let db = self
            .create_database(name, major, json!({"cloneFrom": spec}))
            .await;
        assert_major(
            db.status.as_ref().and_then(|s| s.server_version.as_deref()),
            major,
            name,
        );
        assert_eq!(&self.contents(major, name).await, like, "{name}");
    }

    /// A clone of Database `source` onto the server of `major`, older than the source's:
    /// refused (`CloneToOlderMajor`) with nothing made there.
    pub async fn clone_refused(&self, name: &str, source: &str, major: u32) {
        let spec = json!({"cloneFrom": {"databaseRef": {"name": source}}});
        crate::fixtures::create_database(&self.b.client, self.ns(), name, &admin(major), spec)
            .await
            .unwrap();
        let want = Want::not_ready("CloneToOlderMajor");
        self.wait(self.databases(), name, "CloneToOlderMajor", READY, |db| {
            crate::wait::database_has(db, want)
        })
        .await;
        assert!(
            !self.pg(major).database_exists(name).await.unwrap(),
            "{name}"
        );
    }

    /// What `items` in `database` on the server of `major` holds: rows, the sum of the
    /// ids, and an md5 of every row in id order.
    pub async fn contents(&self, major: u32, database: &str) -> (i64, i64, String) {
        let client = self
            .pg(major)
            .connect_as_superuser_to(database)
            .await
            .unwrap();
        let r = client
            .query_one(
                "SELECT count(*), sum(id)::bigint, \
                 md5(string_agg(id || ':' || v || ':' || doc::text, ',' ORDER BY id)) FROM items",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    }

    /// `database` on the server of `major` holds what [`fill`] wrote and `extra` more
    /// rows and `tickets` values, row for row what `like` (the original, as read by
    /// [`Majors::contents`]) holds, and both sequences where they were left (asked with
    /// nextval, so once per database).
    pub async fn assert_filled(
        &self,
        major: u32,
        database: &str,
        extra: i64,
        like: &(i64, i64, String),
    ) {
        let client = self
            .pg(major)
            .connect_as_superuser_to(database)
            .await
            .unwrap();
        let version: i32 =
            scalar(&client, "SELECT current_setting('server_version_num')::int").await;
        assert_eq!(
            version / 10000,
            major as i32,
            "{database}: server_version_num {version}"
        );
        let rows = ROWS + extra;
        let (count, sum, digest) = self.contents(major, database).await;
        assert_eq!(count, rows, "{database} on {major}: rows of items");
        assert_eq!(
            sum,
            rows * (rows + 1) / 2,
            "{database} on {major}: ids 1..={rows}"
        );
        assert_eq!(
            &(count, sum, digest),
            like,
            "{database} on {major}: the same rows"
        );
        for (sequence, next) in [("items_id_seq", rows + 1), ("tickets", TICKETS + extra + 1)] {
            let got: i64 = client
                .query_one("SELECT nextval($1::text::regclass)", &[&sequence])
                .await
                .unwrap()
                .get(0);
            assert_eq!(got, next, "{database} on {major}: nextval of {sequence}");
        }
    }

    /// A Database `db` filled on `from` ([`Majors::create_filled_database`]), then moved
    /// to `to` in `mode` ([`Majors::migrate`]).
    pub async fn fill_and_migrate(
        &self,
        db: &str,
        (from, to): (u32, u32),
        mode: ChosenMode,
        clients: u32,
    ) {
        self.create_filled_database(db, from).await;
        self.migrate(db, (from, to), mode, clients).await;
    }

    /// Moves Database `db` (filled, on `from`) to `to` in `mode`, and checks everything
    /// arrived. A Logical Migration has a Manual cutover: while it awaits approval the
    /// source is written to (rows and `tickets`), and those writes must arrive too.
    /// `clients` is the major of the pg_dump and pg_restore the copy must take.
    pub async fn migrate(&self, db: &str, (from, to): (u32, u32), mode: ChosenMode, clients: u32) {
        let started = Instant::now();
        let name = format!("{db}-to-{to}");
        let logical = mode == ChosenMode::Logical;
        let extra = match mode {
            ChosenMode::Dump => json!({"mode": "Dump"}),
            ChosenMode::Logical => json!({"mode": "Logical", "cutover": "Manual"}),
        };
        self.create_migration(&name, db, to, extra).await;
        let mut extra_rows = 0;
        if logical {
            let m = self
                .wait_phase(&name, MigrationPhase::AwaitingApproval)
                .await;
            let replication = m
                .status
                .as_ref()
                .and_then(|s| s.replication.clone())
                .unwrap();
            assert_eq!(
                (replication.tables_copied, replication.tables_total),
                (1, 1),
                "{name}: {replication:?}"
            );
            // Replicating, the source takes writes; they cross the major versions too.
            extra_rows = 100;
            let app = self.connect_as_app(db).await;
            app.batch_execute(&format!(
                "INSERT INTO items (v, doc) SELECT md5(i::text), jsonb_build_object('i', i) \
                 FROM generate_series({}, {}) i; \
                 SELECT nextval('tickets') FROM generate_series(1, {extra_rows});",
                ROWS + 1,
                ROWS + extra_rows
            ))
            .await
            .expect("the source is writable while a Logical Migration awaits approval");
            approve_migration(&self.migrations(), &name).await.unwrap();
        }
        let m = self.wait_phase(&name, MigrationPhase::Succeeded).await;
        let status = m.status.clone().unwrap();
        assert_eq!(status.mode, Some(mode), "{name}");
        let steps: Vec<MigrationStep> = status.steps.iter().map(|s| s.name).collect();
        let want = if logical {
            MigrationStep::LOGICAL.to_vec()
        } else {
            MigrationStep::DUMP.to_vec()
        };
        assert_eq!(steps, want, "{name}");
        for step in &status.steps {
            assert_eq!(step.state, StepState::Succeeded, "{name}: {step:?}");
        }
        // Preflight saw the two majors it was asked to cross.
        let message_of = |step: MigrationStep| {
            let found = status.steps.iter().find(|s| s.name == step);
            found.and_then(|s| s.message.clone()).unwrap_or_default()
        };
        let preflight = message_of(MigrationStep::Preflight);
        assert!(
            preflight.contains(&format!("source PostgreSQL {from}."))
                && preflight.contains(&format!("target PostgreSQL {to}."))
                && preflight.contains(&format!("copying with pg_dump {clients}."))
                && preflight.contains(&format!("and pg_restore {clients}.")),
            "{name}: {preflight}"
        );
        if !logical {
            let copied = message_of(MigrationStep::CopyData);
            assert!(
                copied.contains(&format!("pg_dump {clients}."))
                    && copied.contains(&format!("by pg_restore {clients}.")),
                "{name}: {copied}"
            );
        }
        if logical {
            let replication = status.replication.clone().unwrap();
            assert!(replication.caught_up, "{name}: {replication:?}");
        }
        assert!(
            condition(&m, "Ready").is_some_and(|c| c.status == "True"),
            "{name}: {:?}",
            status.conditions
        );

        // The Database is on the target, and its own role reads every row there.
        let database = self
            .wait(
                self.databases(),
                db,
                &format!("Ready on PostgreSQL {to}"),
                READY,
                |d| {
                    d.spec.server_ref.name == self.server(to)
                        && d.status.as_ref().is_some_and(|s| {
                            s.server_version
                                .as_deref()
                                .is_some_and(|v| v.starts_with(&format!("{to}.")))
                        })
                        && crate::wait::database_has(d, Want::new("Ready", "True", None))
                },
            )
            .await;
        assert!(database.status.is_some());
        let app = self.connect_as_app(db).await;
        let seen: i64 = scalar(&app, "SELECT count(*) FROM items").await;
        assert_eq!(
            seen,
            ROWS + extra_rows,
            "{db}: rows read through the connection Secret"
        );
        drop(app);
        // The source keeps its copy (sourceRetention Keep, frozen): the target's is the same.
        let original = self.contents(from, db).await;
        self.assert_filled(to, db, extra_rows, &original).await;
        println!(
            "majors: {db} moved {from} -> {to} in {mode:?} mode in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }

    /// What a Migration could leave behind on any server: replication slots,
    /// subscriptions, `dbops_mig_*` roles, and publications in any database.
    pub async fn leftovers(&self) -> Vec<String> {
        let mut found = Vec::new();
        for (major, pg) in &self.servers {
            for (what, name) in pg.replication_leftovers().await.unwrap() {
                found.push(format!("PostgreSQL {major}: {what} {name}"));
            }
            let admin = pg.connect_as_superuser().await.unwrap();
            let databases: Vec<String> = admin
                .query(
                    "SELECT datname::text FROM pg_database WHERE datallowconn AND NOT datistemplate",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            for database in databases {
                for name in pg.publications(&database).await.unwrap() {
                    found.push(format!(
                        "PostgreSQL {major}: publication {name} in {database}"
                    ));
                }
            }
        }
        found
    }
}

impl Drop for Majors {
    fn drop(&mut self) {
        self.print_if_panicking(self.ns(), &self.servers, 3000, |text| self.redact(text));
    }
}

/// A PostgreSQL server of `major` named `name`, able to be a Logical source
/// ([`LOGICAL_REPLICATION`]); panics, naming the major, when it does not start.
pub async fn start_logical_source(name: &str, major: u32) -> PgServer {
    PgServer::start_major_with_settings(name, major, LOGICAL_REPLICATION)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"))
}

/// What every Database of these tests holds: `items` (a serial key, text and jsonb,
/// [`ROWS`] rows) and a standalone sequence `tickets` at [`TICKETS`].
pub fn fill() -> String {
    format!(
        "CREATE TABLE items (id serial PRIMARY KEY, v text NOT NULL, doc jsonb NOT NULL); \
         INSERT INTO items (v, doc) SELECT md5(i::text), jsonb_build_object('i', i) \
         FROM generate_series(1, {ROWS}) i; \
         CREATE SEQUENCE tickets; \
         SELECT setval('tickets', {TICKETS});"
    )
}

/// `version` (a `server_version`) is of `major`.
pub fn assert_major(version: Option<&str>, major: u32, what: &str) {
    assert!(
        version.is_some_and(|v| v.starts_with(&format!("{major}."))),
        "{what}: server version {version:?}, not PostgreSQL {major}"
    );
}
