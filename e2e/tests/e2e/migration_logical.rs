//! The Logical mode of the migration-controller (issue 13) against a real control plane,
//! the three controllers and two real PostgreSQL servers, the source started with
//! `wal_level=logical`: a Database moves under a live writer that follows its connection
//! Secret (every committed write arrives; the longest gap between two successful commits
//! is printed); a Manual cutover waits while replicating with the source writable, and a
//! schema change on the source then rolls the Migration back; `Auto` on a source without
//! `wal_level=logical` falls back to Dump and says why, `Logical` is refused there; a
//! table without a primary key is refused; a controller killed mid-replication resumes.
//! After every end, no replication slot, publication, subscription or replication role
//! is left on either server.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbops_api::{ChosenMode, Migration, MigrationPhase, MigrationStep, StepState};
use dbops_e2e::wait::wait_for;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;

use crate::migration::{
    Conn, DEBUG_EXIT, SAGA, SOURCE_ADMIN, Setup, TARGET_ADMIN, condition, step_state,
};

/// The source's settings for logical replication.
const LOGICAL: &[(&str, &str)] = &[
    ("wal_level", "logical"),
    ("max_replication_slots", "10"),
    ("max_wal_senders", "10"),
];

async fn logical_setup(prefix: &str) -> Setup {
    Setup::with_source_settings(prefix, LOGICAL).await
}

/// A Database `app` on the source with `writes` (the writer's) and `items` (a serial key,
/// 10,000 rows): its sequence must arrive with the data.
async fn app_with_tables(s: &Setup) -> Conn {
    s.create_database("app").await;
    let c = s.connection("app").await;
    s.source
        .connect(&c.user, &c.password, "app")
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE writes (n bigint PRIMARY KEY, at timestamptz DEFAULT now()); \
             CREATE TABLE items (id serial PRIMARY KEY, v text); \
             INSERT INTO items (v) SELECT md5(i::text) FROM generate_series(1, 10000) i",
        )
        .await
        .unwrap();
    c
}

/// What a Migration of this test bed might leave behind, by server: replication slots,
/// publications (in `app`), subscriptions and roles named `dbops_mig_*`.
async fn leftovers(s: &Setup) -> Vec<String> {
    let mut found = Vec::new();
    for (side, pg) in [("source", &s.source), ("target", &s.target)] {
        let admin = pg.connect_as_superuser().await.unwrap();
        for (what, sql) in [
            ("slot", "SELECT slot_name::text FROM pg_replication_slots"),
            ("subscription", "SELECT subname::text FROM pg_subscription"),
            (
                "role",
                "SELECT rolname::text FROM pg_roles WHERE rolname LIKE 'dbops\\_mig\\_%'",
            ),
        ] {
            for row in admin.query(sql, &[]).await.unwrap() {
                found.push(format!("{side} {what} {}", row.get::<_, String>(0)));
            }
        }
        if pg.database_exists("app").await.unwrap() {
            let app = pg.connect_as_superuser_to("app").await.unwrap();
            for row in app
                .query("SELECT pubname::text FROM pg_publication", &[])
                .await
                .unwrap()
            {
                found.push(format!("{side} publication {}", row.get::<_, String>(0)));
            }
        }
    }
    found
}

/// A writer that behaves like an application: it inserts 1, 2, 3, ... (one autocommit
/// statement each) through the Database's connection Secret, and after a failure reads
/// the Secret again, so it follows the switch to the target. It records when each commit
/// succeeded.
struct Writer {
    committed: Arc<Mutex<Vec<(i64, Instant)>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn start(secrets: Api<Secret>, name: String) -> Self {
        use std::sync::atomic::Ordering;
        let committed = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (com, st) = (committed.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut client: Option<tokio_postgres::Client> = None;
            let mut n: i64 = 0;
            while !st.load(Ordering::Acquire) {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = connect(&secrets, &name).await;
                    if client.is_none() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                }
                n += 1;
                let Some(cl) = client.as_ref() else { continue };
                match cl
                    .execute("INSERT INTO writes (n) VALUES ($1)", &[&n])
                    .await
                {
                    Ok(_) => com.lock().unwrap().push((n, Instant::now())),
                    Err(_) => client = None,
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        Self {
            committed,
            stop,
            task,
        }
    }

    fn committed(&self) -> usize {
        self.committed.lock().unwrap().len()
    }

    async fn finish(self) -> Vec<(i64, Instant)> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.task.await.unwrap();
        self.committed.lock().unwrap().clone()
    }
}

/// A session as the connection Secret says now (`None` when it cannot log in).
async fn connect(secrets: &Api<Secret>, name: &str) -> Option<tokio_postgres::Client> {
    let secret = secrets.get(name).await.ok()?;
    let data = secret.data.unwrap_or_default();
    let value = |k: &str| {
        data.get(k)
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
            .unwrap_or_default()
    };
    let mut config = tokio_postgres::Config::new();
    config
        .host(value("PGHOST"))
        .port(value("PGPORT").parse().ok()?)
        .user(value("PGUSER"))
        .password(value("PGPASSWORD"))
        .dbname(value("PGDATABASE"))
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.ok()?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Some(client)
}

/// The longest time between two successful commits, and the commit before it.
fn longest_gap(committed: &[(i64, Instant)]) -> (Duration, i64) {
    committed
        .windows(2)
        .map(|w| (w[1].1 - w[0].1, w[0].0))
        .max()
        .unwrap_or_default()
}

fn mode_of(m: &Migration) -> Option<ChosenMode> {
    m.status.as_ref().and_then(|s| s.mode)
}

/// (1) The happy path under a live writer: the Database moves in Logical mode while the
/// writer commits; every committed write is on the target; the writer's longest gap is
/// reported; sequences follow; nothing of the replication is left.
#[tokio::test]
async fn logical_migration_keeps_every_write_and_leaves_nothing_behind() {
    let mut s = logical_setup("logical-happy").await;
    s.start_migration_controller(&[]);
    app_with_tables(&s).await;
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    let writer = Writer::start(secrets, "app-connection".into());
    wait_for(
        "the writer to commit 50 rows",
        Duration::from_secs(30),
        || async { Ok(writer.committed()) },
        |n| *n >= 50,
    )
    .await
    .unwrap();
    let started = Instant::now();
    s.create_migration("app-move", "app", json!({"mode": "Logical"}))
        .await;
    let done = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    let took = started.elapsed();
    // Writes reach the target through the rewritten Secret.
    let before = writer.committed();
    wait_for(
        "the writer to commit on the target",
        Duration::from_secs(60),
        || async { Ok(writer.committed()) },
        |n| *n >= before + 50,
    )
    .await
    .unwrap();
    let committed = writer.finish().await;
    let (gap, after) = longest_gap(&committed);
    println!(
        "logical migration: {} commits, migration {:.1}s, longest gap between two commits {:.3}s (after write {after})",
        committed.len(),
        took.as_secs_f64(),
        gap.as_secs_f64()
    );

    let status = done.status.clone().unwrap();
    assert_eq!(status.mode, Some(ChosenMode::Logical));
    let names: Vec<MigrationStep> = status.steps.iter().map(|s| s.name).collect();
    assert_eq!(names, MigrationStep::LOGICAL);
    for step in &status.steps {
        assert_eq!(step.state, StepState::Succeeded, "{step:?}");
    }
    let replication = status.replication.clone().unwrap();
    assert_eq!(replication.tables_total, 2);
    assert_eq!(replication.tables_copied, 2);
    assert!(replication.caught_up);
    assert!(
        condition(&done, "ModeChosen").is_some_and(|c| c.status == "True"),
        "{:?}",
        status.conditions
    );

    // Every committed write is on the target, and nothing never attempted.
    let target_db = s.target.connect_as_superuser_to("app").await.unwrap();
    let rows: BTreeSet<i64> = target_db
        .query("SELECT n FROM writes", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let committed_set: BTreeSet<i64> = committed.iter().map(|(n, _)| *n).collect();
    assert!(
        committed_set.is_subset(&rows),
        "committed rows missing on the target: {:?}",
        committed_set.difference(&rows).take(10).collect::<Vec<_>>()
    );
    let items = Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM items").await;
    assert_eq!(items, 10_000);
    // The sequence arrived: the next id follows the source's.
    let next =
        Setup::superuser_scalar_i64(&s.target, "app", "SELECT nextval('items_id_seq')::bigint")
            .await;
    assert_eq!(next, 10_001, "the sequence value was copied");

    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(TARGET_ADMIN));
    assert_eq!(leftovers(&s).await, Vec::<String>::new());

    // The subscription's connection string (with the replication role's password) is
    // in neither the controller's log nor the servers' statement logs.
    let log = s.log("migration-controller", 1_000_000);
    assert!(!log.contains("password="), "a conninfo in the log");
    for pg in [&s.source, &s.target] {
        let ddl = pg.ddl_statements().unwrap();
        assert!(
            !ddl.iter().any(|l| l.contains("password=")),
            "a conninfo in a server log"
        );
    }
    let events = s.events_about("Migration", "app-move").await;
    for step in MigrationStep::LOGICAL {
        let reason = format!("{}Succeeded", step.as_str());
        assert!(
            events
                .iter()
                .any(|e| e.reason.as_deref() == Some(reason.as_str())),
            "no {reason} Event"
        );
    }
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("LogicalModeChosen"))
    );
}

/// (2) A source without `wal_level=logical`: `Logical` is refused at Preflight (nothing
/// changed), `Auto` falls back to Dump and says why in a condition and an Event.
#[tokio::test]
async fn without_wal_level_logical_auto_dumps_and_logical_is_refused() {
    let mut s = Setup::new("logical-nowal").await;
    s.start_migration_controller(&[]);
    s.create_database("app").await;
    s.create_migration("app-logical", "app", json!({"mode": "Logical"}))
        .await;
    let m = s
        .wait_phase("app-logical", MigrationPhase::RolledBack, SAGA)
        .await;
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "WalLevelNotLogical", "{failed:?}");
    assert!(failed.message.contains("wal_level = logical"), "{failed:?}");
    assert_eq!(
        m.status.as_ref().unwrap().failed_step,
        Some(MigrationStep::Preflight)
    );
    assert_eq!(mode_of(&m), None, "no mode was chosen");
    assert_eq!(
        step_state(&m, MigrationStep::Snapshot),
        Some(StepState::Pending)
    );
    assert!(!s.target.database_exists("app").await.unwrap());

    s.create_migration("app-auto", "app", json!({})).await;
    let m = s
        .wait_phase("app-auto", MigrationPhase::Succeeded, SAGA)
        .await;
    assert_eq!(mode_of(&m), Some(ChosenMode::Dump));
    let chosen = condition(&m, "ModeChosen").unwrap();
    assert_eq!(chosen.status, "False");
    assert_eq!(chosen.reason, "WalLevelNotLogical");
    assert!(
        chosen.message.contains("mode Auto chose Dump"),
        "{chosen:?}"
    );
    let names: Vec<MigrationStep> = m
        .status
        .as_ref()
        .unwrap()
        .steps
        .iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, MigrationStep::DUMP);
    let events = s.events_about("Migration", "app-auto").await;
    let event = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("DumpModeChosen"))
        .expect("a DumpModeChosen Event");
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert!(
        event
            .message
            .as_deref()
            .is_some_and(|n| n.contains("WalLevelNotLogical"))
    );
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
}

/// (3) A table without a primary key or replica identity: `Logical` is refused at
/// Preflight naming it.
#[tokio::test]
async fn a_table_without_a_primary_key_is_refused() {
    let mut s = logical_setup("logical-nopk").await;
    s.start_migration_controller(&[]);
    let c = app_with_tables(&s).await;
    s.source
        .connect(&c.user, &c.password, "app")
        .await
        .unwrap()
        .batch_execute("CREATE TABLE no_pk (v text)")
        .await
        .unwrap();
    s.create_migration("app-move", "app", json!({"mode": "Logical"}))
        .await;
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "TablesWithoutReplicaIdentity", "{failed:?}");
    assert!(failed.message.contains("public.no_pk"), "{failed:?}");
    assert!(!s.target.database_exists("app").await.unwrap());
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
}

/// (4) Manual cutover: the Migration waits in AwaitingApproval while replicating, the
/// source writable (a write there arrives on the target); a column added on the source
/// then rolls it back (SchemaChanged) with nothing left on either server.
#[tokio::test]
async fn a_manual_cutover_replicates_until_a_schema_change_rolls_it_back() {
    let mut s = logical_setup("logical-manual").await;
    s.start_migration_controller(&[]);
    let c = app_with_tables(&s).await;
    s.create_migration(
        "app-move",
        "app",
        json!({"mode": "Logical", "cutover": "Manual"}),
    )
    .await;
    let m = s
        .wait_phase("app-move", MigrationPhase::AwaitingApproval, SAGA)
        .await;
    assert_eq!(
        step_state(&m, MigrationStep::Replicate),
        Some(StepState::Succeeded)
    );
    assert_eq!(
        step_state(&m, MigrationStep::FreezeSource),
        Some(StepState::Pending)
    );
    // The source is writable, and what is written there arrives on the target.
    let owner = s.source.connect(&c.user, &c.password, "app").await.unwrap();
    owner
        .execute("INSERT INTO writes (n) VALUES (424242)", &[])
        .await
        .expect("the source is writable while the Migration awaits approval");
    let target = s.target.connect_as_superuser_to("app").await.unwrap();
    wait_for(
        "the write to arrive on the target",
        Duration::from_secs(60),
        || async {
            Ok(target
                .query_one("SELECT count(*) FROM writes WHERE n = 424242", &[])
                .await?
                .get::<_, i64>(0))
        },
        |n| *n == 1,
    )
    .await
    .unwrap();
    drop(target);
    assert!(
        leftovers(&s)
            .await
            .iter()
            .any(|l| l.contains("source slot"))
    );

    // A schema change on the source: rolled back, saying why.
    owner
        .batch_execute("ALTER TABLE writes ADD COLUMN extra int")
        .await
        .unwrap();
    let m = s
        .wait_phase("app-move", MigrationPhase::RolledBack, SAGA)
        .await;
    let failed = condition(&m, "Failed").unwrap();
    assert_eq!(failed.reason, "SchemaChanged", "{failed:?}");
    assert!(failed.message.contains("writes.extra"), "{failed:?}");
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
    assert!(!s.target.database_exists("app").await.unwrap());
    owner
        .execute("INSERT INTO writes (n) VALUES (1)", &[])
        .await
        .expect("the source stays writable");
    let db = s.databases().get("app").await.unwrap();
    assert_eq!(db.spec.server_ref.name, s.server(SOURCE_ADMIN));
}

/// (5) The controller killed mid-replication (after Replicate's effects, at CatchUp's
/// start and after it, after Cleanup's): each new process resumes, and the Migration
/// ends Succeeded once, with nothing left on either server.
#[tokio::test]
async fn a_controller_killed_mid_replication_resumes_to_one_success() {
    let mut s = logical_setup("logical-crash").await;
    app_with_tables(&s).await;
    s.create_migration("app-move", "app", json!({"mode": "Logical"}))
        .await;
    for point in [
        "Replicate:started",
        "Replicate:done",
        "CatchUp:started",
        "CatchUp:done",
        "Cleanup:done",
    ] {
        s.start_migration_controller(&[&format!("--debug-exit-at={point}")]);
        let code = s.wait_migration_controller_exit(SAGA);
        assert_eq!(code, Some(DEBUG_EXIT), "the process stopped at {point}");
    }
    s.start_migration_controller(&[]);
    let m = s
        .wait_phase("app-move", MigrationPhase::Succeeded, SAGA)
        .await;
    for step in MigrationStep::LOGICAL {
        assert_eq!(step_state(&m, step), Some(StepState::Succeeded), "{step:?}");
    }
    let items = Setup::superuser_scalar_i64(&s.target, "app", "SELECT count(*) FROM items").await;
    assert_eq!(items, 10_000);
    assert_eq!(leftovers(&s).await, Vec::<String>::new());
    // Each object was created once, whatever the crashes.
    let source_ddl = s.source.ddl_statements().unwrap();
    let count = |needle: &str| source_ddl.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(count("CREATE PUBLICATION"), 1, "{source_ddl:#?}");
    assert_eq!(count("CREATE ROLE \"dbops_mig_"), 1, "{source_ddl:#?}");
    assert_eq!(count("CONNECTION LIMIT 0"), 1, "{source_ddl:#?}");
}
