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

use dbops_api::{Backup, BackupPhase, ChosenMode, MigrationPhase, MigrationStep};
use dbops_e2e::fixtures::{Connection, approve_migration, create_backup};
use dbops_e2e::harness::isolation::{UNSAFE_BEFORE_16, World, assert_reached_as, trapped_rows};
use dbops_e2e::harness::migration::{READY, condition, mode_of, phase_of};
use dbops_e2e::harness::object::Logged;
use dbops_e2e::postgres::admin::AdminKind;
use dbops_e2e::traps::pinned_superuser;
use dbops_e2e::wait::{Want, wait_for};
use serde_json::json;

/// (a) A verified Backup of the trapped Database (pg_dump and the row counts of its
/// snapshot as the admin; the verification's pg_restore and counts as a throwaway role)
/// and a new Database restored from it (pg_restore as the new owner, which rebuilds the
/// index and checks every row): the tenant's code runs only as its owners and as the
/// verification's throwaway role.
#[tokio::test]
async fn a_backup_its_verification_and_a_restore_run_no_tenant_code_as_the_admin() {
    let w = World::start("iso-restore", &[("pg", 15)]).await;
    w.trapped_database("app", "pg", json!({})).await;
    let backup = create_backup(&w.b.client, w.ns(), "app-1", "app", json!({"verify": true}))
        .await
        .unwrap();
    let passed = w
        .wait(
            w.api::<Backup>(),
            "app-1",
            "Completed and verified",
            READY,
            |b| {
                b.status.as_ref().and_then(|s| s.phase) == Some(BackupPhase::Completed)
                    && b.status
                        .as_ref()
                        .and_then(|s| s.verification.as_ref())
                        .is_some_and(|v| v.result.as_str() != "Running")
            },
        )
        .await;
    let v = passed.status.unwrap().verification.unwrap();
    assert_eq!(v.result.as_str(), "Passed", "{v:?}");
    assert_eq!(v.rows, Some(3), "{v:?}");
    let scratch = format!("dbops-verify-{}", backup.metadata.uid.unwrap());
    assert_reached_as(w.pg("pg"), "check", &scratch);
    w.assert_no_escalation("a verified backup").await;
    let restore = json!({"restoreFrom": {"backupRef": {"name": "app-1"}}});
    w.create_database("copy", "pg", restore).await;

    w.assert_no_escalation("a backup and a restore").await;
    assert_eq!(trapped_rows(&w, "copy").await, 3);
    let (copy_owner, _) = w.owner("copy").await;
    assert_reached_as(w.pg("pg"), "index", &copy_owner);
    assert_reached_as(w.pg("pg"), "check", &copy_owner);
}

/// A clone of the trapped Database (`cloneFrom.databaseRef`, with a masked column): the
/// snapshot and the catalog reads on the source as the admin, pg_dump as the admin, and
/// psql as the clone's owner, which rebuilds the index and checks every row: the tenant's
/// code runs only as the clone's owner.
#[tokio::test]
async fn a_clone_runs_no_tenant_code_as_the_admin() {
    let w = World::start("iso-clone", &[("pg", 15)]).await;
    w.trapped_database("app", "pg", json!({})).await;
    let clone = json!({"cloneFrom": {"databaseRef": {"name": "app"}}});
    w.create_database("copy", "pg", clone).await;

    w.assert_no_escalation("a clone").await;
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
    assert_eq!(mode_of(&m), Some(ChosenMode::Dump));
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
    assert_eq!(mode_of(&auto), Some(ChosenMode::Dump));
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
/// owner, and nothing escalated. With the suite's admin (a managed service's, not a
/// superuser: the subscription logs in to the 15 source as the admin itself) and, below,
/// with a superuser, whose Verify counts before the freeze on a source the tenant can
/// still reach.
#[tokio::test]
async fn to_17_a_logical_migration_applies_as_the_owner() {
    logical_to_17("iso-logical17", AdminKind::for_tests()).await;
}

/// (d) with a superuser admin.
#[tokio::test]
async fn to_17_a_logical_migration_applies_as_the_owner_with_a_superuser_admin() {
    logical_to_17("iso-logical17su", AdminKind::Superuser).await;
}

async fn logical_to_17(prefix: &str, admin: AdminKind) {
    let w = World::start_as(prefix, &[("source", 15), ("target", 17)], admin).await;
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
    assert_eq!(mode_of(&m), Some(ChosenMode::Logical));
    // Both servers have wal_level=logical: with a superuser admin the rows were counted
    // before the freeze, on a source the tenant could still reach, and nothing escalated
    // (above); another admin may not read pg_replication_origin_status and counts in it.
    let verify = m.status.as_ref().and_then(|s| {
        let step = s.steps.iter().find(|x| x.name == MigrationStep::Verify);
        step.and_then(|x| x.message.clone())
    });
    let counted = if admin.counts_before_the_freeze() {
        "counted before the freeze"
    } else {
        "counted in the freeze"
    };
    assert!(
        verify.as_deref().is_some_and(|v| v.contains(counted)),
        "{verify:?}"
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
        .wait_database("app", Want::not_ready("ExtensionNotAllowed"))
        .await;
    let ready = condition(&db, "Ready").unwrap();
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
