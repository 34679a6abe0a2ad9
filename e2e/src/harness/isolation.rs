#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The tenant-isolation tests' world: servers of the majors a test names (each with its admin
//! Secret and DatabaseServer), the three controllers, Databases whose owners plant traps
//! (`crate::traps`), and the checks that no trap ran as the admin.

use dbops_api::{Database, Migration, MigrationPhase};
use kube::api::Api;

use crate::controllers::ControllerProcess;
use crate::fixtures::{Connection, create_admin_secret_of, create_migration, merge_patch_spec};
use crate::harness::bed::{Bed, bed};
use crate::harness::majors::start_logical_source;
use crate::harness::migration::{READY, SAGA, phase_of};
use crate::harness::object::Logged;
use crate::harness::redact::redact;
use crate::postgres::PgServer;
use crate::postgres::admin::AdminKind;
use crate::traps::{Traps, pinned_superuser, reached};
use crate::wait::{Want, database_has};

/// Why Auto does not choose, and Logical refuses, a target older than PostgreSQL 16.
pub const UNSAFE_BEFORE_16: &str = "LogicalUnsafeBefore16";

/// One test's world. Dropped in field order: controllers, servers, then the namespace.
pub struct World {
    _controllers: Vec<ControllerProcess>,
    /// (name, server), each with the admin Secret and DatabaseServer [`admin`]`(name)`.
    pub servers: Vec<(&'static str, PgServer)>,
    pub b: Bed,
    pub traps: Traps,
    _store: tempfile::TempDir,
    pub logs: tempfile::TempDir,
}

/// The admin Secret (and so the DatabaseServer's suffix) of server `name`.
pub fn admin(name: &str) -> String {
    format!("{name}-admin")
}

/// A client program of Debian's PostgreSQL (pg_dump 15 dumps 13 to 15, its pg_restore
/// restores into 13 to 17).
pub fn bin(program: &str) -> String {
    let dir = crate::paths::postgres_bin_dir().unwrap();
    dir.join(program).display().to_string()
}

impl Logged for World {
    fn logs_of_all(&self) -> String {
        [
            "database-controller",
            "backup-controller",
            "migration-controller",
        ]
        .iter()
        .map(|c| {
            let path = self.logs.path().join(format!("{c}.log"));
            let tail = crate::process::log_tail(&path, 6_000);
            format!("---- {c} log ----\n{}", self.redact(&tail))
        })
        .collect::<Vec<_>>()
        .join("\n")
    }
}

impl World {
    /// Servers `(name, major)`, each able to be a Logical source
    /// ([`crate::postgres::LOGICAL_REPLICATION`]), their admin Secrets and
    /// DatabaseServers, the first one's verification DatabaseServer (`<ns>-verify`), a
    /// file backup store and the three controllers (this namespace only, resync 5 s).
    pub async fn start(prefix: &str, servers: &[(&'static str, u32)]) -> Self {
        Self::start_as(prefix, servers, AdminKind::for_tests()).await
    }

    /// [`World::start`] with the admin `kind` in every server's admin Secret.
    pub async fn start_as(prefix: &str, servers: &[(&'static str, u32)], kind: AdminKind) -> Self {
        let b = bed(prefix).await;
        let mut started = Vec::new();
        for &(name, major) in servers {
            let pg = start_logical_source(&format!("{prefix}-{name}"), major).await;
            create_admin_secret_of(&b.client, b.ns.name(), &admin(name), &pg, kind)
                .await
                .unwrap();
            started.push((name, pg));
        }
        // The verification server: the first server again, as a DatabaseServer that admits
        // no namespace (`spec.verify` restores there).
        let verify_server = format!("{}-verify", b.ns.name());
        if let Some((first, pg)) = started.first() {
            let spec = crate::fixtures::verify_server_spec(pg, &admin(first));
            crate::fixtures::create_server(&b.client, b.ns.name(), &verify_server, spec)
                .await
                .unwrap();
        }
        let store = crate::harness::bed::test_dir(prefix, "store");
        let logs = crate::harness::bed::test_dir(prefix, "logs");
        let identities = crate::harness::bed::controller_identities(b.cp).await;
        let store_arg = format!("--backup-store=file://{}", store.path().display());
        let (pg_dump, pg_restore) = (
            format!("--pg-dump={}", bin("pg_dump")),
            format!("--pg-restore={}", bin("pg_restore")),
        );
        let flags = [
            (
                "database-controller",
                vec![store_arg.clone(), pg_restore.clone(), pg_dump.clone()],
            ),
            (
                "backup-controller",
                vec![
                    store_arg,
                    pg_dump.clone(),
                    pg_restore.clone(),
                    format!("--verify-server={verify_server}"),
                ],
            ),
            ("migration-controller", vec![pg_dump, pg_restore]),
        ];
        let controllers = flags
            .into_iter()
            .map(|(name, extra)| {
                let mut args = crate::harness::bed::watch_args(b.ns.name(), "5s");
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

    pub fn ns(&self) -> &str {
        self.b.ns.name()
    }

    pub fn pg(&self, name: &str) -> &PgServer {
        self.servers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, pg)| pg)
            .unwrap_or_else(|| panic!("no server {name}"))
    }

    pub fn redact(&self, text: &str) -> String {
        redact(text, self.servers.iter().map(|(name, pg)| (name, pg)))
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.b.client.clone(), self.ns())
    }

    /// Database `name` on server `on` with `extra` merged into its spec, Ready.
    pub async fn create_database(
        &self,
        name: &str,
        on: &str,
        extra: serde_json::Value,
    ) -> Database {
        crate::fixtures::create_database(&self.b.client, self.ns(), name, &admin(on), extra)
            .await
            .unwrap();
        self.wait_database(name, Want::provisioned()).await
    }

    pub async fn wait_database(&self, name: &str, want: Want<'_>) -> Database {
        self.wait(self.api(), name, &want.to_string(), READY, |db| {
            database_has(db, want)
        })
        .await
    }

    pub async fn patch_database(&self, name: &str, spec: serde_json::Value) {
        merge_patch_spec(&self.api::<Database>(), name, spec)
            .await
            .unwrap();
    }

    /// A session as the Database's owner, where its connection Secret says now; and the
    /// owner's name.
    pub async fn owner(&self, db: &str) -> (String, tokio_postgres::Client) {
        let c = Connection::of_database(&self.b.client, self.ns(), db)
            .await
            .unwrap();
        let client = c.connect().await.unwrap();
        (c.user, client)
    }

    /// Database `name` on `on`, Ready, with every trap planted by its owner; the owner.
    pub async fn trapped_database(&self, name: &str, on: &str, extra: serde_json::Value) -> String {
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
    pub async fn assert_no_escalation(&self, after: &str) {
        let servers: Vec<(&str, &PgServer)> = self.servers.iter().map(|(n, pg)| (*n, pg)).collect();
        let found = self.traps.escalations(&servers).await.unwrap();
        assert!(
            found.is_empty(),
            "after {after}, the tenant's code ran with the admin's privileges:\n{}",
            self.redact(&found.join("\n"))
        );
    }

    pub async fn create_migration(&self, name: &str, db: &str, to: &str, spec: serde_json::Value) {
        create_migration(&self.b.client, self.ns(), name, db, &admin(to), spec)
            .await
            .unwrap();
    }

    pub async fn wait_phase(&self, name: &str, phase: MigrationPhase) -> Migration {
        self.wait(self.api(), name, &format!("phase {phase:?}"), SAGA, |m| {
            phase_of(m) == Some(phase)
        })
        .await
    }

    /// Waits for Migration `name` to end (Succeeded, Failed or RolledBack).
    pub async fn wait_end(&self, name: &str) -> Migration {
        self.wait(self.api(), name, "its end", SAGA, |m: &Migration| {
            phase_of(m).is_some_and(MigrationPhase::is_final)
        })
        .await
    }

    /// The schema extension `ext` is in, in database `db` of server `on`.
    pub async fn extension_schema(&self, on: &str, db: &str, ext: &str) -> Option<String> {
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

    pub async fn connection_limit(&self, on: &str, db: &str) -> i32 {
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
        self.print_if_panicking(self.ns(), &self.servers, 4000, |text| self.redact(text));
    }
}

/// Rows of `public.trapped`, read by the Database's owner where its Secret points.
pub async fn trapped_rows(w: &World, db: &str) -> i64 {
    let (_, client) = w.owner(db).await;
    client
        .query_one("SELECT count(*) FROM public.trapped", &[])
        .await
        .unwrap()
        .get(0)
}

/// The trap `origin` ran on `pg` (so the path under test did run the tenant's code), and
/// as `owner` among others.
pub fn assert_reached_as(pg: &PgServer, origin: &str, owner: &str) {
    let users = reached(pg, origin).unwrap();
    assert!(
        users.iter().any(|u| u == owner),
        "trap {origin} never ran as {owner}: {users:?}"
    );
}
