//! The pooler as installed (issue 36): a DatabaseServer with `spec.pooler` runs PgBouncer
//! Pods from the image built from `deploy/docker/dbops-pgbouncer.Dockerfile`; a Database on
//! it is reached through the pooler's Service with its connection Secret's `pooler-*`
//! keys, over TLS verified against `pooler-ca.crt` with the Service's name
//! (`verify-full`); a pooler container SIGKILLed on the node is restarted and serves again.

use std::time::Duration;

use dbops_api::{Database, DatabaseServer, PoolMode, PoolerSpec};
use dbops_e2e::fixtures::manifest;
use dbops_e2e::wait::wait_for;
use dbops_shared::postgres::tls::{Verify, connector, roots_from_pem};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::bed::{MAIN, SYSTEM, Tenant, bed, pod_ready, restart_count};

const SETTLE: Duration = Duration::from_secs(300);

fn value(secret: &Secret, key: &str) -> String {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .unwrap_or_else(|| panic!("the connection Secret has no {key}"))
}

/// `SELECT current_user, current_database()` through the pooler as the Secret says.
async fn through_pooler(secret: &Secret) -> Result<(String, String), tokio_postgres::Error> {
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
    let row = client
        .query_one("SELECT current_user::text, current_database()::text", &[])
        .await?;
    Ok((row.get(0), row.get(1)))
}

#[tokio::test]
async fn a_pooled_server_serves_its_databases_through_pgbouncer_pods() {
    let bed = bed().await;
    let tenant = Tenant::create(bed, "pooled").await.unwrap();
    let servers: Api<DatabaseServer> = Api::all(bed.client.clone());
    // pg-main once more, with a pooler.
    let main = servers.get(MAIN).await.unwrap();
    let name = format!("pooled-{}", tenant.db("x").trim_start_matches("x-"));
    let mut spec = main.spec.clone();
    spec.pooler = Some(PoolerSpec {
        replicas: 2,
        pool_mode: PoolMode::Transaction,
        max_client_connections: 100,
        default_pool_size: 5,
    });
    let server = DatabaseServer::new(&name, spec);
    servers
        .create(&PostParams::default(), &server)
        .await
        .unwrap();

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
    let secret = wait_for(
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
    .unwrap();
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

    databases
        .delete(&db_name, &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        &format!("Database {db_name} gone"),
        SETTLE,
        || async { Ok(databases.get_opt(&db_name).await?.is_none()) },
        |gone: &bool| *gone,
    )
    .await
    .unwrap();
    servers
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
}
