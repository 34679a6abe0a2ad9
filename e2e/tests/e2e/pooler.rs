//! The pooler's configuration run by a real PgBouncer (Debian's package) against real
//! servers: the `pgbouncer.ini` and SCRAM userlist dbops renders (`dbops_shared::pooler`),
//! and passwords set on the server by dbops's own statement (`ddl::password_statement`,
//! the login's salt), as the pooler needs.

use std::time::{Duration, Instant};

use dbops_e2e::pgbouncer::PgBouncer;
use dbops_e2e::postgres::{PgServer, quote_ident};
use dbops_shared::pooler::{Route, Userlist};
use dbops_shared::postgres::ddl::password_statement;
use dbops_shared::postgres::scram::{salt_for, verifier};
use dbops_shared::postgres::{generate_password, password_verifier};

use crate::test_dir;

const ADMIN: &str = "dbops_pooler_admin";

/// [`dbops_e2e::pgbouncer::tenant`], in a test.
async fn tenant(pg: &PgServer, login: &str, db: &str) -> String {
    dbops_e2e::pgbouncer::tenant(pg, login, db).await.unwrap()
}

/// Another login on `db` (a rotation's second login).
async fn second_login(pg: &PgServer, login: &str, db: &str) -> String {
    let password = generate_password();
    let su = pg.connect_as_superuser().await.unwrap();
    su.batch_execute(&format!(
        "CREATE ROLE {0} LOGIN; GRANT CONNECT ON DATABASE {db} TO {0}",
        quote_ident(login),
    ))
    .await
    .unwrap();
    su.batch_execute(&password_statement(login, &password))
        .await
        .unwrap();
    password
}

fn route(db: &str, pg: &PgServer) -> Route {
    Route {
        name: db.into(),
        host: pg.host().into(),
        port: pg.port(),
        dbname: db.into(),
    }
}

/// The userlist of these logins, each entry made from the password as dbops will make it.
fn userlist(logins: &[(&str, &str)]) -> Userlist {
    let mut list = Userlist::default();
    for (login, password) in logins {
        list.insert(login, &password_verifier(login, password))
            .unwrap();
    }
    list
}

async fn whoami(c: &tokio_postgres::Client) -> (String, String) {
    let rows = c
        .simple_query("SELECT current_user, current_database()")
        .await
        .unwrap();
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((r.get(0).unwrap().to_string(), r.get(1).unwrap().to_string()))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no row in {rows:?}"))
}

#[tokio::test]
async fn pooled_logins_reach_their_own_database_only_and_a_retired_login_stops() {
    dbops_e2e::init_test_logging();
    let pg = PgServer::start_with_settings("pooled", &[("log_connections", "on")])
        .await
        .unwrap();
    let a = tenant(&pg, "orders_owner", "orders").await;
    let b = tenant(&pg, "billing_owner", "billing").await;
    let a2 = second_login(&pg, "orders_owner-2", "orders").await;
    let admin = generate_password();

    let dir = test_dir("pooler", "logins");
    let settings = PgBouncer::settings_in(dir.path(), ADMIN).unwrap();
    let routes = [route("orders", &pg), route("billing", &pg)];
    let mut bouncer = PgBouncer::start(
        dir.path(),
        settings,
        &routes,
        &userlist(&[
            ("orders_owner", &a),
            ("billing_owner", &b),
            ("orders_owner-2", &a2),
            (ADMIN, &admin),
        ]),
    )
    .await
    .unwrap();

    // Each login through the pooler reaches its own database, as itself.
    let c = bouncer.connect("orders_owner", &a, "orders").await.unwrap();
    assert_eq!(whoami(&c).await, ("orders_owner".into(), "orders".into()));
    let c = bouncer
        .connect("billing_owner", &b, "billing")
        .await
        .unwrap();
    assert_eq!(whoami(&c).await, ("billing_owner".into(), "billing".into()));

    // Not another tenant's: the server refuses it (CONNECT), the pooler passes that on.
    let e = bouncer
        .connect("orders_owner", &a, "billing")
        .await
        .map(drop)
        .expect_err("orders_owner must not reach billing through the pooler");
    assert!(
        format!("{e:#}").contains("permission denied"),
        "the server's refusal: {e:#}"
    );
    // A wrong password never gets past the pooler.
    let e = bouncer
        .connect("orders_owner", &b, "orders")
        .await
        .map(drop)
        .expect_err("a wrong password must be refused");
    assert!(format!("{e:#}").contains("authentication failed"), "{e:#}");

    // The pooler authenticated each login with SCRAM against the server's own verifier
    // (pass-through): no query, no other login on the server's side.
    let log = std::fs::read_to_string(pg.log_path()).unwrap();
    for login in ["orders_owner", "billing_owner"] {
        assert!(
            log.contains(&format!(
                "connection authenticated: identity=\"{login}\" method=scram-sha-256"
            )),
            "{login} authenticated by SCRAM on the server:\n{}",
            pg.log_tail(4000)
        );
    }

    // A rotation's overlap: both logins of orders work through the pooler.
    let c = bouncer
        .connect("orders_owner-2", &a2, "orders")
        .await
        .unwrap();
    assert_eq!(whoami(&c).await, ("orders_owner-2".into(), "orders".into()));
    drop(c);
    // The retired login leaves the userlist: the pooler refuses it after a RELOAD, while
    // the other login goes on working.
    bouncer
        .rewrite(
            &routes,
            &userlist(&[("orders_owner", &a), ("billing_owner", &b), (ADMIN, &admin)]),
        )
        .unwrap();
    bouncer
        .admin(&admin)
        .await
        .unwrap()
        .simple_query("RELOAD")
        .await
        .unwrap();
    let e = bouncer
        .connect("orders_owner-2", &a2, "orders")
        .await
        .map(drop)
        .expect_err("a login gone from the userlist must be refused");
    assert!(format!("{e:#}").contains("authentication failed"), "{e:#}");
    let c = bouncer.connect("orders_owner", &a, "orders").await.unwrap();
    assert_eq!(whoami(&c).await.0, "orders_owner");
    drop(c);

    // Why the salt is derived and not random: a verifier of the right password with any
    // other salt lets the client past a (fresh) pooler, and the server then refuses the
    // pooler's login.
    let mut other_salt = Userlist::default();
    other_salt
        .insert("orders_owner", &verifier(&a, &salt_for("another-login")))
        .unwrap();
    let dir2 = test_dir("pooler", "other-salt");
    let settings = PgBouncer::settings_in(dir2.path(), ADMIN).unwrap();
    let fresh = PgBouncer::start(dir2.path(), settings, &routes, &other_salt)
        .await
        .unwrap();
    let e = fresh
        .connect("orders_owner", &a, "orders")
        .await
        .map(drop)
        .expect_err("a verifier the server does not hold cannot pass through");
    assert!(format!("{e:#}").contains("authentication failed"), "{e:#}");
    drop(fresh);
    drop(dir2);
    drop(dir);
}

/// The ★ cutover's mechanism: PAUSE one database, point its route at another server,
/// RELOAD, RESUME. A client connected through the pooler throughout sees a wait, not an
/// error, and its next queries land on the new server; the same login's verifier (the login's
/// salt) is the one both servers hold, so the userlist does not change.
#[tokio::test]
async fn a_paused_database_moves_to_another_server_and_its_pooled_client_sees_no_error() {
    dbops_e2e::init_test_logging();
    let (source, target) = tokio::join!(PgServer::start("pool-src"), PgServer::start("pool-dst"));
    let (source, target) = (source.unwrap(), target.unwrap());
    let password = tenant(&source, "shop_owner", "shop").await;
    // The target holds the same login (a Migration creates it there) with the same
    // password: the derived salt gives it the same verifier.
    {
        let su = target.connect_as_superuser().await.unwrap();
        su.batch_execute("CREATE ROLE shop_owner LOGIN")
            .await
            .unwrap();
        su.batch_execute(&password_statement("shop_owner", &password))
            .await
            .unwrap();
        su.batch_execute("CREATE DATABASE shop OWNER shop_owner")
            .await
            .unwrap();
    }
    let admin = generate_password();
    let dir = test_dir("pooler", "cutover");
    let settings = PgBouncer::settings_in(dir.path(), ADMIN).unwrap();
    let users = userlist(&[("shop_owner", &password), (ADMIN, &admin)]);
    let mut bouncer = PgBouncer::start(dir.path(), settings, &[route("shop", &source)], &users)
        .await
        .unwrap();

    let client = bouncer
        .connect("shop_owner", &password, "shop")
        .await
        .unwrap();
    let port_of = |rows: Vec<tokio_postgres::SimpleQueryMessage>| -> u16 {
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                _ => None,
            })
            .and_then(|p| p.parse().ok())
            .expect("inet_server_port()")
    };
    // The client queries without a pause of its own, before, during and after the move.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut ok, mut failed, mut longest) = (0u32, Vec::new(), Duration::ZERO);
            let mut ports = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                match client.simple_query("SELECT inet_server_port()").await {
                    Ok(rows) => {
                        ok += 1;
                        ports.push(port_of(rows));
                    }
                    Err(e) => failed.push(format!("{e:#}")),
                }
                longest = longest.max(t.elapsed());
            }
            (ok, failed, longest, ports)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // queries on the source first

    let console = bouncer.admin(&admin).await.unwrap();
    let paused = Instant::now();
    console.simple_query("PAUSE shop").await.unwrap();
    bouncer.rewrite(&[route("shop", &target)], &users).unwrap();
    console.simple_query("RELOAD").await.unwrap();
    // A little time in the pause, as a freeze takes, so the client's wait shows.
    tokio::time::sleep(Duration::from_millis(200)).await;
    console.simple_query("RESUME shop").await.unwrap();
    let pause = paused.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await; // queries on the target after
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed, longest, ports) = worker.await.unwrap();

    println!(
        "pooled client across the move: {ok} queries, {} failed, longest wait {longest:?} (pause {pause:?})",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "queries failed across the move: {failed:?}"
    );
    assert_eq!(ports.first(), Some(&source.port()), "first on the source");
    assert_eq!(ports.last(), Some(&target.port()), "last on the target");
    let switch = ports.iter().position(|p| *p == target.port()).unwrap();
    assert!(
        ports[switch..].iter().all(|p| *p == target.port()),
        "never back on the source after the move"
    );
    assert!(
        longest >= Duration::from_millis(150),
        "the client waited through the pause: {longest:?}"
    );
    drop(bouncer);
    drop(dir);
}

/// What `spec.pooler` makes: the database-controller keeps a pooler Secret, Deployment,
/// Service and PodDisruptionBudget in its namespace; the Secret's configuration, run by a
/// real PgBouncer as a Pod would run it, lets each Database's login (from its connection
/// Secret) into its own database and no other; once converged nothing is written; a
/// deleted Secret comes back; without `spec.pooler` everything goes. (This bed has no
/// node: the Deployment's Pods never run, and `PoolerReady` says so.)
#[tokio::test]
async fn a_pooled_servers_databases_are_served_by_the_configuration_dbops_keeps() {
    use dbops_e2e::harness::database::{ADMIN_SECRET, READY, Setup, value};
    use dbops_e2e::wait::eventually;
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{Secret, Service};
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use kube::api::{Api, DeleteParams, Patch, PatchParams};

    dbops_e2e::init_test_logging();
    let s = Setup::new("pooled-server").await;
    let ns = s.ns().to_string();
    let server = s.server(ADMIN_SECRET);
    let servers: Api<dbops_api::DatabaseServer> = Api::all(s.b.client.clone());
    servers
        .patch(
            &server,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"pooler": {"defaultPoolSize": 4}}})),
        )
        .await
        .unwrap();
    // orders' template takes the pooler's values (empty without a pooler).
    let template = serde_json::json!({"secretTemplate": {
        "POOLED_HOST": "{% if pooler_host %}{{ pooler_host }}:{{ pooler_port }}{% else %}none{% endif %}",
    }});
    s.create_ready("orders", template).await;
    s.create_ready("billing", serde_json::json!({})).await;
    // A DatabaseUser of orders: its login is served too.
    dbops_e2e::harness::users::create_user(
        &s,
        "orders-reader",
        serde_json::json!({"databaseRef": {"name": "orders"}, "access": "ReadOnly"}),
    )
    .await;
    dbops_e2e::harness::users::wait_user(&s, "orders-reader", "True", "UserReady").await;

    let name = format!("dbops-pooler-{}", server.replace('.', "-"));
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), &ns);
    let pooler = eventually(
        "the pooler's Secret to route both databases",
        READY,
        || async { Ok(secrets.get_opt(&name).await?) },
        |secret| {
            secret.as_ref().is_some_and(|s| {
                let ini = value(s, "pgbouncer.ini");
                // Two owners, the reader and the admin console.
                ini.contains("\norders = ")
                    && ini.contains("\nbilling = ")
                    && value(s, "userlist.txt").lines().count() == 4
            })
        },
    )
    .await
    .unwrap();
    let ini = value(&pooler, "pgbouncer.ini");
    assert!(ini.contains("default_pool_size = 4"), "{ini}");
    assert!(ini.contains("auth_type = scram-sha-256"), "{ini}");
    let userlist = value(&pooler, "userlist.txt");
    assert!(
        userlist.lines().all(|l| l.contains("\" \"SCRAM-SHA-256$")),
        "verifiers only"
    );

    // The Deployment, Service and budget, and the server's status.
    let deployments: Api<Deployment> = Api::namespaced(s.b.client.clone(), &ns);
    let deployment = match dbops_e2e::wait::wait_for(
        "the pooler's Deployment",
        READY,
        || async { Ok(deployments.get_opt(&name).await?) },
        Option::is_some,
    )
    .await
    {
        Ok(Some(d)) => d,
        other => panic!("{other:?}\n{}", s.controller_log(6000)),
    };
    let spec = deployment.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    assert_eq!(
        pod.security_context.unwrap().run_as_non_root,
        Some(true),
        "restricted Pods"
    );
    Api::<Service>::namespaced(s.b.client.clone(), &ns)
        .get(&name)
        .await
        .unwrap();
    Api::<PodDisruptionBudget>::namespaced(s.b.client.clone(), &ns)
        .get(&name)
        .await
        .unwrap();
    let status = eventually(
        "the server's status.pooler",
        READY,
        || async { Ok(servers.get(&server).await?.status) },
        |st| {
            st.as_ref()
                .and_then(|st| st.pooler.as_ref())
                .is_some_and(|p| p.databases == 2 && p.logins == 3)
        },
    )
    .await
    .unwrap();
    let ready = dbops_shared::conditions::get(&status.conditions, "PoolerReady").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "PoolerStarting")
    );
    assert!(
        ready.message.starts_with("0 of 2 pooler Pods ready"),
        "{}",
        ready.message
    );

    // PgBouncer on that configuration, as a Pod runs it: clients must use TLS, verified
    // against the certificate the connection Secrets carry.
    let files: std::collections::BTreeMap<String, String> =
        ["pgbouncer.ini", "userlist.txt", "tls.crt", "tls.key"]
            .into_iter()
            .map(|k| (k.to_string(), value(&pooler, k)))
            .collect();
    assert!(ini.contains("client_tls_sslmode = require"), "{ini}");
    let dir = dbops_e2e::harness::bed::test_dir("pooled-server", "pgbouncer");
    let bouncer = PgBouncer::start_from_rendered(dir.path(), &files, ADMIN)
        .await
        .unwrap();
    for (db, other) in [
        ("orders", "billing"),
        ("billing", "orders"),
        ("orders-reader", "billing"),
    ] {
        // The connection Secret's pooler keys: found once the server's status shows
        // the pooler (its Databases are reconciled then).
        let secret = eventually(
            &format!("{db}'s connection Secret to carry the pooler keys"),
            READY,
            || async { Ok(s.connection_secret(db).await) },
            |secret| {
                secret
                    .data
                    .as_ref()
                    .is_some_and(|d| d.contains_key("pooler-uri"))
            },
        )
        .await;
        let (login, password) = (value(&secret, "username"), value(&secret, "password"));
        let dbname = value(&secret, "dbname");
        assert_eq!(value(&secret, "pooler-host"), format!("{name}.{ns}.svc"));
        assert_eq!(value(&secret, "pooler-port"), "6432");
        assert!(
            value(&secret, "pooler-uri").ends_with(&format!(
                "@{name}.{ns}.svc:6432/{dbname}?sslmode=verify-full"
            )),
            "{}",
            value(&secret, "pooler-uri").replace(&password, "***")
        );
        let ca = value(&secret, "pooler-ca.crt");
        assert_eq!(ca, value(&pooler, "tls.crt"));
        if db == "orders" {
            assert_eq!(
                value(&secret, "POOLED_HOST"),
                format!("{name}.{ns}.svc:6432"),
                "the template's pooler values"
            );
        }
        bouncer
            .connect(&login, &password, &dbname)
            .await
            .map(drop)
            .expect_err("plain TCP is refused: clients must use TLS");
        let c = bouncer
            .connect_tls(&login, &password, &dbname, ca.as_bytes())
            .await
            .unwrap();
        assert_eq!(whoami(&c).await, (login.clone(), dbname.clone()));
        let e = bouncer
            .connect_tls(&login, &password, other, ca.as_bytes())
            .await
            .map(drop)
            .expect_err("a login reaches its own database only");
        assert!(format!("{e:#}").contains("permission denied"), "{e:#}");
    }
    let console = bouncer
        .admin_tls(
            &value(&pooler, "admin-password"),
            value(&pooler, "tls.crt").as_bytes(),
        )
        .await
        .unwrap();
    console.simple_query("SHOW DATABASES").await.unwrap();
    drop(bouncer);

    // Converged: nothing written while nothing changes.
    s.assert_quiet().await;

    // Someone deletes the Secret: it is made again.
    secrets
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the pooler's Secret made again",
        READY,
        || async { Ok(secrets.get_opt(&name).await?) },
        |secret| {
            secret
                .as_ref()
                .is_some_and(|s| s.metadata.deletion_timestamp.is_none())
        },
    )
    .await
    .unwrap();

    // No pooler asked for: what dbops made goes, and so do status.pooler and PoolerReady.
    servers
        .patch(
            &server,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"pooler": null}})),
        )
        .await
        .unwrap();
    eventually(
        "the pooler's objects gone",
        READY,
        || async {
            Ok((
                deployments.get_opt(&name).await?.is_some(),
                secrets.get_opt(&name).await?.is_some(),
                servers.get(&server).await?.status,
            ))
        },
        |(deployment, secret, status)| {
            !deployment
                && !secret
                && status.as_ref().is_some_and(|st| {
                    st.pooler.is_none()
                        && dbops_shared::conditions::get(&st.conditions, "PoolerReady").is_none()
                })
        },
    )
    .await;
    drop(dir);
}

/// The pooler Pods' entrypoint (`deploy/docker/pgbouncer/dbops-pgbouncer-run`) with
/// Debian's PgBouncer: a login added to the userlist (swapped in as the kubelet swaps a
/// Secret volume) gets in after the next look, while a client connected before keeps its
/// connection (a reload, not a restart); SIGTERM ends it cleanly.
#[tokio::test]
async fn the_pooler_entrypoint_reloads_a_changed_userlist_without_dropping_clients() {
    dbops_e2e::init_test_logging();
    let pg = PgServer::start("pool-entry").await.unwrap();
    let a = tenant(&pg, "orders_owner", "orders").await;
    let b = tenant(&pg, "billing_owner", "billing").await;
    let admin = generate_password();
    let dir = test_dir("pooler", "entrypoint");
    let settings = PgBouncer::settings_in(dir.path(), ADMIN).unwrap();
    let routes = [route("orders", &pg), route("billing", &pg)];
    let mut bouncer = PgBouncer::start_through_entrypoint(
        dir.path(),
        settings,
        &routes,
        &userlist(&[("orders_owner", &a), (ADMIN, &admin)]),
        1,
    )
    .await
    .unwrap();
    let before = bouncer.connect("orders_owner", &a, "orders").await.unwrap();
    assert_eq!(whoami(&before).await.0, "orders_owner");
    bouncer
        .connect("billing_owner", &b, "billing")
        .await
        .map(drop)
        .expect_err("billing_owner is not in the userlist yet");

    bouncer
        .swap_userlist(&userlist(&[
            ("orders_owner", &a),
            ("billing_owner", &b),
            (ADMIN, &admin),
        ]))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let after = loop {
        match bouncer.connect("billing_owner", &b, "billing").await {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => {
                panic!(
                    "billing_owner never let in: {e:#}\n{}",
                    bouncer.log_tail(3000)
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    assert_eq!(whoami(&after).await.0, "billing_owner");
    assert_eq!(
        whoami(&before).await.0,
        "orders_owner",
        "the client from before the reload is still connected"
    );
    assert!(
        bouncer
            .log_tail(20_000)
            .contains("the configuration changed; reloading"),
        "{}",
        bouncer.log_tail(3000)
    );
    drop((before, after));
    let status = bouncer.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "SIGTERM: a safe shutdown, exit {status}");
    drop(dir);
}
