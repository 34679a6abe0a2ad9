//! The pooler as installed (issue 36): a DatabaseServer with `spec.pooler` runs PgBouncer
//! Pods from the image built from `deploy/docker/dbops-pgbouncer.Dockerfile`; a Database on
//! it is reached through the pooler's Service with its connection Secret's `pooler-*`
//! keys, over TLS verified against `pooler-ca.crt` with the Service's name
//! (`verify-full`); a pooler container SIGKILLed on the node is restarted and serves again.
//! A Logical Migration of a Database on a pooled server to pg-target under a writer
//! connected through the pooler's Service: the Pods PAUSE it, route it to the target
//! once the kubelet brings the new Secret in (the Pods' annotation bumped), RESUME it,
//! and the writer fails no insert and loses no committed row.

use std::time::Duration;

use dbops_api::{Database, DatabaseServer, Migration, MigrationPhase, PoolMode, PoolerSpec};
use dbops_e2e::fixtures::manifest;
use dbops_e2e::wait::wait_for;
use dbops_shared::postgres::tls::{Verify, connector, roots_from_pem};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::bed::{Bed, MAIN, SYSTEM, TARGET, Tenant, bed, pod_ready, restart_count};

const SETTLE: Duration = Duration::from_secs(300);

fn value(secret: &Secret, key: &str) -> String {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .unwrap_or_else(|| panic!("the connection Secret has no {key}"))
}

/// A session through the pooler as the Secret says (`verify-full` with `pooler-ca.crt`).
pub(crate) async fn pooled_session(
    secret: &Secret,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let ca = value(secret, "pooler-ca.crt");
    let port: u16 = value(secret, "pooler-port").parse().unwrap();
    let (client, connection) = tokio_postgres::Config::new()
        .host(value(secret, "pooler-host"))
        .port(port)
        .user(value(secret, "username"))
        .password(value(secret, "password"))
        .dbname(value(secret, "dbname"))
        .ssl_mode(tokio_postgres::config::SslMode::Require)
        .connect_timeout(Duration::from_secs(5))
        .connect(
            connector(
                Verify::ChainAndHost,
                Some(roots_from_pem(ca.as_bytes()).unwrap()),
            )
            .unwrap(),
        )
        .await?;
    tokio::spawn(connection);
    Ok(client)
}

/// `SELECT current_user, current_database()` through the pooler as the Secret says.
async fn through_pooler(secret: &Secret) -> Result<(String, String), tokio_postgres::Error> {
    let row = pooled_session(secret)
        .await?
        .query_one("SELECT current_user::text, current_database()::text", &[])
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// The connection Secret of Database `db_name` once it has the pooler keys.
pub(crate) async fn pooled_secret(secrets: &Api<Secret>, db_name: &str) -> Secret {
    wait_for(
        "the connection Secret's pooler keys",
        SETTLE,
        || async { Ok(secrets.get_opt(&format!("{db_name}-connection")).await?) },
        |s: &Option<Secret>| {
            s.as_ref()
                .and_then(|s| s.data.as_ref())
                .is_some_and(|d| d.contains_key("pooler-uri"))
        },
    )
    .await
    .unwrap()
    .unwrap()
}

/// Deletes Database `db_name`, waits until it is gone, then deletes DatabaseServer
/// `server`.
pub(crate) async fn remove(bed: &Bed, databases: &Api<Database>, db_name: &str, server: &str) {
    databases
        .delete(db_name, &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        &format!("Database {db_name} gone"),
        SETTLE,
        || async { Ok(databases.get_opt(db_name).await?.is_none()) },
        |gone: &bool| *gone,
    )
    .await
    .unwrap();
    Api::<DatabaseServer>::all(bed.client.clone())
        .delete(server, &DeleteParams::default())
        .await
        .unwrap();
}

/// Waits until DatabaseServer `server` reports `replicas` pooler Pods ready.
pub(crate) async fn pooler_pods_ready(bed: &Bed, server: &str, replicas: i32) {
    let servers: Api<DatabaseServer> = Api::all(bed.client.clone());
    wait_for(
        &format!("DatabaseServer {server}: {replicas} pooler Pods ready"),
        SETTLE,
        || async { Ok(servers.get(server).await?) },
        |s: &DatabaseServer| {
            s.status
                .as_ref()
                .and_then(|st| st.pooler.as_ref())
                .is_some_and(|p| p.ready_replicas == replicas)
        },
    )
    .await
    .unwrap();
}

/// Migration `move`: Database `db_name` of namespace `ns` to pg-target in Logical mode,
/// cut over by itself; waits until it ends and asserts it Succeeded. Its status, and how
/// long it took from its creation.
pub(crate) async fn logical_move(
    bed: &Bed,
    ns: &str,
    db_name: &str,
) -> (dbops_api::MigrationStatus, Duration) {
    let migration: Migration = manifest(
        "move",
        json!({"databaseRef": {"name": db_name}, "target": {"serverRef": {"name": TARGET}},
               "mode": "Logical"}),
    )
    .unwrap();
    let migrations: Api<Migration> = bed.api(ns);
    migrations
        .create(&PostParams::default(), &migration)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let moved = crate::runtime::migration_ended(&migrations, "move", SETTLE).await;
    let status = moved.status.unwrap_or_default();
    assert_eq!(status.phase, Some(MigrationPhase::Succeeded), "{status:?}");
    (status, started.elapsed())
}

/// pg-main once more under another name, with a pooler of `replicas` Pods.
pub(crate) async fn pooled_server(bed: &Bed, tenant: &Tenant, replicas: i32) -> String {
    let servers: Api<DatabaseServer> = Api::all(bed.client.clone());
    let main = servers.get(MAIN).await.unwrap();
    let name = format!("pooled-{}", tenant.db("x").trim_start_matches("x-"));
    let mut spec = main.spec.clone();
    spec.pooler = Some(PoolerSpec {
        replicas,
        pool_mode: PoolMode::Transaction,
        max_client_connections: 100,
        default_pool_size: 5,
        certificate_secret_ref: None,
    });
    servers
        .create(&PostParams::default(), &DatabaseServer::new(&name, spec))
        .await
        .unwrap();
    name
}

#[tokio::test]
async fn a_pooled_server_serves_its_databases_through_pgbouncer_pods() {
    let bed = bed().await;
    let tenant = Tenant::create(bed, "pooled").await.unwrap();
    let servers: Api<DatabaseServer> = Api::all(bed.client.clone());
    let name = pooled_server(bed, &tenant, 2).await;

    let db_name = tenant.db("orders");
    let db: Database = manifest(
        &db_name,
        json!({"serverRef": {"name": name}, "deletionPolicy": "Delete"}),
    )
    .unwrap();
    let databases: Api<Database> = bed.api(&tenant.name);
    databases.create(&PostParams::default(), &db).await.unwrap();
    wait_for(
        &format!("DatabaseServer {name}: PoolerReady"),
        SETTLE,
        || async { Ok(servers.get(&name).await?) },
        |s: &DatabaseServer| {
            s.status.as_ref().is_some_and(|st| {
                st.conditions
                    .iter()
                    .any(|c| c.type_ == "PoolerReady" && c.status == "True")
                    && st.pooler.as_ref().is_some_and(|p| p.databases == 1)
            })
        },
    )
    .await
    .unwrap();
    let secrets: Api<Secret> = bed.api(&tenant.name);
    let secret = pooled_secret(&secrets, &db_name).await;
    // The userlist reaches the Pods through the Secret volume and a reload: retried until
    // the login is in.
    let login = value(&secret, "username");
    let dbname = value(&secret, "dbname");
    wait_for(
        "a session through the pooler's Service",
        SETTLE,
        || async { Ok(through_pooler(&secret).await.ok()) },
        |r: &Option<(String, String)>| r.as_ref() == Some(&(login.clone(), dbname.clone())),
    )
    .await
    .unwrap();

    // SIGKILL one pooler container on the node: the kubelet restarts it, and the pooler
    // serves again.
    let pods: Api<Pod> = bed.api(SYSTEM);
    let object = dbops_shared::pooler::object_name(&name);
    let list = pods
        .list(
            &ListParams::default().labels(&format!("{}={object}", dbops_api::names::label::POOLER)),
        )
        .await
        .unwrap();
    assert_eq!(list.items.len(), 2, "two pooler Pods");
    let pod = &list.items[0];
    let pod_name = pod.metadata.name.clone().unwrap();
    let before = restart_count(pod);
    let (id, _) = bed.container_pid(pod).unwrap();
    bed.ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])
        .unwrap();
    wait_for(
        &format!("{pod_name} restarted and ready"),
        SETTLE,
        || async { Ok(pods.get(&pod_name).await?) },
        |p: &Pod| restart_count(p) > before && pod_ready(p),
    )
    .await
    .unwrap();
    for _ in 0..4 {
        assert_eq!(
            through_pooler(&secret).await.unwrap(),
            (login.clone(), dbname.clone()),
            "served after the restart (either Pod)"
        );
    }

    remove(bed, &databases, &db_name, &name).await;
}

#[tokio::test]
async fn a_logical_migration_through_the_pooler_pods_fails_no_pooled_query() {
    use dbops_e2e::live_writer::{LiveWriter, Options};
    let bed = bed().await;
    let tenant = Tenant::create(bed, "pooled-move").await.unwrap();
    let name = pooled_server(bed, &tenant, 2).await;
    let db_name = tenant.db("app");
    let db: Database = manifest(
        &db_name,
        json!({"serverRef": {"name": name}, "deletionPolicy": "Delete"}),
    )
    .unwrap();
    let databases: Api<Database> = bed.api(&tenant.name);
    databases.create(&PostParams::default(), &db).await.unwrap();
    let secrets: Api<Secret> = bed.api(&tenant.name);
    let secret = pooled_secret(&secrets, &db_name).await;
    // Both Pods have the route once the kubelet synced their volume: wait for a session.
    let session = wait_for(
        "a session through the pooler's Service",
        SETTLE,
        || async { Ok(pooled_session(&secret).await.ok()) },
        Option::is_some,
    )
    .await
    .unwrap()
    .unwrap();
    session
        .batch_execute("CREATE TABLE writes (n bigint PRIMARY KEY)")
        .await
        .unwrap();
    // Both pooler Pods Ready before the cutover, which pauses every instance there is
    // (a session through the Service needs only one).
    pooler_pods_ready(bed, &name, 2).await;
    let connect = {
        let secret = secret.clone();
        move || {
            let secret = secret.clone();
            async move { anyhow::Ok(pooled_session(&secret).await?) }
        }
    };
    let writer = LiveWriter::start(
        connect,
        Options::new("writes").pause(Duration::from_millis(20)),
    );
    wait_for(
        "the pooled writer's first commits",
        Duration::from_secs(60),
        || async { Ok(writer.commits()) },
        |n: &usize| *n >= 50,
    )
    .await
    .unwrap();

    let migrations: Api<Migration> = bed.api(&tenant.name);
    let (status, took) = logical_move(bed, &tenant.name, &db_name).await;
    let before = writer.commits();
    wait_for(
        "pooled commits after the switch",
        Duration::from_secs(60),
        || async { Ok(writer.commits()) },
        |n: &usize| *n >= before + 50,
    )
    .await
    .unwrap();
    let log = writer.finish().await;
    let (gap, _) = log.longest_gap();
    println!(
        "Logical migration through 2 pooler Pods in {:.1}s: pooled writer {} commits, {} failed, longest wait {:.3}s",
        took.as_secs_f64(),
        log.numbers().len(),
        log.failures(),
        gap.as_secs_f64()
    );
    let record = status.pooler.clone().expect("status.pooler");
    assert!(record.held && record.resumed_at.is_some(), "{record:?}");
    assert_eq!(record.instances, 2, "{record:?}");
    assert_eq!(
        log.failures(),
        0,
        "first {:?}, last {:?}",
        log.first_failure,
        log.last_failure
    );
    // Every committed row is on the target: the pooler now routes there.
    let rows = pooled_session(&secret)
        .await
        .unwrap()
        .query("SELECT n, inet_server_port() FROM writes", &[])
        .await
        .unwrap();
    let on_target: std::collections::BTreeSet<i64> = rows.iter().map(|r| r.get(0)).collect();
    let lost: Vec<i64> = log
        .numbers()
        .into_iter()
        .filter(|n| !on_target.contains(n))
        .collect();
    assert!(
        lost.is_empty(),
        "{} committed rows lost: {lost:?}",
        lost.len()
    );
    let db = databases.get(&db_name).await.unwrap();
    assert_eq!(db.spec.server_ref.name, TARGET);

    migrations
        .delete("move", &DeleteParams::default())
        .await
        .unwrap();
    remove(bed, &databases, &db_name, &name).await;
}
