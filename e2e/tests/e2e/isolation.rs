//! Tenant isolation (issue 21): a Database's owner plants, in its own database, code that
//! does nothing as the owner and takes the server over when anything runs it with the
//! admin's privileges (`dbops_e2e::traps`: triggers ENABLE ALWAYS and ENABLE REPLICA, an
//! index expression, a CHECK constraint, a generated column, a DEFAULT, functions and
//! operators in `public` that shadow built-ins, a schema named like the admin, and its
//! database's `search_path`); then each path that runs an admin session near that code
//! runs, against a real control plane, the three controllers and real servers:
//! (a) a Backup and a restore from it; (b) a Dump Migration; (c) a Logical Migration to
//! PostgreSQL 15, where the apply worker would run as the subscription's owner (the
//! admin): Auto chooses Dump (`LogicalUnsafeBefore16`) and Logical is refused at
//! Preflight; (d) a Logical Migration to PostgreSQL 17, which applies as the table owner;
//! (e) extensions, a trusted one created and an untrusted one refused
//! (`ExtensionNotAllowed`), and on PostgreSQL 13 shadows planted in the `postgres`
//! database, where every role may create in `public`; (f) drift repair.
//! Afterwards, on every server: no trap ran as the admin, no role `dbops_trap_*` nor any
//! new superuser, no role membership or attribute gained, no file made by a server.

use std::time::Duration;

use dbops_api::{
    Backup, BackupPhase, ChosenMode, Database, Migration, MigrationPhase, MigrationStep,
};
use dbops_e2e::fixtures::{
    Connection, approve_migration, create_admin_secret, create_backup, create_migration,
    merge_patch,
};
use dbops_e2e::postgres::{LOGICAL_REPLICATION, redact_passwords};
use dbops_e2e::traps::{Traps, pinned_superuser, reached};
use dbops_e2e::wait::{Want, database_has, wait_for};
use dbops_e2e::{ControllerProcess, PgServer};
use kube::api::Api;
use serde_json::json;

use crate::{Bed, bed};
use dbops_e2e::harness::migration::{READY, SAGA, condition, phase_of};

/// Why Auto does not choose, and Logical refuses, a target older than PostgreSQL 16.
const UNSAFE_BEFORE_16: &str = "LogicalUnsafeBefore16";

/// One test's world. Dropped in field order: controllers, servers, then the namespace.
struct World {
    _controllers: Vec<ControllerProcess>,
    /// (name, server), each with the admin Secret and DatabaseServer [`admin`]`(name)`.
    servers: Vec<(&'static str, PgServer)>,
    b: Bed,
    traps: Traps,
    _store: tempfile::TempDir,
    logs: tempfile::TempDir,
}

/// The admin Secret (and so the DatabaseServer's suffix) of server `name`.
fn admin(name: &str) -> String {
    format!("{name}-admin")
}

/// A client program of Debian's PostgreSQL (pg_dump 15 dumps 13 to 15, its pg_restore
/// restores into 13 to 17).
fn bin(program: &str) -> String {
    let dir = dbops_e2e::paths::postgres_bin_dir().unwrap();
    dir.join(program).display().to_string()
}

impl World {
    /// Servers `(name, major)`, each able to be a Logical source
    /// ([`LOGICAL_REPLICATION`]), their admin Secrets and DatabaseServers, a file backup
    /// store and the three controllers (this namespace only, resync 5 s).
    async fn start(prefix: &str, servers: &[(&'static str, u32)]) -> Self {
        let b = bed(prefix).await;
        let mut started = Vec::new();
        for &(name, major) in servers {
            let pg = PgServer::start_major_with_settings(
                &format!("{prefix}-{name}"),
                major,
                LOGICAL_REPLICATION,
            )
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
            create_admin_secret(&b.client, b.ns.name(), &admin(name), &pg)
                .await
                .unwrap();
            started.push((name, pg));
        }
        let store = crate::test_dir(prefix, "store");
        let logs = crate::test_dir(prefix, "logs");
        let identities = crate::controller_identities(b.cp).await;
        let store_arg = format!("--backup-store=file://{}", store.path().display());
        let (pg_dump, pg_restore) = (
            format!("--pg-dump={}", bin("pg_dump")),
            format!("--pg-restore={}", bin("pg_restore")),
        );
        let flags = [
            (
                "database-controller",
                vec![store_arg.clone(), pg_restore.clone()],
            ),
            ("backup-controller", vec![store_arg, pg_dump.clone()]),
            ("migration-controller", vec![pg_dump, pg_restore]),
        ];
        let controllers = flags
            .into_iter()
            .map(|(name, extra)| {
                let mut args = crate::watch_args(b.ns.name(), "5s");
                args.extend(extra);
                ControllerProcess::start(name, &identities[name], logs.path(), &args)
                    .unwrap_or_else(|e| panic!("starting the {name}: {e:#}"))
            })
            .collect();
        Self {
            _controllers: controllers,
            servers: started,
            b,
            traps: Traps::new().unwrap(),
            _store: store,
            logs,
        }
    }

    fn ns(&self) -> &str {
        self.b.ns.name()
    }

    fn pg(&self, name: &str) -> &PgServer {
        self.servers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, pg)| pg)
            .unwrap_or_else(|| panic!("no server {name}"))
    }

    fn redact(&self, text: &str) -> String {
        let mut text = text.to_string();
        for (name, pg) in &self.servers {
            text = text.replace(pg.superuser_password(), &format!("<{name}-password>"));
        }
        redact_passwords(&text)
    }

    fn logs_of_all(&self) -> String {
        [
            "database-controller",
            "backup-controller",
            "migration-controller",
        ]
        .iter()
        .map(|c| {
            let path = self.logs.path().join(format!("{c}.log"));
            let tail = dbops_e2e::process::log_tail(&path, 6_000);
            format!("---- {c} log ----\n{}", self.redact(&tail))
        })
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// Polls `api`'s object `name` until `done` holds; on timeout the panic shows what was
    /// last seen and the controllers' logs.
    async fn wait<K>(
        &self,
        api: Api<K>,
        name: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&K) -> bool,
    ) -> K
    where
        K: kube::Resource<DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + serde::Serialize
            + std::fmt::Debug,
    {
        dbops_e2e::wait::object_or_logs(&api, name, what, timeout, done, || self.logs_of_all())
            .await
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// Database `name` on server `on` with `extra` merged into its spec, Ready.
    async fn create_database(&self, name: &str, on: &str, extra: serde_json::Value) -> Database {
        dbops_e2e::fixtures::create_database(&self.b.client, self.ns(), name, &admin(on), extra)
            .await
            .unwrap();
        self.wait_database(name, Want::provisioned()).await
    }

    async fn wait_database(&self, name: &str, want: Want<'_>) -> Database {
        self.wait(self.api(), name, &want.to_string(), READY, |db| {
            database_has(db, want)
        })
        .await
    }

    async fn patch_database(&self, name: &str, spec: serde_json::Value) {
        merge_patch(&self.api::<Database>(), name, json!({ "spec": spec }))
            .await
            .unwrap();
    }

    /// A session as the Database's owner, where its connection Secret says now; and the
    /// owner's name.
    async fn owner(&self, db: &str) -> (String, tokio_postgres::Client) {
        let c = Connection::of_database(&self.b.client, self.ns(), db)
            .await
            .unwrap();
        let (client, connection) = c
            .config()
            .connect_timeout(Duration::from_secs(5))
            .connect(tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        (c.user, client)
    }

    /// Database `name` on `on`, Ready, with every trap planted by its owner; the owner.
    async fn trapped_database(&self, name: &str, on: &str, extra: serde_json::Value) -> String {
        self.create_database(name, on, extra).await;
        let (owner, client) = self.owner(name).await;
        self.traps
            .plant_in_own_database(&client, &owner)
            .await
            .unwrap();
        owner
    }

    /// Panics, saying which trap fired where and as whom, unless nothing escalated on
    /// any server of this world.
    async fn assert_no_escalation(&self, after: &str) {
        let servers: Vec<(&str, &PgServer)> = self.servers.iter().map(|(n, pg)| (*n, pg)).collect();
        let found = self.traps.escalations(&servers).await.unwrap();
        assert!(
            found.is_empty(),
            "after {after}, the tenant's code ran with the admin's privileges:\n{}",
            self.redact(&found.join("\n"))
        );
    }

    async fn create_migration(&self, name: &str, db: &str, to: &str, spec: serde_json::Value) {
        create_migration(&self.b.client, self.ns(), name, db, &admin(to), spec)
            .await
            .unwrap();
    }

    async fn wait_phase(&self, name: &str, phase: MigrationPhase) -> Migration {
        self.wait(self.api(), name, &format!("phase {phase:?}"), SAGA, |m| {
            phase_of(m) == Some(phase)
        })
        .await
    }

    /// Waits for Migration `name` to end (Succeeded, Failed or RolledBack).
    async fn wait_end(&self, name: &str) -> Migration {
        self.wait(self.api(), name, "its end", SAGA, |m: &Migration| {
            phase_of(m).is_some_and(MigrationPhase::is_final)
        })
        .await
    }

    /// The schema extension `ext` is in, in database `db` of server `on`.
    async fn extension_schema(&self, on: &str, db: &str, ext: &str) -> Option<String> {
        pinned_superuser(self.pg(on), db)
            .await
            .unwrap()
            .query_opt(
                "SELECT n.nspname::text FROM pg_extension e \
                   JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = $1",
                &[&ext],
            )
            .await
            .unwrap()
            .map(|r| r.get(0))
    }

    async fn connection_limit(&self, on: &str, db: &str) -> i32 {
        pinned_superuser(self.pg(on), "postgres")
            .await
            .unwrap()
            .query_one(
                "SELECT datconnlimit FROM pg_database WHERE datname = $1",
                &[&db],
            )
            .await
            .unwrap()
            .get(0)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.ns(), self.logs_of_all());
            for (name, pg) in &self.servers {
                eprintln!(
                    "---- {name} postgres log tail ----\n{}",
                    self.redact(&pg.log_tail(4000))
                );
            }
        }
    }
}

/// Rows of `public.trapped`, read by the Database's owner where its Secret points.
async fn trapped_rows(w: &World, db: &str) -> i64 {
    let (_, client) = w.owner(db).await;
    client
        .query_one("SELECT count(*) FROM public.trapped", &[])
        .await
        .unwrap()
        .get(0)
}

/// The trap `origin` ran on `pg` (so the path under test did run the tenant's code), and
/// as `owner` among others.
fn assert_reached_as(pg: &PgServer, origin: &str, owner: &str) {
    let users = reached(pg, origin).unwrap();
    assert!(
        users.iter().any(|u| u == owner),
        "trap {origin} never ran as {owner}: {users:?}"
    );
}

/// (a) A Backup of the trapped Database (pg_dump as the admin) and a new Database restored
/// from it (pg_restore as the new owner, which rebuilds the index and checks every row):
/// the tenant's code runs only as its owners.
#[tokio::test]
async fn a_backup_and_a_restore_run_no_tenant_code_as_the_admin() {
    let w = World::start("iso-restore", &[("pg", 15)]).await;
    w.trapped_database("app", "pg", json!({})).await;
    create_backup(&w.b.client, w.ns(), "app-1", "app", json!({}))
        .await
        .unwrap();
    w.wait(w.api::<Backup>(), "app-1", "Completed", READY, |b| {
        b.status.as_ref().and_then(|s| s.phase) == Some(BackupPhase::Completed)
    })
    .await;
    let restore = json!({"restoreFrom": {"backupRef": {"name": "app-1"}}});
    w.create_database("copy", "pg", restore).await;

    w.assert_no_escalation("a backup and a restore").await;
    assert_eq!(trapped_rows(&w, "copy").await, 3);
    let (copy_owner, _) = w.owner("copy").await;
    assert_reached_as(w.pg("pg"), "index", &copy_owner);
    assert_reached_as(w.pg("pg"), "check", &copy_owner);
}

/// (b) A Dump Migration of the trapped Database to another server: the snapshot Backup,
/// the copy (pg_restore as the owner), Verify (reading both databases' tables as the
/// admin) and the switch run no tenant code as the admin.
#[tokio::test]
async fn a_dump_migration_runs_no_tenant_code_as_the_admin() {
    let w = World::start("iso-dump", &[("source", 15), ("target", 15)]).await;
    let owner = w.trapped_database("app", "source", json!({})).await;
    w.create_migration("app-move", "app", "target", json!({"mode": "Dump"}))
        .await;
    let m = w.wait_end("app-move").await;

    w.assert_no_escalation("a Dump Migration").await;
    assert_eq!(phase_of(&m), Some(MigrationPhase::Succeeded));
    assert_eq!(
        m.status.as_ref().and_then(|s| s.mode),
        Some(ChosenMode::Dump)
    );
    assert_eq!(trapped_rows(&w, "app").await, 3, "on the target");
    assert_reached_as(w.pg("target"), "index", &owner);
}

/// (c) To a PostgreSQL 15 target, whose apply worker runs the tenant's triggers, index
/// expressions, checks and generated columns as the subscription's owner (the admin):
/// mode Auto chooses Dump and says why, mode Logical is refused at Preflight; neither
/// escalates.
#[tokio::test]
async fn to_15_auto_chooses_dump_and_logical_is_refused() {
    let w = World::start("iso-logical15", &[("source", 15), ("target", 15)]).await;
    w.trapped_database("auto", "source", json!({})).await;
    w.trapped_database("logical", "source", json!({})).await;
    w.create_migration("auto-move", "auto", "target", json!({}))
        .await;
    w.create_migration(
        "logical-move",
        "logical",
        "target",
        json!({"mode": "Logical"}),
    )
    .await;
    let auto = w.wait_end("auto-move").await;
    let logical = w.wait_end("logical-move").await;

    w.assert_no_escalation("Migrations to PostgreSQL 15 in modes Auto and Logical")
        .await;
    // Auto: Dump, saying why.
    assert_eq!(phase_of(&auto), Some(MigrationPhase::Succeeded));
    assert_eq!(
        auto.status.as_ref().and_then(|s| s.mode),
        Some(ChosenMode::Dump)
    );
    let chosen = condition(&auto, "ModeChosen").unwrap();
    assert_eq!(
        (chosen.status.as_str(), chosen.reason.as_str()),
        ("False", UNSAFE_BEFORE_16),
        "{chosen:?}"
    );
    assert_eq!(trapped_rows(&w, "auto").await, 3, "on the target");
    // Logical: refused before anything changed.
    assert_eq!(phase_of(&logical), Some(MigrationPhase::RolledBack));
    let failed = condition(&logical, "Failed").unwrap();
    assert_eq!(failed.reason, UNSAFE_BEFORE_16, "{failed:?}");
    assert_eq!(
        logical.status.as_ref().and_then(|s| s.failed_step),
        Some(MigrationStep::Preflight)
    );
    assert!(!w.pg("target").database_exists("logical").await.unwrap());
}

/// (d) To a PostgreSQL 17 target, which applies as the table owner: the Logical Migration
/// (a Manual cutover, the owner writing on the source meanwhile) succeeds, the target's
/// replication workers ran the tenant's triggers (ALWAYS and REPLICA) and index as the
/// owner, and nothing escalated.
#[tokio::test]
async fn to_17_a_logical_migration_applies_as_the_owner() {
    let w = World::start("iso-logical17", &[("source", 15), ("target", 17)]).await;
    let owner = w.trapped_database("app", "source", json!({})).await;
    let spec = json!({"mode": "Logical", "cutover": "Manual"});
    w.create_migration("app-move", "app", "target", spec).await;
    w.wait_phase("app-move", MigrationPhase::AwaitingApproval)
        .await;
    // Before SwitchTraffic the tenant cannot reach the target database, where it could
    // add a trigger for the apply to run: its Secret's password does not log in there.
    let c = Connection::of_database(&w.b.client, w.ns(), "app")
        .await
        .unwrap();
    let early = w.pg("target").connect(&c.user, &c.password, "app").await;
    assert!(
        early.is_err(),
        "the owner logged into the target before SwitchTraffic"
    );
    let (_, source) = w.owner("app").await;
    source
        .batch_execute("INSERT INTO public.trapped (id, v) VALUES (4, 4), (5, 5)")
        .await
        .unwrap();
    drop(source);
    approve_migration(&w.api(), "app-move").await.unwrap();
    let m = w.wait_end("app-move").await;

    w.assert_no_escalation("a Logical Migration to PostgreSQL 17")
        .await;
    assert_eq!(phase_of(&m), Some(MigrationPhase::Succeeded));
    assert_eq!(
        m.status.as_ref().and_then(|s| s.mode),
        Some(ChosenMode::Logical)
    );
    assert_eq!(trapped_rows(&w, "app").await, 5, "on the target");
    for origin in ["always_trigger", "replica_trigger", "index", "generated"] {
        assert_reached_as(w.pg("target"), origin, &owner);
    }
}

/// (e) Extensions: with the traps planted, a trusted extension is created, in `public`
/// (not in the tenant's schema named like the admin), by a session the traps do not
/// reach; then an extension neither trusted nor in the server's `allowedExtensions`
/// (absent) is refused with `ExtensionNotAllowed` naming it, and is not created.
#[tokio::test]
async fn a_trusted_extension_is_created_safely_and_an_untrusted_one_refused() {
    let w = World::start("iso-extensions", &[("pg", 15)]).await;
    w.trapped_database("app", "pg", json!({})).await;
    w.patch_database("app", json!({"extensions": ["citext"]}))
        .await;
    w.wait_database("app", Want::provisioned()).await;
    w.assert_no_escalation("creating extension citext").await;
    assert_eq!(
        w.extension_schema("pg", "app", "citext").await.as_deref(),
        Some("public")
    );

    w.patch_database("app", json!({"extensions": ["citext", "file_fdw"]}))
        .await;
    let db = w
        .wait_database(
            "app",
            Want::new("Ready", "False", Some("ExtensionNotAllowed")),
        )
        .await;
    let ready = db
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .unwrap();
    assert!(ready.message.contains("file_fdw"), "{ready:?}");
    assert_eq!(w.extension_schema("pg", "app", "file_fdw").await, None);
    w.assert_no_escalation("refusing extension file_fdw").await;
}

/// (e) On PostgreSQL 13 (and 14) every role may create in `public` of the `postgres`
/// database, where the controllers observe and provision: a tenant's shadows of built-ins
/// planted there never run as the admin, while another Database is provisioned and the
/// tenant's is repaired.
#[tokio::test]
async fn on_13_shadows_in_the_postgres_database_never_run_as_the_admin() {
    let w = World::start("iso-pg13", &[("pg13", 13)]).await;
    w.create_database("app", "pg13", json!({})).await;
    let c = Connection::of_database(&w.b.client, w.ns(), "app")
        .await
        .unwrap();
    let shared = w
        .pg("pg13")
        .connect(&c.user, &c.password, "postgres")
        .await
        .unwrap();
    w.traps.plant_shadows(&shared, &c.user).await.unwrap();
    drop(shared);

    w.create_database("second", "pg13", json!({})).await;
    w.patch_database("app", json!({"connectionLimit": 5})).await;
    w.wait_database("app", Want::provisioned()).await;
    assert_eq!(w.connection_limit("pg13", "app").await, 5);
    w.assert_no_escalation("provisioning and repairs on PostgreSQL 13")
        .await;
}

/// (f) Drift repair with the traps planted: the managed extension dropped (by its owner
/// when it may, else behind the controller's back by an admin) and the connection limit
/// changed by the owner are repaired, the extension in `public` again, and nothing
/// escalates. (The controller's session to the database may predate the database's new
/// `search_path`: pooled sessions keep theirs.)
#[tokio::test]
async fn drift_repair_runs_no_tenant_code_as_the_admin() {
    let w = World::start("iso-drift", &[("pg", 15)]).await;
    w.trapped_database("app", "pg", json!({"extensions": ["citext"]}))
        .await;
    let (_, owner) = w.owner("app").await;
    if let Err(e) = owner.batch_execute("DROP EXTENSION citext").await {
        println!("the owner may not drop citext ({e}): the admin drops it");
        pinned_superuser(w.pg("pg"), "app")
            .await
            .unwrap()
            .batch_execute("DROP EXTENSION citext")
            .await
            .unwrap();
    }
    owner
        .batch_execute("ALTER DATABASE app CONNECTION LIMIT 7")
        .await
        .unwrap();
    drop(owner);
    wait_for(
        "citext re-created and the connection limit set back to -1",
        Duration::from_secs(90),
        || async {
            Ok((
                w.extension_schema("pg", "app", "citext").await,
                w.connection_limit("pg", "app").await,
            ))
        },
        |(schema, limit)| schema.is_some() && *limit == -1,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", w.logs_of_all()));
    w.assert_no_escalation("repairing the drift").await;
    assert_eq!(
        w.extension_schema("pg", "app", "citext").await.as_deref(),
        Some("public"),
        "re-created where it was, not in the tenant's schema named like the admin"
    );
}
