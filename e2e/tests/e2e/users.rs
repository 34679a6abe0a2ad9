//! DatabaseUsers against real PostgreSQL servers (two majors: the oldest supported, 13,
//! and Debian's 15; the rotation test on 17): privileges that hold for what the owner
//! creates later (the default-privileges bug class), guardrails, credential templates,
//! deletion that ends sessions and keeps the data, and rotation under a live application.

use std::time::Duration;

use dbops_e2e::fixtures::{merge_patch, merge_patch_spec};
use dbops_e2e::harness::database::{ADMIN_SECRET, READY, Setup, connect, login, value};
use dbops_e2e::harness::users::{
    connect_with, create_user, refused, roles_like, user_secret, users, wait_retired, wait_user,
    wait_user_where,
};
use dbops_e2e::postgres::admin::AdminKind;
use dbops_e2e::postgres::scalar;
use dbops_e2e::wait::{Want, eventually};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use tokio_postgres::error::SqlState;

/// Whether `public` of `shop` is closed to everyone but the owner, checked on the server
/// against what it must be: closed from 15 on (PostgreSQL's own default), and before 15
/// by a superuser admin; an admin that is not one may not change `public`, which belongs
/// to the bootstrap superuser there, and leaves it as PostgreSQL made it
/// (docs/operations.md, Managed PostgreSQL).
async fn public_closed(s: &Setup, major: u32) -> bool {
    let su = s.pg.connect_as_superuser_to("shop").await.unwrap();
    let open: bool = scalar(
        &su,
        "SELECT EXISTS (SELECT 1 FROM pg_namespace n, aclexplode(n.nspacl) a \
          WHERE n.nspname = 'public' AND a.grantee = 0 AND a.privilege_type = 'CREATE')",
    )
    .await;
    let expected = major >= 15 || AdminKind::for_tests() == AdminKind::Superuser;
    assert_eq!(!open, expected, "public of shop on {major}: open {open}");
    !open
}

/// What the owner makes before and after the users exist, and what each user may do.
async fn privileges_hold_for_what_the_owner_creates_later(major: u32) {
    let s = Setup::with_major(&format!("users{major}"), major).await;
    s.create_ready("shop", json!({})).await;
    let owner = connect_with(&s, &s.connection_secret("shop").await).await;
    owner
        .batch_execute("CREATE TABLE before_users (id serial PRIMARY KEY, v text); INSERT INTO before_users (v) VALUES ('a')")
        .await
        .unwrap();

    create_user(
        &s,
        "shop-ro",
        json!({"databaseRef": {"name": "shop"}, "access": "ReadOnly"}),
    )
    .await;
    create_user(
        &s,
        "shop-rw",
        json!({"databaseRef": {"name": "shop"}, "access": "ReadWrite"}),
    )
    .await;
    let ro = wait_user(&s, "shop-ro", "True", "UserReady").await;
    wait_user(&s, "shop-rw", "True", "UserReady").await;
    let status = ro.status.unwrap();
    assert_eq!(status.role.as_deref(), Some("shop.shop_ro-1"));
    assert_eq!(status.group_role.as_deref(), Some("shop.shop_ro"));

    // Made by the owner after the users exist, in an existing schema and in a new one.
    owner
        .batch_execute(
            "CREATE TABLE after_users (id serial PRIMARY KEY, v text); \
             CREATE SCHEMA later; CREATE TABLE later.t (id bigserial PRIMARY KEY, v text); \
             CREATE VIEW later.v AS SELECT * FROM later.t; \
             INSERT INTO after_users (v) VALUES ('b'); INSERT INTO later.t (v) VALUES ('c')",
        )
        .await
        .unwrap();

    let ro = connect_with(&s, &user_secret(&s, "shop-ro", None).await).await;
    for table in ["before_users", "after_users", "later.t", "later.v"] {
        let n: i64 = ro
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap_or_else(|e| panic!("ReadOnly cannot read {table} (major {major}): {e}"))
            .get(0);
        assert_eq!(n, 1, "{table}");
    }
    for sql in [
        "INSERT INTO after_users (v) VALUES ('x')",
        "UPDATE later.t SET v = 'x'",
        "DELETE FROM before_users",
        "SELECT nextval('later.t_id_seq')",
        "DROP TABLE after_users",
        "ALTER TABLE later.t ADD COLUMN w int",
        "CREATE TABLE public.mine (id int)",
        "CREATE TABLE later.mine (id int)",
    ] {
        if sql.contains("public.mine") && !public_closed(&s, major).await {
            continue;
        }
        let code = refused(&ro, sql).await;
        assert!(
            code == SqlState::INSUFFICIENT_PRIVILEGE,
            "ReadOnly {sql:?} on {major}: {code:?}"
        );
    }

    let rw = connect_with(&s, &user_secret(&s, "shop-rw", None).await).await;
    rw.batch_execute(
        "INSERT INTO after_users (v) VALUES ('rw'); INSERT INTO later.t (v) VALUES ('rw'); \
         UPDATE before_users SET v = 'rw'; DELETE FROM later.t WHERE v = 'c'",
    )
    .await
    .unwrap_or_else(|e| panic!("ReadWrite DML (major {major}): {e}"));
    for sql in [
        "DROP TABLE after_users",
        "ALTER TABLE later.t ADD COLUMN w int",
        "CREATE TABLE public.mine (id int)",
        "CREATE TABLE later.mine (id int)",
        "CREATE SCHEMA mine",
        "TRUNCATE after_users",
    ] {
        if sql.contains("public.mine") && !public_closed(&s, major).await {
            continue;
        }
        let code = refused(&rw, sql).await;
        assert!(
            code == SqlState::INSUFFICIENT_PRIVILEGE,
            "ReadWrite {sql:?} on {major}: {code:?}"
        );
    }

    // A user that covers one schema sees nothing elsewhere.
    create_user(
        &s,
        "shop-later",
        json!({"databaseRef": {"name": "shop"}, "schemas": ["later"]}),
    )
    .await;
    wait_user(&s, "shop-later", "True", "UserReady").await;
    let later = connect_with(&s, &user_secret(&s, "shop-later", None).await).await;
    later
        .query_one("SELECT count(*) FROM later.t", &[])
        .await
        .unwrap();
    let code = refused(&later, "SELECT * FROM after_users").await;
    assert_eq!(code, SqlState::INSUFFICIENT_PRIVILEGE);

    // Converged: two resyncs later, no API write and no DDL by the controller.
    s.assert_quiet().await;

    // Deleting a user ends its sessions and drops its roles; the data stays.
    users(&s)
        .delete("shop-rw", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the ReadWrite user's roles dropped",
        READY,
        || async { Ok(roles_like(&s, "shop_shop_rw").await) },
        |r| r.is_empty(),
    )
    .await;
    assert!(
        rw.query_one("SELECT 1", &[]).await.is_err(),
        "its session was ended"
    );
    let n: i64 = scalar(&owner, "SELECT count(*) FROM after_users WHERE v = 'rw'").await;
    assert_eq!(n, 1, "the user's rows stay");
}

#[tokio::test]
async fn privileges_hold_for_later_objects_on_13() {
    privileges_hold_for_what_the_owner_creates_later(13).await;
}

#[tokio::test]
async fn privileges_hold_for_later_objects_on_15() {
    privileges_hold_for_what_the_owner_creates_later(15).await;
}

#[tokio::test]
async fn guardrails_refuse_more_than_the_server_allows_and_apply_defaults() {
    let s = Setup::new("userlimits").await;
    let server = s.server(ADMIN_SECRET);
    let servers: Api<dbops_api::DatabaseServer> = Api::all(s.b.client.clone());
    let ceilings = json!({
        "limits": {"connectionLimit": 5, "databaseSize": "1Mi"},
        "sessionLimits": {"statementTimeout": {"default": "30s", "max": "1m"},
                          "workMem": {"max": "64MB"}},
    });
    merge_patch_spec(&servers, &server, ceilings).await.unwrap();
    // A Database over the ceiling is refused, naming the field; none is created.
    s.create("greedy", json!({"connectionLimit": 10})).await;
    let db = s
        .wait(
            "greedy",
            dbops_e2e::harness::database::not_ready("LimitExceeded"),
            READY,
        )
        .await;
    let message = db
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap()
        .message;
    assert!(message.contains("spec.connectionLimit"), "{message}");
    let admin = s.pg.connect_as_superuser().await.unwrap();
    let exists = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = 'greedy'", &[])
        .await
        .unwrap();
    assert!(
        exists.is_none(),
        "nothing is created for a refused Database"
    );

    s.create_ready("app", json!({})).await;
    // The owner gets the server's default, and -1 becomes the ceiling.
    let row = admin
        .query_one(
            "SELECT datconnlimit, (SELECT array_to_string(setconfig, ',') FROM pg_db_role_setting x \
               JOIN pg_roles r ON r.oid = x.setrole WHERE r.rolname = 'app' AND x.setdatabase = 0) \
               FROM pg_database WHERE datname = 'app'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 5);
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some("statement_timeout=30000")
    );

    create_user(
        &s,
        "app-reader",
        json!({"databaseRef": {"name": "app"}, "connectionLimit": 10}),
    )
    .await;
    let u = wait_user(&s, "app-reader", "False", "LimitExceeded").await;
    let message = u.status.unwrap().conditions[0].message.clone();
    assert!(message.contains("spec.connectionLimit"), "{message}");
    assert!(
        roles_like(&s, "app_app_reader").await.is_empty(),
        "nothing created"
    );

    let over = json!({"connectionLimit": 3, "settings": {"statementTimeout": "2m"}});
    merge_patch_spec(&users(&s), "app-reader", over)
        .await
        .unwrap();
    let u = wait_user(&s, "app-reader", "False", "LimitExceeded").await;
    let message = u.status.unwrap().conditions[0].message.clone();
    assert!(
        message.contains("spec.settings.statementTimeout"),
        "{message}"
    );

    let within = json!({"settings": {"statementTimeout": "15s", "workMem": "8MB"}});
    merge_patch_spec(&users(&s), "app-reader", within)
        .await
        .unwrap();
    wait_user(&s, "app-reader", "True", "UserReady").await;
    let reader = connect_with(&s, &user_secret(&s, "app-reader", None).await).await;
    let show = |name: &'static str| {
        let reader = &reader;
        async move {
            reader
                .query_one(&format!("SHOW {name}"), &[])
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    assert_eq!(show("statement_timeout").await, "15s");
    assert_eq!(show("work_mem").await, "8MB");
    let limit: i32 = admin
        .query_one(
            "SELECT rolconnlimit FROM pg_roles WHERE rolname = 'app.app_reader-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(limit, 3);

    // limits.databaseSize: an empty database (some MB) is over 1Mi: reported in status,
    // as a condition with a Warning Event, and as a metric; nothing is refused.
    let db = s
        .wait(
            "app",
            Want::new("SizeExceeded", "True", Some("SizeExceeded")),
            READY,
        )
        .await;
    let size = db.status.as_ref().and_then(|st| st.size_bytes).unwrap();
    assert!(size > 1 << 20, "status.sizeBytes {size}");
    let (_, body) = s.controller().get("/metrics").unwrap();
    let line = body
        .lines()
        .find(|l| l.starts_with("dbops_database_size_bytes{") && l.contains("database=\"app\""))
        .unwrap_or_else(|| panic!("no dbops_database_size_bytes for app in:\n{body}"));
    let metric: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(metric > (1 << 20) as f64, "{line}");
    assert!(
        s.events_for("app")
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("SizeExceeded")),
        "a Warning Event SizeExceeded"
    );
    // A higher limit clears it.
    let higher = json!({"limits": {"databaseSize": "10Gi"}});
    merge_patch_spec(&servers, &server, higher).await.unwrap();
    s.wait(
        "app",
        Want::new("SizeExceeded", "False", Some("WithinLimit")),
        READY,
    )
    .await;
}

#[tokio::test]
async fn a_secret_template_renders_escaped_and_a_bad_one_is_refused_before_any_write() {
    let s = Setup::new("usertmpl").await;
    s.create_ready("tmpl", json!({
        "secretTemplate": {"DATABASE_URL": "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}"}
    })).await;
    let secret = s.connection_secret("tmpl").await;
    let url = value(&secret, "DATABASE_URL");
    assert_eq!(
        url,
        value(&secret, "uri"),
        "the template renders as the controller's own uri"
    );

    create_user(
        &s,
        "tmpl-bad",
        json!({"databaseRef": {"name": "tmpl"}, "secretTemplate": {"URL": "{{ nope }}"}}),
    )
    .await;
    let u = wait_user(&s, "tmpl-bad", "False", "InvalidSecretTemplate").await;
    let message = u.status.unwrap().conditions[0].message.clone();
    assert!(message.contains("URL"), "{message}");
    assert!(
        roles_like(&s, "tmpl_tmpl_bad").await.is_empty(),
        "nothing created"
    );
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    assert!(
        secrets
            .get_opt("tmpl-bad-connection")
            .await
            .unwrap()
            .is_none()
    );

    create_user(
        &s,
        "tmpl-app",
        json!({"databaseRef": {"name": "tmpl"}, "secretTemplate": {
            "DATABASE_URL": "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}",
            "SPRING_DATASOURCE_USERNAME": "{{ user }}",
        }}),
    )
    .await;
    wait_user(&s, "tmpl-app", "True", "UserReady").await;
    let secret = user_secret(&s, "tmpl-app", None).await;
    assert_eq!(
        value(&secret, "SPRING_DATASOURCE_USERNAME"),
        value(&secret, "username")
    );
    let url = value(&secret, "DATABASE_URL");
    let config: tokio_postgres::Config = url.parse().unwrap();
    let client = dbops_e2e::harness::database::connect_config(&config)
        .await
        .unwrap();
    client.query_one("SELECT 1", &[]).await.unwrap();
}

#[tokio::test]
async fn rotation_keeps_a_live_application_working_through_two_rotations() {
    let s = Setup::with_major("userrot", 17).await;
    s.create_ready("live", json!({})).await;
    let owner = connect_with(&s, &s.connection_secret("live").await).await;
    owner
        .batch_execute("CREATE TABLE t (id int)")
        .await
        .unwrap();
    create_user(
        &s,
        "live-app",
        json!({"databaseRef": {"name": "live"}, "access": "ReadWrite",
               "passwordRotation": {"keepPrevious": "6s"}}),
    )
    .await;
    wait_user(&s, "live-app", "True", "UserReady").await;

    // The application: one session at a time, made from whatever the Secret says, a
    // query every 50 ms; a failed query ends the session and the next one reconnects.
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let port = s.pg.port();
    let app = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut ok, mut cut, mut other) = (0u64, 0u64, Vec::new());
            let mut session: Option<tokio_postgres::Client> = None;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if session.is_none() {
                    let secret = secrets.get("live-app-connection").await.unwrap();
                    match connect(
                        "127.0.0.1",
                        port,
                        &value(&secret, "username"),
                        &value(&secret, "password"),
                        &value(&secret, "dbname"),
                    )
                    .await
                    {
                        Ok(c) => session = Some(c),
                        Err(e) => other.push(format!("connect: {e:#}")),
                    }
                }
                if let Some(c) = &session {
                    match c.execute("INSERT INTO t VALUES (1)", &[]).await {
                        Ok(_) => ok += 1,
                        Err(e) if e.code() == Some(&SqlState::ADMIN_SHUTDOWN) || e.is_closed() => {
                            cut += 1;
                            session = None;
                        }
                        Err(e) => {
                            other.push(format!("query: {e}"));
                            session = None;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (ok, cut, other)
        })
    };

    let mut logins = vec![];
    for round in 1..=2 {
        let before = users(&s).get("live-app").await.unwrap().status.unwrap();
        let previous = before.role.clone().unwrap();
        let rotate =
            json!({"metadata": {"annotations": {"dbops.dev/rotate": format!("round-{round}")}}});
        merge_patch(&users(&s), "live-app", rotate).await.unwrap();
        let next = if previous.ends_with("-1") {
            previous.replace("-1", "-2")
        } else {
            previous.trim_end_matches("-2").to_string() + "-1"
        };
        let secret = user_secret(&s, "live-app", Some(&next)).await;
        let after = wait_user_where(&s, "live-app", "True", "UserReady", |u| {
            u.status.as_ref().and_then(|st| st.role.as_deref()) == Some(next.as_str())
        })
        .await
        .status
        .unwrap();
        assert_eq!(after.role.as_deref(), Some(next.as_str()));
        assert_eq!(after.previous_role.as_deref(), Some(previous.as_str()));
        // Second precision (metav1.Time): a rotation in the creation's second keeps it.
        assert!(
            after.rotation.last_rotation >= before.rotation.last_rotation,
            "lastRotation moves on"
        );
        assert_eq!(
            after.rotation.rotate_request,
            Some(format!("round-{round}"))
        );
        // The previous login keeps working until keepPrevious, then it cannot log in.
        wait_retired(&s, &previous).await;
        assert!(
            login(s.pg.port(), &next, &value(&secret, "password"), "live")
                .await
                .unwrap()
        );
        logins.push(next);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, cut, other) = app.await.unwrap();
    assert!(
        other.is_empty(),
        "the application lost queries other than on cut sessions: {other:?}"
    );
    assert!(ok > 50, "the application ran ({ok} queries)");
    assert!(cut <= 2, "at most one session cut per rotation ({cut})");
    let rows: i64 = scalar(&owner, "SELECT count(*) FROM t").await;
    assert_eq!(rows as u64, ok, "every acknowledged insert is there");
}

#[tokio::test]
async fn the_owners_password_rotates_and_what_it_creates_stays_the_owners() {
    let s = Setup::with_major("ownerrot", 17).await;
    s.create_ready("rot", json!({"passwordRotation": {"keepPrevious": "5s"}}))
        .await;
    let first = s.connection_secret("rot").await;
    assert_eq!(
        value(&first, "username"),
        "rot",
        "before any rotation the owner logs in"
    );
    let before = connect_with(&s, &first).await;
    before
        .batch_execute("CREATE TABLE a (id int)")
        .await
        .unwrap();
    create_user(&s, "rot-ro", json!({"databaseRef": {"name": "rot"}})).await;
    wait_user(&s, "rot-ro", "True", "UserReady").await;
    let databases = s.databases();

    for (round, login, previous) in [(1, "rot-1", "rot"), (2, "rot-2", "rot-1")] {
        let rotate = json!({"metadata": {"annotations": {"dbops.dev/rotate": format!("{round}")}}});
        merge_patch(&databases, "rot", rotate).await.unwrap();
        let secret = user_secret(&s, "rot", Some(login)).await;
        let owner = connect_with(&s, &secret).await;
        let who: String = scalar(&owner, "SELECT current_user::text").await;
        assert_eq!(who, "rot", "a rotation login acts as the owner");
        let table = format!("made_after_rotation_{round}");
        owner
            .batch_execute(&format!(
                "CREATE TABLE {table} (id int); INSERT INTO {table} VALUES (1)"
            ))
            .await
            .unwrap();
        let admin = s.pg.connect_as_superuser_to("rot").await.unwrap();
        let table_owner: String = admin
            .query_one(
                "SELECT tableowner::text FROM pg_tables WHERE tablename = $1",
                &[&table],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(table_owner, "rot", "objects stay owned by the owner role");
        let ro = connect_with(&s, &user_secret(&s, "rot-ro", None).await).await;
        ro.query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap_or_else(|e| {
                panic!("the ReadOnly user reads what a rotated login created: {e}")
            });
        // The previous login stops after keepPrevious; its sessions end.
        wait_retired(&s, previous).await;
        let db = s.wait_ready("rot").await;
        let status = db.status.unwrap();
        assert_eq!(status.login.as_deref(), Some(login));
        assert_eq!(status.rotation.rotate_request, Some(format!("{round}")));
    }
    assert!(
        before.query_one("SELECT 1", &[]).await.is_err(),
        "the owner's own session ended"
    );

    // Deleted with policy Delete: the database, the owner and both of its logins go.
    users(&s)
        .delete("rot-ro", &DeleteParams::default())
        .await
        .unwrap();
    merge_patch_spec(&databases, "rot", json!({"deletionPolicy": "Delete"}))
        .await
        .unwrap();
    // The finalizer comes with the policy: deletion then drops what the Database made.
    let db = eventually(
        "the Delete policy's finalizer",
        READY,
        || async {
            Ok(databases
                .get("rot")
                .await?
                .metadata
                .finalizers
                .unwrap_or_default())
        },
        |f| f.iter().any(|f| f == "dbops.dev/database-cleanup"),
    )
    .await;
    let _ = db;
    let db = databases.get("rot").await.unwrap();
    s.delete("rot").await;
    s.wait_gone(&db, READY).await;
    eventually(
        "every role of the Database and its user gone",
        READY,
        || async { Ok(roles_like(&s, "rot").await) },
        |r| r.is_empty(),
    )
    .await;
}
