//! The database-controller against a real control plane and real PostgreSQL servers: a
//! Database becomes a role, a database and a connection Secret applications can use;
//! deletion policies, crashes, outages, drift, conflicts and bad admin input.
//!
//! Each test has its own namespace, PostgreSQL server and controller process (watching
//! only that namespace, resync 3 s, backoff 1 s..5 s), run with a token of its own
//! ServiceAccount `dbops-system/dbops-database-controller` (the RBAC of `deploy/`), which
//! names it in the apiserver's audit log. No test prints a password:
//! Secrets are compared, never shown, and printed logs are redacted.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use dbops_api::DatabaseServer;
use dbops_e2e::fixtures::merge_patch;
use dbops_e2e::wait::{Want, describe_database, eventually, holds_for};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use rand::RngExt;
use rand::distr::{Alphanumeric, SampleString};
use serde_json::json;

use dbops_e2e::harness::database::{
    ADMIN_SECRET, CONTROLLER_USER, FINALIZER, READY, RESYNC, SECRET_KEYS, SecretView, Setup,
    connect, connect_config, has_finalizer, login, mark, merge, not_ready, ready, value,
};

// ---------------------------------------------------------------------------------------

/// 1. create → Ready (kubectl wait) → the connection Secret works for an application.
#[tokio::test]
async fn a_database_becomes_ready_and_its_secret_connects() {
    let s = Setup::new("db-ready").await;
    let ns = s.ns();
    let yaml = format!(
        "apiVersion: dbops.dev/v1alpha1\nkind: Database\nmetadata:\n  name: orders\nspec:\n  serverRef: {{name: {}}}\n  extensions: [pgcrypto]\n",
        s.server(ADMIN_SECRET)
    );
    let out = s.b.kubectl.apply(ns, &yaml).unwrap();
    assert!(out.success, "kubectl apply: {}", out.text());
    let out =
        s.b.kubectl
            .run(
                &[
                    "wait",
                    "--for=condition=Ready",
                    "database/orders",
                    "-n",
                    ns,
                    "--timeout=60s",
                ],
                None,
            )
            .unwrap();
    assert!(
        out.success,
        "kubectl wait --for=condition=Ready: {}\n{}\n---- controller log ----\n{}",
        out.text(),
        describe_database(&s.databases(), "orders").await,
        s.controller_log(6000)
    );

    // Status.
    let db = s.wait_ready("orders").await;
    let uid = db.metadata.uid.clone().unwrap();
    let status = db.status.clone().unwrap();
    let oid =
        s.pg.database_oid("orders")
            .await
            .unwrap()
            .expect("database orders exists");
    let port = s.pg.port();
    assert_eq!(status.phase, Some(dbops_api::DatabasePhase::Ready));
    assert_eq!(status.observed_generation, db.metadata.generation);
    assert_eq!(
        status.provider_id.as_deref(),
        Some(format!("127.0.0.1:{port}/{oid}").as_str())
    );
    assert_eq!(
        status.endpoint.as_deref(),
        Some(format!("127.0.0.1:{port}").as_str())
    );
    assert_eq!(status.database_name.as_deref(), Some("orders"));
    assert_eq!(
        status.connection_secret.as_deref(),
        Some("orders-connection")
    );
    assert_eq!(
        status.server.as_deref(),
        Some(s.server(ADMIN_SECRET).as_str())
    );
    let su = s.pg.connect_as_superuser().await.unwrap();
    let server_version: String = su
        .query_one("SHOW server_version", &[])
        .await
        .unwrap()
        .get(0);
    let reported = status.server_version.clone().unwrap_or_default();
    assert!(
        !reported.is_empty()
            && (server_version.starts_with(&reported)
                || reported.starts_with(server_version.split_whitespace().next().unwrap())),
        "status.serverVersion {reported:?} is not the server's {server_version:?}"
    );
    let ready_cond = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert!(
        !ready_cond.message.is_empty(),
        "the Ready condition has a message"
    );

    // In PostgreSQL: a login role owning the database, both marked, the extension.
    let role = su
        .query_one(
            "SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = 'orders'",
            &[],
        )
        .await
        .unwrap();
    assert!(role.get::<_, bool>(0), "role orders can log in");
    assert!(
        !role.get::<_, bool>(1) && !role.get::<_, bool>(2) && !role.get::<_, bool>(3),
        "role orders has no superuser, createdb or createrole"
    );
    assert_eq!(
        s.pg.database_owner("orders").await.unwrap().as_deref(),
        Some("orders")
    );
    assert_eq!(
        s.pg.database_comment("orders").await.unwrap(),
        Some(mark(&db))
    );
    assert_eq!(s.pg.role_comment("orders").await.unwrap(), Some(mark(&db)));
    let in_db =
        s.pg.connect("postgres", s.pg.superuser_password(), "orders")
            .await
            .unwrap();
    let ext = in_db
        .query_opt(
            "SELECT extname FROM pg_extension WHERE extname = 'pgcrypto'",
            &[],
        )
        .await
        .unwrap();
    assert!(
        ext.is_some(),
        "extension pgcrypto is created in database orders"
    );

    // The Secret: owned, labelled, every key, consistent.
    let secret = s.connection_secret("orders").await;
    let owner = secret
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.uid == uid)
        .unwrap_or_else(|| {
            panic!(
                "{:?} is not owned by the Database",
                SecretView(secret.clone())
            )
        });
    assert_eq!(owner.kind, "Database");
    assert_eq!(owner.controller, Some(true));
    let labels = secret.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("dbops")
    );
    assert_eq!(
        labels.get("dbops.dev/database").map(String::as_str),
        Some("orders")
    );
    for key in SECRET_KEYS {
        value(&secret, key);
    }
    let (host, port_s, dbname, user, password) = (
        value(&secret, "host"),
        value(&secret, "port"),
        value(&secret, "dbname"),
        value(&secret, "username"),
        value(&secret, "password"),
    );
    assert_eq!(host, "127.0.0.1");
    assert_eq!(port_s, port.to_string());
    assert_eq!(dbname, "orders");
    assert_eq!(user, "orders");
    assert!(
        password.len() >= 16,
        "the generated password has at least 16 characters"
    );
    assert_eq!(value(&secret, "PGHOST"), host);
    assert_eq!(value(&secret, "PGPORT"), port_s);
    assert_eq!(value(&secret, "PGDATABASE"), dbname);
    assert_eq!(value(&secret, "PGUSER"), user);
    assert!(
        value(&secret, "PGPASSWORD") == password,
        "PGPASSWORD differs from password"
    );
    let uri = tokio_postgres::Config::from_str(&value(&secret, "uri"))
        .unwrap_or_else(|e| panic!("the uri key does not parse as a PostgreSQL URI: {e}"));
    assert_eq!(
        uri.get_hosts(),
        &[tokio_postgres::config::Host::Tcp(host.clone())],
        "uri host"
    );
    assert_eq!(uri.get_ports(), &[port], "uri port");
    assert_eq!(uri.get_dbname(), Some("orders"), "uri dbname");
    assert_eq!(uri.get_user(), Some("orders"), "uri user");
    assert!(
        uri.get_password() == Some(password.as_bytes()),
        "the uri's password differs from the password key"
    );
    let jdbc = value(&secret, "jdbc-url");
    assert!(
        jdbc.starts_with(&format!("jdbc:postgresql://127.0.0.1:{port}/orders")),
        "jdbc-url does not point at 127.0.0.1:{port}/orders"
    );

    // Passwords reach PostgreSQL as SCRAM verifiers: its statement log never shows one.
    let server_log = std::fs::read_to_string(s.pg.log_path()).unwrap();
    assert!(
        !server_log.contains(password.as_str()),
        "the role's password appears in clear in the PostgreSQL server log"
    );

    // An application with exactly these values.
    let app = connect(&host, port_s.parse().unwrap(), &user, &password, &dbname)
        .await
        .unwrap();
    app.batch_execute("CREATE TABLE items (id serial PRIMARY KEY, name text NOT NULL)")
        .await
        .unwrap();
    app.execute("INSERT INTO items (name) VALUES ($1), ($2)", &[&"a", &"b"])
        .await
        .unwrap();
    let names: Vec<String> = app
        .query("SELECT name FROM items ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(names, ["a", "b"]);
    let who: String = app
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "orders");
    // The URI works as such too.
    let via_uri = connect_config(&uri).await.unwrap();
    let n: i64 = via_uri
        .query_one("SELECT count(*) FROM items", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);

    // The transition to Ready was reported by the controller.
    let events = s.events_for("orders").await;
    assert!(
        events.iter().any(
            |e| e.reporting_component.as_deref() == Some(CONTROLLER_USER)
                || e.source.as_ref().and_then(|s| s.component.as_deref()) == Some(CONTROLLER_USER)
        ),
        "no Event from {CONTROLLER_USER} about Database orders: {:#?}",
        events
            .iter()
            .map(|e| (&e.type_, &e.reason, &e.message))
            .collect::<Vec<_>>()
    );
}

/// 2. spec.connectionLimit is applied, and drift made by hand is repaired.
#[tokio::test]
async fn connection_limit_follows_the_spec() {
    let s = Setup::new("db-connlimit").await;
    s.create("limits", json!({})).await;
    s.wait_ready("limits").await;
    assert_eq!(s.pg.connlimit("limits").await.unwrap(), Some(-1));

    merge_patch(
        &s.databases(),
        "limits",
        json!({"spec": {"connectionLimit": 5}}),
    )
    .await
    .unwrap();
    eventually(
        "datconnlimit 5 after spec.connectionLimit: 5",
        READY,
        || async { s.pg.connlimit("limits").await },
        |l| *l == Some(5),
    )
    .await;
    let db = s.wait_ready("limits").await;
    assert_eq!(db.metadata.generation, Some(2));

    // Drift: someone changes it by hand; the next resync puts it back.
    let su = s.pg.connect_as_superuser().await.unwrap();
    su.batch_execute("ALTER DATABASE limits CONNECTION LIMIT 77")
        .await
        .unwrap();
    eventually(
        "the hand-made connection limit 77 repaired to 5 within a few resyncs",
        RESYNC * 5,
        || async { s.pg.connlimit("limits").await },
        |l| *l == Some(5),
    )
    .await;
}

/// 3a. Retain: the Database goes at once, the database and role stay.
#[tokio::test]
async fn retain_policy_leaves_the_database_and_role() {
    let s = Setup::new("db-retain").await;
    s.create("kept", json!({"deletionPolicy": "Retain"})).await;
    let db = s.wait_ready("kept").await;
    assert!(
        !has_finalizer(&db),
        "Retain needs no finalizer: {:?}",
        db.metadata.finalizers
    );

    s.delete("kept").await;
    s.wait_gone(&db, Duration::from_secs(30)).await;
    assert!(
        s.pg.database_exists("kept").await.unwrap(),
        "database kept was dropped"
    );
    assert!(
        s.pg.role_exists("kept").await.unwrap(),
        "role kept was dropped"
    );
    // The Secret goes with its owner (garbage collector).
    let secrets = s.secrets();
    eventually(
        "the connection Secret garbage-collected",
        READY,
        || async { Ok(secrets.get_opt("kept-connection").await?.map(SecretView)) },
        |s| s.is_none(),
    )
    .await;
}

/// 3b. Delete: sessions terminated, database and role dropped, then the object goes.
#[tokio::test]
async fn delete_policy_drops_the_database_and_role() {
    let s = Setup::new("db-delete").await;
    s.create("dropped", json!({"deletionPolicy": "Delete"}))
        .await;
    let db = s.wait_ready("dropped").await;
    assert!(has_finalizer(&db), "Delete needs the finalizer {FINALIZER}");

    // An application session is open: deletion terminates it.
    let secret = s.connection_secret("dropped").await;
    let app = connect(
        "127.0.0.1",
        s.pg.port(),
        &value(&secret, "username"),
        &value(&secret, "password"),
        "dropped",
    )
    .await
    .unwrap();
    app.batch_execute("CREATE TABLE t (n int)").await.unwrap();

    s.delete("dropped").await;
    s.wait_gone(&db, READY).await;
    s.pg.assert_dropped("dropped").await;
    assert!(
        app.simple_query("SELECT 1").await.is_err(),
        "the open session was terminated"
    );
}

/// 3c. Snapshot: a final Backup first; the drop waits until that Backup is Ready.
#[tokio::test]
async fn snapshot_policy_waits_for_the_final_backup_then_drops() {
    let s = Setup::new("db-snapshot").await;
    s.create("snap", json!({"deletionPolicy": "Snapshot"}))
        .await;
    let db = s.wait_ready("snap").await;
    assert!(
        has_finalizer(&db),
        "Snapshot needs the finalizer {FINALIZER}"
    );
    let uid = db.metadata.uid.clone().unwrap();

    s.delete("snap").await;
    let backups = s.backups();
    let final_name = dbops_e2e::fixtures::wait_final_snapshot(&s.b.client, s.ns(), &uid, READY)
        .await
        .unwrap();
    let backup = backups.get(&final_name).await.unwrap();
    let (meta, spec) = (backup.metadata.clone(), backup.spec.clone());
    assert_eq!(spec.database_ref.name, "snap");
    assert_eq!(
        meta.annotations
            .unwrap_or_default()
            .get("dbops.dev/database-uid"),
        Some(&uid),
        "the final Backup is pinned to this Database's UID"
    );
    assert!(
        !meta.owner_references.iter().flatten().any(|o| o.uid == uid),
        "the final Backup must outlive the Database: it is not owned by it"
    );

    // Deletion bumps metadata.generation; whether the status caught up is checked at
    // the end, so that a stale observedGeneration does not hide the rest.
    let waiting = s
        .wait(
            "snap",
            Want::new("Progressing", "True", Some("WaitingForFinalBackup")).any_generation(),
            READY,
        )
        .await;
    assert!(waiting.metadata.deletion_timestamp.is_some());
    let generations = (
        waiting.metadata.generation,
        waiting
            .status
            .as_ref()
            .and_then(|st| st.observed_generation),
    );
    // Without a Ready Backup nothing is dropped, over a few resyncs.
    holds_for(
        "database snap exists while the final Backup is not Ready",
        RESYNC * 2 + Duration::from_secs(1),
        || async { s.pg.database_exists("snap").await },
        |e| *e,
    )
    .await
    .unwrap();
    assert!(s.databases().get_opt("snap").await.unwrap().is_some());

    // The backup-controller's part, played by the test.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    backups
        .patch_status(
            &final_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Completed",
                "databaseUID": uid,
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "Completed",
                    "message": "simulated by the e2e test",
                    "lastTransitionTime": now,
                }],
            }})),
        )
        .await
        .unwrap();
    s.wait_gone(&db, READY).await;
    s.pg.assert_dropped("snap").await;
    assert!(
        backups.get_opt(&final_name).await.unwrap().is_some(),
        "the final Backup stays"
    );
    assert_eq!(
        generations.1, generations.0,
        "while WaitingForFinalBackup, status.observedGeneration (left) lags \
         metadata.generation (right, bumped by the deletion)"
    );
}

/// 4. SIGKILL at random moments while 10 Databases provision: in the end each has
/// exactly one role, one database and a Secret whose password works.
#[tokio::test]
async fn crashes_while_provisioning_leave_no_duplicates_or_leftovers() {
    let mut s = Setup::new("db-crash").await;
    let su = s.pg.connect_as_superuser().await.unwrap();
    let count = |sql: &'static str| {
        let su = &su;
        async move { su.query_one(sql, &[]).await.map(|r| r.get::<_, i64>(0)) }
    };
    const ROLES: &str = "SELECT count(*) FROM pg_roles WHERE rolname !~ '^pg_'";
    const DATABASES: &str = "SELECT count(*) FROM pg_database";
    let (roles_before, dbs_before) = (count(ROLES).await.unwrap(), count(DATABASES).await.unwrap());

    let names: Vec<String> = (0..10).map(|i| format!("crash-{i}")).collect();
    for name in &names {
        s.create(name, json!({})).await;
    }
    for round in 0..5 {
        // Early rounds land in the middle of provisioning, later ones anywhere.
        let delay = rand::rng().random_range(50..(400 + 400 * round));
        tokio::time::sleep(Duration::from_millis(delay)).await; // a random moment, on purpose
        s.kill_controller();
        let ready_now = s
            .databases()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .filter(|db| dbops_e2e::wait::database_has(db, ready()))
            .count();
        let ddl_so_far = s.pg.ddl_statements().unwrap().len();
        tracing::info!(
            round,
            delay,
            ready_now,
            ddl_so_far,
            "killed the database-controller"
        );
        s.start_controller();
    }

    let mut dbs = Vec::new();
    for name in &names {
        dbs.push(s.wait(name, ready(), Duration::from_secs(120)).await);
    }
    assert_eq!(
        s.pg.count_databases_like("crash\\_%").await.unwrap(),
        10,
        "databases crash_*"
    );
    assert_eq!(
        s.pg.count_roles_like("crash\\_%").await.unwrap(),
        10,
        "roles crash_*"
    );
    assert_eq!(
        count(ROLES).await.unwrap() - roles_before,
        10,
        "no other role was left behind"
    );
    assert_eq!(
        count(DATABASES).await.unwrap() - dbs_before,
        10,
        "no other database was left behind"
    );
    let secrets = s
        .secrets()
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=dbops"))
        .await
        .unwrap();
    assert_eq!(
        secrets.items.len(),
        10,
        "one connection Secret per Database"
    );
    for db in &dbs {
        let dbname = db.database_name();
        assert_eq!(
            s.pg.database_comment(&dbname).await.unwrap(),
            Some(mark(db)),
            "{dbname}"
        );
        assert_eq!(
            s.pg.role_comment(&dbname).await.unwrap(),
            Some(mark(db)),
            "{dbname}"
        );
        let secret = s
            .connection_secret(db.metadata.name.as_deref().unwrap())
            .await;
        let (user, password) = (value(&secret, "username"), value(&secret, "password"));
        s.wait_login(
            &user,
            &password,
            &dbname,
            &format!("login to {dbname} with its Secret"),
        )
        .await;
    }
}

/// 5. PostgreSQL down before provisioning, during provisioning and during deletion.
#[tokio::test]
async fn an_unreachable_server_is_reported_and_work_resumes_when_it_returns() {
    let mut s = Setup::with_args("db-outage", &["--breaker-open-for=5s"]).await;

    // Down before the Database exists.
    s.pg.stop().unwrap();
    s.create("patient", json!({"deletionPolicy": "Delete"}))
        .await;
    s.wait("patient", not_ready("ServerUnreachable"), READY)
        .await;
    s.pg.start_again().await.unwrap();
    let patient = s.wait("patient", ready(), Duration::from_secs(90)).await;
    assert!(s.pg.database_exists("patient").await.unwrap());

    // Down in the middle of provisioning (wherever a random moment falls).
    s.create("midway", json!({})).await;
    let delay = rand::rng().random_range(0..400);
    tokio::time::sleep(Duration::from_millis(delay)).await; // a random moment, on purpose
    s.pg.stop().unwrap();
    let db = eventually(
        "midway Ready, or not ready with ServerUnreachable, while the server is down",
        READY,
        || async { Ok(s.databases().get("midway").await?.status) },
        |st| {
            st.as_ref().is_some_and(|st| {
                ready().matches(&st.conditions)
                    || not_ready("ServerUnreachable").matches(&st.conditions)
            })
        },
    )
    .await;
    tracing::info!(?db, delay, "midway while the server is down");
    s.pg.start_again().await.unwrap();
    s.wait("midway", ready(), Duration::from_secs(90)).await;
    assert_eq!(s.pg.count_databases_like("midway").await.unwrap(), 1);

    // Down under a Ready Database: noticed at the next resync.
    s.pg.stop().unwrap();
    s.wait("patient", not_ready("ServerUnreachable"), READY)
        .await;

    // Down during deletion with policy Delete: the object waits for the server.
    s.delete("patient").await;
    holds_for(
        "Database patient exists while its server is down",
        Duration::from_secs(8),
        || async { Ok(s.databases().get_opt("patient").await?.is_some()) },
        |exists| *exists,
    )
    .await
    .unwrap();
    s.pg.start_again().await.unwrap();
    s.wait_gone(&patient, Duration::from_secs(90)).await;
    s.pg.assert_dropped("patient").await;
}

/// 6. The connection Secret: deleted → re-created with a rotated password; a key edited
/// → restored, the password rotated and the edited value useless.
#[tokio::test]
async fn the_connection_secret_is_restored_and_the_password_rotated() {
    let s = Setup::new("db-secret").await;
    s.create("app", json!({})).await;
    s.wait_ready("app").await;
    let port = s.pg.port();
    let secrets = s.secrets();
    let first = s.connection_secret("app").await;
    let first_uid = first.metadata.uid.clone().unwrap();
    let p1 = value(&first, "password");
    assert!(
        login(port, "app", &p1, "app").await.unwrap(),
        "the first password works"
    );

    // Deleted: a new Secret, a new password that works, the old one no more.
    secrets
        .delete("app-connection", &DeleteParams::default())
        .await
        .unwrap();
    let second = eventually(
        "Secret app-connection re-created",
        READY,
        || async { Ok(secrets.get_opt("app-connection").await?.map(SecretView)) },
        |s| {
            s.as_ref()
                .is_some_and(|s| s.0.metadata.uid.as_deref() != Some(&first_uid))
        },
    )
    .await
    .unwrap()
    .0;
    let p2 = value(&second, "password");
    assert!(
        p2 != p1,
        "the password was not rotated after the Secret was lost"
    );
    s.wait_login(
        "app",
        &p2,
        "app",
        "login with the re-created Secret's password",
    )
    .await;
    assert!(
        !login(port, "app", &p1, "app").await.unwrap(),
        "the lost password still works"
    );
    assert_eq!(
        value(&second, "PGPASSWORD"),
        p2,
        "PGPASSWORD differs from password"
    );

    // The password key edited by hand.
    let edited = format!(
        "edited-{}",
        Alphanumeric.sample_string(&mut rand::rng(), 12)
    );
    merge_patch(
        &secrets,
        "app-connection",
        json!({"stringData": {"password": edited, "host": "tampered.example"}}),
    )
    .await
    .unwrap();
    let third = eventually(
        "Secret app-connection repaired after an edit",
        READY,
        || async { Ok(secrets.get("app-connection").await.map(SecretView)?) },
        |s| {
            let data = s.0.data.as_ref();
            let get = |k: &str| data.and_then(|d| d.get(k)).map(|v| v.0.clone());
            get("password").is_some_and(|p| p != edited.as_bytes())
                && get("host").as_deref() == Some(b"127.0.0.1".as_slice())
        },
    )
    .await
    .0;
    let p3 = value(&third, "password");
    assert!(
        value(&third, "PGPASSWORD") == p3,
        "PGPASSWORD differs from password"
    );
    assert_eq!(value(&third, "PGHOST"), "127.0.0.1");
    s.wait_login(
        "app",
        &p3,
        "app",
        "login with the repaired Secret's password",
    )
    .await;
    assert!(
        !login(port, "app", &edited, "app").await.unwrap(),
        "the edited value became the role's password"
    );
    let uri = tokio_postgres::Config::from_str(&value(&third, "uri")).unwrap();
    assert!(
        uri.get_password() == Some(p3.as_bytes()),
        "uri has a stale password"
    );
}

/// 7. A database or role that exists without our mark is never adopted or touched.
#[tokio::test]
async fn an_existing_database_or_role_is_a_name_conflict_and_untouched() {
    let s = Setup::new("db-conflict").await;
    let su = s.pg.connect_as_superuser().await.unwrap();
    let hand_password = Alphanumeric.sample_string(&mut rand::rng(), 20);
    for sql in [
        "CREATE DATABASE taken".to_string(),
        "COMMENT ON DATABASE taken IS 'made by hand'".to_string(),
        format!(
            "CREATE ROLE hand_role LOGIN PASSWORD {}",
            dbops_e2e::postgres::quote_literal(&hand_password)
        ),
    ] {
        su.batch_execute(&sql).await.unwrap();
    }
    let taken_oid = s.pg.database_oid("taken").await.unwrap();

    s.create("taken", json!({"deletionPolicy": "Delete"})).await;
    s.create(
        "fresh",
        json!({"owner": "hand_role", "deletionPolicy": "Delete"}),
    )
    .await;
    let taken = s.wait("taken", not_ready("NameConflict"), READY).await;
    let fresh = s.wait("fresh", not_ready("NameConflict"), READY).await;

    // Watch for a few resyncs: nothing changes in PostgreSQL.
    holds_for(
        "database taken, role hand_role and no database fresh, all as made by hand",
        RESYNC * 2 + Duration::from_secs(1),
        || async {
            Ok((
                s.pg.database_oid("taken").await?,
                s.pg.database_comment("taken").await?,
                s.pg.database_owner("taken").await?,
                s.pg.role_comment("hand_role").await?,
                s.pg.database_exists("fresh").await?,
                s.pg.role_exists("taken").await?,
            ))
        },
        |state| {
            *state
                == (
                    taken_oid,
                    Some("made by hand".to_string()),
                    Some("postgres".to_string()),
                    None,
                    false,
                    false,
                )
        },
    )
    .await
    .unwrap();
    assert!(
        login(s.pg.port(), "hand_role", &hand_password, "postgres")
            .await
            .unwrap(),
        "the password of the hand-made role was changed"
    );
    assert!(
        s.secrets()
            .get_opt("taken-connection")
            .await
            .unwrap()
            .is_none(),
        "no connection Secret for a conflicting database"
    );

    for name in ["taken", "fresh"] {
        let events = s.events_for(name).await;
        assert!(
            events
                .iter()
                .any(|e| e.reason.as_deref() == Some("NameConflict")),
            "no NameConflict Event about Database {name}: {:?}",
            events
                .iter()
                .map(|e| (&e.type_, &e.reason))
                .collect::<Vec<_>>()
        );
    }

    // Deleting with policy Delete drops nothing that is not ours.
    s.delete("taken").await;
    s.delete("fresh").await;
    s.wait_gone(&taken, READY).await;
    s.wait_gone(&fresh, READY).await;
    assert_eq!(
        s.pg.database_oid("taken").await.unwrap(),
        taken_oid,
        "database taken was dropped"
    );
    assert_eq!(
        s.pg.database_comment("taken").await.unwrap().as_deref(),
        Some("made by hand")
    );
    assert!(
        s.pg.role_exists("hand_role").await.unwrap(),
        "role hand_role was dropped"
    );
    assert!(
        login(s.pg.port(), "hand_role", &hand_password, "postgres")
            .await
            .unwrap()
    );
}

/// 8. A database dropped behind the controller's back is reported, never re-created.
#[tokio::test]
async fn a_vanished_database_is_reported_and_not_recreated() {
    let s = Setup::new("db-missing").await;
    s.create("ghost", json!({})).await;
    let db = s.wait_ready("ghost").await;
    assert!(db.status.as_ref().unwrap().provider_id.is_some());

    s.pg.drop_database_force("ghost").await.unwrap();
    let missing = s.wait("ghost", not_ready("DatabaseMissing"), READY).await;
    let degraded = missing
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded");
    if degraded.is_none_or(|c| c.status != "True") {
        // Written in a second status update, perhaps.
        s.wait(
            "ghost",
            Want::new("Degraded", "True", None),
            Duration::from_secs(15),
        )
        .await;
    }
    let event = eventually(
        "a Warning Event DatabaseMissing about Database ghost",
        Duration::from_secs(30),
        || async {
            Ok(s.events_for("ghost")
                .await
                .into_iter()
                .map(|e| {
                    (
                        e.type_,
                        e.reason,
                        e.reporting_component,
                        e.source.and_then(|src| src.component),
                    )
                })
                .collect::<Vec<_>>())
        },
        |events| {
            events.iter().any(|(t, r, _, _)| {
                t.as_deref() == Some("Warning") && r.as_deref() == Some("DatabaseMissing")
            })
        },
    )
    .await;
    assert!(
        event
            .iter()
            .any(|(_, r, rc, src)| r.as_deref() == Some("DatabaseMissing")
                && (rc.as_deref() == Some(CONTROLLER_USER)
                    || src.as_deref() == Some(CONTROLLER_USER))),
        "the DatabaseMissing Event is not reported by {CONTROLLER_USER}: {event:?}"
    );

    holds_for(
        "database ghost stays absent over two resyncs",
        RESYNC * 2 + Duration::from_secs(2),
        || async { s.pg.database_exists("ghost").await },
        |exists| !*exists,
    )
    .await
    .unwrap();
    let db = s.databases().get("ghost").await.unwrap();
    assert_eq!(
        db.status.as_ref().and_then(|st| st.phase),
        Some(dbops_api::DatabasePhase::Degraded)
    );
    assert!(
        dbops_e2e::wait::database_has(&db, not_ready("DatabaseMissing")),
        "still reported missing: {}",
        describe_database(&s.databases(), "ghost").await
    );
}

/// 9. A converged Database costs nothing: no API write and no DDL over resyncs.
#[tokio::test]
async fn a_converged_database_makes_no_writes_and_no_ddl() {
    let s = Setup::new("db-quiet").await;
    s.create(
        "quiet",
        json!({"extensions": ["pgcrypto", "citext"], "connectionLimit": 10, "deletionPolicy": "Delete"}),
    )
    .await;
    s.wait_ready("quiet").await;
    s.assert_quiet().await;
}

/// 10. Bad admin input is reported precisely and never leaks the admin password.
#[tokio::test]
async fn bad_admin_input_is_reported_without_leaking_the_password() {
    let s = Setup::new("db-admin").await;
    let wrong = format!("wrong-{}", Alphanumeric.sample_string(&mut rand::rng(), 16));
    s.create_admin_secret("nopw-admin", Some("postgres"), None)
        .await;
    s.create_admin_secret("wrong-admin", Some("postgres"), Some(&wrong))
        .await;
    let closed_port = dbops_e2e::process::free_port().unwrap();
    // A DatabaseServer per admin Secret (late-admin's does not exist yet), and one on a
    // closed port with the good admin Secret.
    for admin in ["late-admin", "nopw-admin", "wrong-admin"] {
        s.create_server(admin, json!({})).await;
    }
    s.create_server(
        "closed-port",
        json!({"port": closed_port, "adminSecretRef": {"name": ADMIN_SECRET}}),
    )
    .await;
    // CA Secrets: missing, without ca.crt, not a certificate.
    dbops_e2e::fixtures::create_secret(&s.b.client, s.ns(), "empty-ca", &[("other", "x")])
        .await
        .unwrap();
    dbops_e2e::fixtures::create_ca_secret(
        &s.b.client,
        s.ns(),
        "junk-ca",
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
    )
    .await
    .unwrap();
    for (server, ca) in [
        ("no-ca", "missing-ca"),
        ("empty-ca", "empty-ca"),
        ("junk-ca", "junk-ca"),
    ] {
        s.create_server(
            server,
            json!({"adminSecretRef": {"name": ADMIN_SECRET},
                   "tls": {"mode": "verify-full", "caSecretRef": {"name": ca}}}),
        )
        .await;
    }
    let on = |admin: &str| json!({"serverRef": {"name": s.server(admin)}});

    for server in ["no-ca", "empty-ca", "junk-ca"] {
        s.create(server, on(server)).await;
    }
    s.create("nosecret", on("late-admin")).await;
    s.create("nopassword", on("nopw-admin")).await;
    s.create("wrongpassword", on("wrong-admin")).await;
    s.create("closedport", on("closed-port")).await;

    s.wait("nosecret", not_ready("AdminSecretNotFound"), READY)
        .await;
    s.wait("nopassword", not_ready("AdminSecretInvalid"), READY)
        .await;
    s.wait("wrongpassword", not_ready("AuthenticationFailed"), READY)
        .await;
    s.wait("closedport", not_ready("ServerUnreachable"), READY)
        .await;
    s.wait("no-ca", not_ready("CASecretNotFound"), READY).await;
    s.wait("empty-ca", not_ready("CASecretInvalid"), READY)
        .await;
    s.wait("junk-ca", not_ready("CASecretInvalid"), READY).await;
    for name in ["nosecret", "no-ca", "empty-ca", "junk-ca"] {
        let dbname = name.replace('-', "_");
        assert!(!s.pg.database_exists(&dbname).await.unwrap(), "{dbname}");
    }
    // The DatabaseServers say the same about themselves.
    for (admin, reason) in [
        ("no-ca", "CASecretNotFound"),
        ("empty-ca", "CASecretInvalid"),
        ("junk-ca", "CASecretInvalid"),
        ("late-admin", "AdminSecretNotFound"),
        ("nopw-admin", "AdminSecretInvalid"),
        ("wrong-admin", "AuthenticationFailed"),
        ("closed-port", "ServerUnreachable"),
    ] {
        s.wait_server(&s.server(admin), not_ready(reason)).await;
    }

    // The missing Secret appears: the Database proceeds without any change to it.
    let started = std::time::Instant::now();
    let password = s.pg.superuser_password().to_string();
    s.create_admin_secret("late-admin", Some("postgres"), Some(&password))
        .await;
    s.wait_ready("nosecret").await;
    tracing::info!(elapsed = ?started.elapsed(), "nosecret Ready after its admin Secret appeared");

    // Nothing shows either password: status (the Databases' and the DatabaseServers'),
    // Events, the controller's log.
    let dbs =
        s.b.kubectl
            .run(&["get", "databases", "-n", s.ns(), "-o", "yaml"], None)
            .unwrap();
    let selector = s.b.ns.server_selector();
    let servers =
        s.b.kubectl
            .run(
                &["get", "databaseservers", "-l", &selector, "-o", "yaml"],
                None,
            )
            .unwrap();
    assert!(
        servers.success && servers.stdout.contains("AuthenticationFailed"),
        "kubectl get databaseservers failed"
    );
    assert!(
        dbs.success && dbs.stdout.contains("AuthenticationFailed"),
        "kubectl get databases failed"
    );
    let events =
        s.b.kubectl
            .run(&["get", "events", "-n", s.ns(), "-o", "yaml"], None)
            .unwrap();
    assert!(
        events.success && events.stdout.contains("Database"),
        "no Events about Databases"
    );
    let log = s.controller_log_raw();
    for (what, text) in [
        ("kubectl get databases -o yaml", &dbs.stdout),
        ("kubectl get databaseservers -o yaml", &servers.stdout),
        ("kubectl get events -o yaml", &events.stdout),
        ("the controller's log", &log),
    ] {
        for (which, secret) in [
            ("admin password", &password),
            ("wrong admin password", &wrong),
        ] {
            let line = text.lines().position(|l| l.contains(secret.as_str()));
            assert!(
                line.is_none(),
                "the {which} appears in {what}, line {}",
                line.unwrap_or(0) + 1
            );
        }
    }
}

/// 11. A Migration of the Database in flight: MigrationInProgress, its freeze (connection
/// limit) is not repaired as drift, and deletion waits until the Migration has ended.
#[tokio::test]
async fn a_running_migration_holds_off_drift_repair_and_deletion() {
    let s = Setup::new("db-migrating").await;
    s.create("moving", json!({"deletionPolicy": "Retain"}))
        .await;
    let db = s.wait_ready("moving").await;
    assert!(!has_finalizer(&db), "Retain needs no finalizer yet");

    // No migration-controller runs: the Migration is only there (to an unreachable target).
    s.create_server(
        "nowhere",
        json!({"port": 1, "adminSecretRef": {"name": ADMIN_SECRET}}),
    )
    .await;
    let migrations: Api<dbops_api::Migration> = Api::namespaced(s.b.client.clone(), s.ns());
    let migration: dbops_api::Migration = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Migration",
        "metadata": {"name": "move-it"},
        "spec": {"databaseRef": {"name": "moving"},
                 "target": {"serverRef": {"name": s.server("nowhere")}}}
    }))
    .unwrap();
    migrations
        .create(&PostParams::default(), &migration)
        .await
        .unwrap();
    let db = s
        .wait(
            "moving",
            Want::new("MigrationInProgress", "True", Some("MigrationRunning")),
            READY,
        )
        .await;
    assert!(
        has_finalizer(&db),
        "a running Migration holds deletion with the finalizer"
    );

    // What a FreezeSource step does: not drift while the Migration runs.
    s.pg.connect_as_superuser()
        .await
        .unwrap()
        .batch_execute("ALTER DATABASE moving CONNECTION LIMIT 0")
        .await
        .unwrap();
    let pg = &s.pg;
    holds_for(
        "the frozen connection limit stays over two resyncs",
        RESYNC * 2 + Duration::from_secs(1),
        || async { pg.connlimit("moving").await },
        |limit| *limit == Some(0),
    )
    .await
    .unwrap();

    s.delete("moving").await;
    let dbs = s.databases();
    holds_for(
        "deletion waits for the Migration",
        RESYNC * 2,
        || async { dbs.get_opt("moving").await.map_err(anyhow::Error::from) },
        |d| d.is_some(),
    )
    .await
    .unwrap();

    // The Migration ends: deletion (Retain) completes and the database stays.
    migrations
        .patch_status(
            "move-it",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    s.wait_gone(&db, READY).await;
    assert!(s.pg.database_exists("moving").await.unwrap());
}

/// Issue 10, item 2: a Secret `<name>-connection` that dbops did not create is never taken
/// over. The Database reports `Ready=False/SecretConflict`, the Secret keeps its data and
/// gains no owner (so deleting the Database cannot garbage-collect it), and nothing is
/// created on the server; once the Secret is gone, a new Database of that name provisions.
#[tokio::test]
async fn an_existing_secret_is_never_taken_over() {
    let s = Setup::new("db-secret-conflict").await;
    let mut theirs = Secret::default();
    theirs.metadata.name = Some("billing-connection".into());
    theirs.string_data = Some(BTreeMap::from([(
        "password".to_string(),
        "not-dbops".to_string(),
    )]));
    let theirs = s
        .secrets()
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();

    let db = s
        .create("billing", json!({"deletionPolicy": "Delete"}))
        .await;
    let refused = s.wait("billing", not_ready("SecretConflict"), READY).await;
    let message = refused
        .status
        .as_ref()
        .and_then(|st| {
            st.conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.message.clone())
        })
        .unwrap_or_default();
    assert!(message.contains("billing-connection"), "{message}");
    let untouched = |found: &Secret| {
        found.metadata.resource_version == theirs.metadata.resource_version
            && found.metadata.owner_references.is_none()
    };
    holds_for(
        "Secret billing-connection keeps its data and gains no owner",
        RESYNC * 2 + Duration::from_secs(1),
        || async {
            Ok(s.secrets()
                .get("billing-connection")
                .await
                .map(SecretView)?)
        },
        |found| untouched(&found.0),
    )
    .await
    .unwrap();
    assert!(!s.pg.role_exists("billing").await.unwrap(), "role created");
    assert!(
        !s.pg.database_exists("billing").await.unwrap(),
        "database created"
    );
    assert!(
        s.events_for("billing")
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("SecretConflict")
                && e.type_.as_deref() == Some("Warning")),
        "no Warning Event SecretConflict"
    );

    // Deleting the Database leaves the Secret alone (no owner reference to collect it).
    s.delete("billing").await;
    s.wait_gone(&db, READY).await;
    holds_for(
        "Secret billing-connection survives the Database's deletion",
        Duration::from_secs(5),
        || async {
            Ok(s.secrets()
                .get_opt("billing-connection")
                .await?
                .map(SecretView))
        },
        |found| found.as_ref().is_some_and(|f| untouched(&f.0)),
    )
    .await
    .unwrap();

    // Without the foreign Secret, the same name provisions and the Secret is its own.
    s.secrets()
        .delete("billing-connection", &DeleteParams::default())
        .await
        .unwrap();
    let db = s
        .create("billing", json!({"deletionPolicy": "Delete"}))
        .await;
    s.wait_ready("billing").await;
    let own = s.connection_secret("billing").await;
    assert!(
        own.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| Some(&o.uid) == db.metadata.uid.as_ref() && o.controller == Some(true))
    );
}

/// Issue 10, "also found": after a crash between `CREATE DATABASE` and its mark, the
/// recovery path marks the database and closes it to PUBLIC exactly like the normal path
/// (before the fix it only commented it, and every role on the server kept CONNECT). The
/// crash is reproduced by leaving what it leaves: the role marked with the Database's UID
/// and the database owned by it without a mark, created while the admin Secret is missing.
#[tokio::test]
async fn a_database_recovered_after_a_crash_is_closed_to_public() {
    let s = Setup::new("db-revoke").await;
    s.create_server("late-admin", json!({})).await;
    s.create(
        "recovered",
        json!({"serverRef": {"name": s.server("late-admin")}}),
    )
    .await;
    let db = s
        .wait("recovered", not_ready("AdminSecretNotFound"), READY)
        .await;
    let uid = db.metadata.uid.clone().unwrap();
    let su = s.pg.connect_as_superuser().await.unwrap();
    su.batch_execute(&format!(
        "CREATE ROLE recovered LOGIN; COMMENT ON ROLE recovered IS 'dbops.dev/uid={uid}'; \
         CREATE ROLE bystander LOGIN"
    ))
    .await
    .unwrap();
    su.batch_execute("CREATE DATABASE recovered OWNER recovered")
        .await
        .unwrap();
    let connect_as_bystander = "SELECT has_database_privilege('bystander', 'recovered', 'CONNECT')";
    let before: bool = su
        .query_one(connect_as_bystander, &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        before,
        "a new database is open to PUBLIC until dbops closes it"
    );

    let password = s.pg.superuser_password().to_string();
    s.create_admin_secret("late-admin", Some("postgres"), Some(&password))
        .await;
    s.wait_ready("recovered").await;
    assert_eq!(
        s.pg.database_comment("recovered").await.unwrap().as_deref(),
        Some(format!("dbops.dev/uid={uid}").as_str())
    );
    let after: bool = su
        .query_one(connect_as_bystander, &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        !after,
        "the recovered database is still open to PUBLIC: role bystander may CONNECT"
    );
}

/// DatabaseServers: a Database naming a server that does not exist yet waits
/// (`ServerNotFound`) and provisions once it appears; a server serves only the namespaces
/// its `allowedNamespaces` selects (absent: none, `NamespaceNotAllowed`; changing it lets
/// the waiting Database in) and at most `limits.databasesPerNamespace` Databases per
/// namespace (`QuotaExceeded`); a refused Database touches nothing on the server. A server
/// in use keeps the finalizer `dbops.dev/server-in-use` until its last Database is gone.
#[tokio::test]
async fn a_server_serves_allowed_namespaces_within_its_quota_and_outlives_its_databases() {
    let s = Setup::new("db-server").await;
    let servers: Api<DatabaseServer> = Api::all(s.b.client.clone());
    let admin = json!({"adminSecretRef": {"name": ADMIN_SECRET}});
    let on = |server: &str| json!({"serverRef": {"name": s.server(server)}});
    let untouched = |name: &'static str| {
        let pg = &s.pg;
        async move {
            assert!(!pg.database_exists(name).await.unwrap(), "database {name}");
            assert!(!pg.role_exists(name).await.unwrap(), "role {name}");
        }
    };

    // The test's server: Ready, with what it runs and how it is reached.
    let main = s
        .wait_server(&s.server(ADMIN_SECRET), Want::new("Ready", "True", None))
        .await;
    let status = main.status.unwrap();
    assert!(
        status.server_version.is_some_and(|v| !v.is_empty()),
        "no serverVersion"
    );
    assert_eq!(
        status.tls.map(|t| t.mode),
        Some(dbops_api::TlsMode::Disable)
    );

    // A server that does not exist yet.
    s.create("early", on("later")).await;
    s.wait("early", not_ready("ServerNotFound"), READY).await;
    untouched("early").await;
    s.create_server("later", admin.clone()).await;
    let early = s.wait_ready("early").await;
    assert_eq!(
        early.status.and_then(|st| st.server).as_deref(),
        Some(s.server("later").as_str())
    );
    let later = s.server("later");
    eventually(
        "DatabaseServer later to count its Database",
        READY,
        || async {
            Ok(servers
                .get(&later)
                .await?
                .status
                .and_then(|st| st.databases))
        },
        |count| *count == Some(1),
    )
    .await;

    // Namespaces: none allowed, then another tenant's only, then every namespace.
    let mut closed = admin.clone();
    merge(&mut closed, json!({"allowedNamespaces": null}));
    s.create_server("closed", closed).await;
    let mut elsewhere = admin.clone();
    merge(
        &mut elsewhere,
        json!({"allowedNamespaces": {"matchLabels": {"dbops.dev/tenant": "elsewhere"}}}),
    );
    s.create_server("elsewhere", elsewhere).await;
    s.create("shut", on("closed")).await;
    s.create("foreign", on("elsewhere")).await;
    s.wait("shut", not_ready("NamespaceNotAllowed"), READY)
        .await;
    s.wait("foreign", not_ready("NamespaceNotAllowed"), READY)
        .await;
    untouched("shut").await;
    untouched("foreign").await;
    merge_patch(
        &servers,
        &s.server("closed"),
        json!({"spec": {"allowedNamespaces": {}}}),
    )
    .await
    .unwrap();
    s.wait_ready("shut").await;

    // A quota of one Database per namespace: the first is served, the second refused.
    let mut small = admin.clone();
    merge(&mut small, json!({"limits": {"databasesPerNamespace": 1}}));
    s.create_server("small", small).await;
    let first = s.create("first", on("small")).await;
    s.wait_ready("first").await;
    let second = s.create("second", on("small")).await;
    s.wait("second", not_ready("QuotaExceeded"), READY).await;
    untouched("second").await;

    // In use: the finalizer holds the server's deletion until its Databases are gone.
    let small = s.server("small");
    let in_use = |server: &DatabaseServer| {
        server
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == dbops_api::server::IN_USE_FINALIZER)
    };
    let held = eventually(
        "DatabaseServer small to carry dbops.dev/server-in-use",
        READY,
        || async { Ok(servers.get(&small).await.map(ServerView)?) },
        |server| in_use(&server.0),
    )
    .await;
    servers
        .delete(&small, &DeleteParams::default())
        .await
        .unwrap();
    // It says why: Ready=False/InUse, naming the Databases that hold it.
    let waiting = s
        .wait_server(&small, Want::new("Ready", "False", Some("InUse")))
        .await;
    let message = waiting
        .status
        .iter()
        .flat_map(|st| st.conditions.iter())
        .find(|c| c.type_ == "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("first") && message.contains("second"),
        "the InUse message names the Databases on the server: {message}"
    );
    holds_for(
        "DatabaseServer small stays while Database first is on it",
        RESYNC * 2,
        || async { Ok(servers.get_opt(&small).await?.map(ServerView)) },
        |server| server.as_ref().is_some_and(|s| in_use(&s.0)),
    )
    .await
    .unwrap();
    s.delete("first").await;
    s.delete("second").await;
    s.wait_gone(&first, READY).await;
    s.wait_gone(&second, READY).await;
    let uid = held.0.metadata.uid.clone().unwrap();
    if let Err(e) = dbops_e2e::wait::deleted(servers.clone(), &small, &uid, READY).await {
        panic!(
            "{e:#}\n---- controller log tail ----\n{}",
            s.controller_log(6000)
        );
    }
}

/// A DatabaseServer shown by its deletion state, finalizers and status, for failure
/// messages.
struct ServerView(DatabaseServer);

impl std::fmt::Debug for ServerView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DatabaseServer {:?} deletionTimestamp {:?} finalizers {:?} status {:?}",
            self.0.metadata.name,
            self.0.metadata.deletion_timestamp,
            self.0.metadata.finalizers,
            self.0.status
        )
    }
}

/// A Snapshot Database deleted before it was ever provisioned has nothing of its own to
/// snapshot: it goes without a final Backup instead of waiting forever for one the
/// backup-controller never makes (it dumps only provisioned databases). Found by the chaos
/// suite: a Database created with `restoreFrom` and deleted mid-restore stayed `Deleting`
/// with its final Backup `Pending/WaitingForDatabase`. A whole database of its own on the
/// server still gets its final Backup first (the Snapshot tests above).
#[tokio::test]
async fn a_snapshot_database_deleted_before_it_was_provisioned_goes_without_a_final_backup() {
    let s = Setup::new("db-snap-early").await;
    let db = s
        .create(
            "early",
            json!({"serverRef": {"name": s.server("nowhere")}, "deletionPolicy": "Snapshot"}),
        )
        .await;
    s.wait("early", not_ready("ServerNotFound"), READY).await;
    s.delete("early").await;
    s.wait_gone(&db, READY).await;
    let backups = s.backups().list(&ListParams::default()).await.unwrap();
    assert!(
        backups.items.is_empty(),
        "no final Backup: {:?}",
        backups
            .items
            .iter()
            .map(|b| b.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    assert!(!s.pg.database_exists("early").await.unwrap());
    let deleted = s
        .events_for("early")
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("Deleted"))
        .and_then(|e| e.message)
        .unwrap_or_default();
    assert!(
        deleted.contains("never provisioned"),
        "the Deleted Event says why there is no final Backup: {deleted:?}"
    );
}
