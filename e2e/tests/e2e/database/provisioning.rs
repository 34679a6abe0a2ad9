//! A Database becomes a role, a database and a connection Secret applications can use;
//! its spec is followed, and once converged it costs nothing.

use std::str::FromStr;

use dbops_e2e::fixtures::merge_patch_spec;
use dbops_e2e::harness::database::{
    ADMIN_SECRET, CONTROLLER_USER, READY, RESYNC, SecretView, Setup, connect, connect_config, mark,
    value,
};
use dbops_e2e::postgres::scalar;
use dbops_e2e::wait::{describe_database, eventually};
use serde_json::json;

/// The keys every connection Secret carries (what applications read), written here as
/// the contract lists them, not taken from the controller: the test holds the controller
/// to them.
const SECRET_KEYS: &str =
    "host port dbname username password uri jdbc-url PGHOST PGPORT PGDATABASE PGUSER PGPASSWORD";

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
    let server_version: String = scalar(&su, "SHOW server_version").await;
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
    for key in SECRET_KEYS.split_whitespace() {
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
    let who: String = scalar(&app, "SELECT current_user::text").await;
    assert_eq!(who, "orders");
    // The URI works as such too.
    let via_uri = connect_config(&uri).await.unwrap();
    let n: i64 = scalar(&via_uri, "SELECT count(*) FROM items").await;
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
    s.create_ready("limits", json!({})).await;
    assert_eq!(s.pg.connlimit("limits").await.unwrap(), Some(-1));

    merge_patch_spec(&s.databases(), "limits", json!({"connectionLimit": 5}))
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
