//! A DatabaseUser follows its Database through a Migration (issue 23), against a real
//! control plane, the three controllers and two real servers, PostgreSQL 15 to 17, in Dump
//! and in Logical mode: a ReadOnly and a ReadWrite user, Ready on the source and working
//! there, are after the Migration's success set up on the target (their roles, and their
//! privileges, which the copy leaves out with `--no-privileges`, on what was copied and on
//! what the owner creates there later); their connection Secrets name the target and log
//! in there; their status names the target; and none of their roles is left on the source
//! (kept frozen: `sourceRetention: Keep`).

use std::time::{Duration, Instant};

use dbops_api::{ChosenMode, Database, DatabaseUser, MigrationPhase};
use dbops_e2e::harness::database::{connect, value};
use dbops_e2e::harness::migration::{READY, SOURCE_ADMIN, Setup, TARGET_ADMIN, mode_of, phase_of};
use dbops_e2e::harness::users::refused;
use dbops_e2e::postgres::{LOGICAL_REPLICATION, scalar};
use dbops_e2e::wait::eventually;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_postgres::error::SqlState;

/// The Database of these tests, and its two users.
const DB: &str = "shop";
const READER: &str = "shop-ro";
const WRITER: &str = "shop-rw";

fn users(s: &Setup) -> Api<DatabaseUser> {
    Api::namespaced(s.b.client.clone(), s.ns())
}

async fn create_user(s: &Setup, name: &str, access: &str) {
    let user: DatabaseUser = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "DatabaseUser",
        "metadata": {"name": name},
        "spec": {"databaseRef": {"name": DB}, "access": access},
    }))
    .unwrap();
    users(s)
        .create(&PostParams::default(), &user)
        .await
        .unwrap_or_else(|e| panic!("creating DatabaseUser {name}: {e}"));
}

/// The logs a failed wait shows: the database-controller's (the user controller runs in
/// it) and the migration-controller's.
fn logs(s: &Setup) -> String {
    format!(
        "---- database-controller log ----\n{}\n---- migration-controller log ----\n{}",
        s.log("database-controller", 12_000),
        s.log("migration-controller", 4_000)
    )
}

/// Waits until the user is Ready (`UserReady`) for its generation, on DatabaseServer
/// `server`, and `also` holds.
async fn wait_user_on(
    s: &Setup,
    name: &str,
    server: &str,
    what: &str,
    timeout: Duration,
    also: impl Fn(&DatabaseUser) -> bool,
) -> DatabaseUser {
    dbops_e2e::wait::object_or_logs(
        &users(s),
        name,
        &format!("Ready (UserReady) on {server}, {what}"),
        timeout,
        |u| {
            let Some(st) = u.status.as_ref() else {
                return false;
            };
            st.observed_generation == u.metadata.generation
                && st.server.as_deref() == Some(server)
                && st
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True" && c.reason == "UserReady")
                && also(u)
        },
        || logs(s),
    )
    .await
}

/// A Secret shown by its name and keys only (never its values).
struct Keys(Secret);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&String> = self.0.data.iter().flat_map(|d| d.keys()).collect();
        write!(f, "Secret {:?} keys {keys:?}", self.0.metadata.name)?;
        if let Some(d) = &self.0.data {
            for k in ["host", "port", "username"] {
                if let Some(v) = d.get(k) {
                    write!(f, " {k}={:?}", String::from_utf8_lossy(&v.0))?;
                }
            }
        }
        Ok(())
    }
}

/// The user's connection Secret, once it names `port` on 127.0.0.1 (the test servers'
/// host, each on a port of its own).
async fn secret_naming(s: &Setup, user: &str, port: u16) -> Secret {
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    let name = format!("{user}-connection");
    let found = dbops_e2e::wait::wait_for(
        &format!("Secret {name} naming 127.0.0.1:{port}"),
        READY,
        || async { Ok(secrets.get_opt(&name).await?.map(Keys)) },
        |k| {
            k.as_ref().is_some_and(|k| {
                value(&k.0, "host") == "127.0.0.1" && value(&k.0, "port") == port.to_string()
            })
        },
    )
    .await;
    match found {
        Ok(k) => k.unwrap().0,
        Err(e) => panic!("{e:#}\n{}", logs(s)),
    }
}

/// A session with exactly what the Secret says.
async fn login_with(secret: &Secret) -> tokio_postgres::Client {
    let port: u16 = value(secret, "port").parse().unwrap();
    connect(
        &value(secret, "host"),
        port,
        &value(secret, "username"),
        &value(secret, "password"),
        &value(secret, "dbname"),
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "login {} with its Secret at {}:{port}: {e:#}",
            value(secret, "username"),
            value(secret, "host")
        )
    })
}

async fn count(c: &tokio_postgres::Client, table: &str, who: &str) -> i64 {
    c.query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap_or_else(|e| panic!("{who} cannot read {table}: {e}"))
        .get(0)
}

/// The major version of the server a session is on.
async fn major(c: &tokio_postgres::Client) -> i32 {
    let version: i32 = scalar(c, "SELECT current_setting('server_version_num')::int").await;
    version / 10000
}

/// Roles on `pg` whose name starts with `prefix` (`_` matching itself).
async fn roles_like(pg: &dbops_e2e::PgServer, prefix: &str) -> anyhow::Result<Vec<String>> {
    let pattern = format!("{}%", prefix.replace('_', "\\_"));
    let admin = pg.connect_as_superuser().await?;
    Ok(admin
        .query(
            "SELECT rolname::text FROM pg_roles WHERE rolname LIKE $1 ORDER BY 1",
            &[&pattern],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The Database's owner, with what its connection Secret says now.
async fn owner(s: &Setup) -> tokio_postgres::Client {
    let c = s.connection(DB).await;
    connect(&c.host, c.port, &c.user, &c.password, &c.dbname)
        .await
        .unwrap()
}

/// The users' work on the source, the Migration to the target in `mode`, and the users'
/// work on the target afterwards.
async fn users_follow_their_database(s: &mut Setup, mode: ChosenMode) {
    let started = Instant::now();
    let (source, target) = (s.server(SOURCE_ADMIN), s.server(TARGET_ADMIN));
    s.start_migration_controller(&[]);
    s.create_database(DB).await;
    owner(s)
        .await
        .batch_execute(
            "CREATE TABLE items (id serial PRIMARY KEY, v text NOT NULL); \
             INSERT INTO items (v) SELECT md5(i::text) FROM generate_series(1, 100) i",
        )
        .await
        .unwrap();
    create_user(s, READER, "ReadOnly").await;
    create_user(s, WRITER, "ReadWrite").await;

    // On the source: Ready, the Secrets name it, reading and writing work.
    let mut groups = Vec::new();
    for user in [READER, WRITER] {
        let u = wait_user_on(s, user, &source, "set up", READY, |_| true).await;
        let group = u.status.unwrap().group_role.unwrap();
        assert_eq!(
            roles_like(&s.source, &group).await.unwrap(),
            [group.clone(), format!("{group}-1")],
            "{user}: its roles on the source"
        );
        groups.push(group);
    }
    let reader = login_with(&secret_naming(s, READER, s.source.port()).await).await;
    assert_eq!(major(&reader).await, 15, "the users log in on the source");
    assert_eq!(count(&reader, "items", "ReadOnly on the source").await, 100);
    assert_eq!(
        refused(&reader, "INSERT INTO items (v) VALUES ('ro')").await,
        SqlState::INSUFFICIENT_PRIVILEGE
    );
    let writer = login_with(&secret_naming(s, WRITER, s.source.port()).await).await;
    writer
        .batch_execute("INSERT INTO items (v) VALUES ('written on the source')")
        .await
        .unwrap();
    drop((reader, writer));

    // The Migration, to its success; the Database Ready on the target.
    let spec = match mode {
        ChosenMode::Dump => json!({"mode": "Dump"}),
        ChosenMode::Logical => json!({"mode": "Logical"}),
    };
    s.migrate("move", DB, spec, MigrationPhase::Succeeded).await;
    let moved = Instant::now();
    dbops_e2e::wait::object_or_logs(
        &s.databases(),
        DB,
        "Ready on the target",
        READY,
        |d: &Database| {
            d.spec.server_ref.name == target
                && d.status
                    .as_ref()
                    .is_some_and(|st| st.server.as_deref() == Some(target.as_str()))
                && dbops_e2e::wait::database_has(
                    d,
                    dbops_e2e::wait::Want::new("Ready", "True", None),
                )
        },
        || logs(s),
    )
    .await;
    let m = s.migrations().get("move").await.unwrap();
    assert_eq!(phase_of(&m), Some(MigrationPhase::Succeeded));
    assert_eq!(mode_of(&m), Some(mode));

    // Each user on the target: status, Secret, login.
    for user in [READER, WRITER] {
        wait_user_on(s, user, &target, "moved", READY, |_| true).await;
    }
    let reader = login_with(&secret_naming(s, READER, s.target.port()).await).await;
    let writer = login_with(&secret_naming(s, WRITER, s.target.port()).await).await;
    for c in [&reader, &writer] {
        assert_eq!(major(c).await, 17, "the users log in on the target");
    }
    // What was copied, with the privileges the copy left out.
    assert_eq!(count(&reader, "items", "ReadOnly on the target").await, 101);
    // What the owner creates on the target after the move.
    owner(s)
        .await
        .batch_execute(
            "CREATE TABLE after_move (id bigserial PRIMARY KEY, v text); \
             INSERT INTO after_move (v) VALUES ('owner')",
        )
        .await
        .unwrap();
    assert_eq!(
        count(&reader, "after_move", "ReadOnly on the target").await,
        1
    );
    for sql in [
        "INSERT INTO items (v) VALUES ('ro')",
        "INSERT INTO after_move (v) VALUES ('ro')",
        "DROP TABLE after_move",
    ] {
        assert_eq!(
            refused(&reader, sql).await,
            SqlState::INSUFFICIENT_PRIVILEGE,
            "ReadOnly on the target: {sql}"
        );
    }
    writer
        .batch_execute(
            "INSERT INTO items (v) VALUES ('written on the target'); \
             INSERT INTO after_move (v) VALUES ('rw'); \
             UPDATE after_move SET v = 'rw too' WHERE v = 'owner'",
        )
        .await
        .unwrap_or_else(|e| panic!("ReadWrite on the target: {e}"));
    assert_eq!(
        refused(&writer, "CREATE TABLE mine (id int)").await,
        SqlState::INSUFFICIENT_PRIVILEGE,
        "ReadWrite on the target: no DDL"
    );
    assert_eq!(count(&reader, "items", "ReadOnly on the target").await, 102);
    assert_eq!(
        count(&reader, "after_move", "ReadOnly on the target").await,
        2
    );

    // Nothing of the users is left on the source; both are still there on the target.
    for group in &groups {
        eventually(
            &format!("no role {group}* on the source"),
            READY,
            || roles_like(&s.source, group),
            |found| found.is_empty(),
        )
        .await;
        assert_eq!(
            roles_like(&s.target, group).await.unwrap(),
            [group.clone(), format!("{group}-1")],
            "the user's roles on the target"
        );
    }
    for user in [READER, WRITER] {
        let u = wait_user_on(s, user, &target, "no former server", READY, |u| {
            u.status
                .as_ref()
                .is_some_and(|st| st.former_server.is_none())
        })
        .await;
        assert_eq!(
            u.status.unwrap().role.as_deref(),
            Some(format!("{}-1", groups[if user == READER { 0 } else { 1 }]).as_str()),
            "{user}: the same login"
        );
    }
    println!(
        "users_migration: {mode:?} mode in {:.1}s, the users moved {:.1}s after the Migration's success",
        started.elapsed().as_secs_f64(),
        moved.elapsed().as_secs_f64()
    );
}

/// PostgreSQL 15 to 17 in Dump mode.
#[tokio::test]
async fn users_follow_a_dump_migration_from_15_to_17() {
    let mut s = Setup::with_logical_target("usrmig-dump").await;
    users_follow_their_database(&mut s, ChosenMode::Dump).await;
}

/// PostgreSQL 15 (`wal_level=logical`) to 17 in Logical mode.
#[tokio::test]
async fn users_follow_a_logical_migration_from_15_to_17() {
    let mut s = Setup::with_source_settings("usrmig-logical", LOGICAL_REPLICATION).await;
    users_follow_their_database(&mut s, ChosenMode::Logical).await;
}
