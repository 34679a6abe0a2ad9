//! An application as a team runs it (issue 39): a Pod on the node, in the team's namespace,
//! that takes its Database's connection Secret the documented way (docs/operations.md,
//! "Connecting from an application": `envFrom` the Secret, `DATABASE_URL` from its
//! `pooler-uri`, the Secret mounted at `spec.secretMountPath` for the CA files) and inserts
//! a row every 200 ms with psql, a new session each time, through a password rotation and a
//! Logical Migration to pg-target. Through the pooler the docs promise a pause of about the
//! freeze and no error; the Pod prints each query's outcome and how long it took, and the
//! test reads its log.

use std::collections::BTreeSet;
use std::time::Duration;

use dbops_api::{Database, Migration};
use dbops_e2e::fixtures::manifest;
use dbops_e2e::wait::wait_for;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, LogParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::bed::{Bed, SYSTEM, TARGET, Tenant, bed, pod_ready};
use crate::pooler::{logical_move, pooled_secret, pooled_server, pooled_session, remove};

const SETTLE: Duration = Duration::from_secs(300);
/// Where the Pod mounts the Secret, and the Database's `spec.secretMountPath`.
const MOUNT: &str = "/etc/dbops/app";
/// Successful inserts to see after each step before the next.
const STEADY: usize = 20;

/// The application: psql (the client programs of the controllers' image), one session per
/// insert, for at most 20 minutes; one line per query: `ok|fail <n> <ms> <output>`.
const SCRIPT: &str = r#"n=0
end=$(( $(date +%s) + 1200 ))
while [ "$(date +%s)" -lt "$end" ]; do
  n=$((n + 1))
  t0=$(date +%s%N)
  if out=$(/usr/lib/postgresql/17/bin/psql "$DATABASE_URL" -X -q -A -t -v ON_ERROR_STOP=1 \
      -c "INSERT INTO ticks (n) VALUES ($n) RETURNING current_setting('server_version_num')" 2>&1)
  then r=ok; else r=fail; fi
  t1=$(date +%s%N)
  echo "$r $n $(( (t1 - t0) / 1000000 )) $(printf %s "$out" | tr '\n' ' ')"
  sleep 0.2
done
"#;

/// One line of the application's log.
#[derive(Debug, Clone)]
struct Query {
    ok: bool,
    n: i64,
    millis: u64,
    output: String,
}

fn parse(log: &str) -> Vec<Query> {
    log.lines()
        .filter_map(|line| {
            let mut words = line.splitn(4, ' ');
            let ok = match words.next()? {
                "ok" => true,
                "fail" => false,
                _ => return None,
            };
            Some(Query {
                ok,
                n: words.next()?.parse().ok()?,
                millis: words.next()?.parse().ok()?,
                output: words.next().unwrap_or_default().trim().to_string(),
            })
        })
        .collect()
}

/// The application's Pod: the controllers' own image (it has psql), restricted.
fn app_pod(image: &str, secret: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "app", "labels": {"app": "dbops-e2e-app"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "app",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", SCRIPT],
                "envFrom": [{"secretRef": {"name": secret}}],
                "env": [
                    {"name": "DATABASE_URL",
                     "valueFrom": {"secretKeyRef": {"name": secret, "key": "pooler-uri"}}},
                    {"name": "PGCONNECT_TIMEOUT", "value": "10"},
                ],
                "volumeMounts": [{"name": "db", "mountPath": MOUNT, "readOnly": true}],
                "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                    "capabilities": {"drop": ["ALL"]}},
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                              "limits": {"memory": "64Mi"}},
            }],
            "volumes": [{"name": "db", "secret": {"secretName": secret}}],
        }
    }))
    .unwrap()
}

/// The application's queries so far.
async fn queries(pods: &Api<Pod>) -> anyhow::Result<Vec<Query>> {
    Ok(parse(&pods.logs("app", &LogParams::default()).await?))
}

/// The queries from the application's first success on: before it, a new Database's
/// login may not have reached every pooler Pod yet (the userlist comes with the Secret
/// volume, "within about a minute", docs/operations.md), which is not what is tested.
fn from_first_success(q: &[Query]) -> &[Query] {
    let first = q.iter().position(|q| q.ok).unwrap_or(q.len());
    &q[first..]
}

/// Waits until the application has `more` successful queries past `after` (a count of
/// lines from its first success), failing early on a failed query after its first
/// success; returns the lines from its first success.
async fn steady(pods: &Api<Pod>, after: usize, what: &str) -> Vec<Query> {
    let all = wait_for(
        &format!("{STEADY} queries of the application {what}"),
        SETTLE,
        || async { queries(pods).await },
        |q: &Vec<Query>| {
            let q = from_first_success(q);
            q.iter().any(|q| !q.ok) || q.iter().skip(after).filter(|q| q.ok).count() >= STEADY
        },
    )
    .await
    .unwrap();
    from_first_success(&all).to_vec()
}

/// The controllers' image (it has PostgreSQL's client programs), as deployed.
async fn controller_image(bed: &Bed) -> String {
    let deployments: Api<Deployment> = bed.api(SYSTEM);
    deployments
        .get("dbops-database-controller")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.image)
        .expect("the database-controller's image")
}

#[tokio::test]
async fn an_application_pod_keeps_querying_through_a_rotation_and_a_logical_migration() {
    let bed = bed().await;
    let tenant = Tenant::create(bed, "app").await.unwrap();
    let server = pooled_server(bed, &tenant, 2).await;
    let db_name = tenant.db("app");
    let db: Database = manifest(
        &db_name,
        json!({"serverRef": {"name": server}, "deletionPolicy": "Delete",
               "secretMountPath": MOUNT,
               "passwordRotation": {"every": "720h", "keepPrevious": "1h"}}),
    )
    .unwrap();
    let databases: Api<Database> = bed.api(&tenant.name);
    databases.create(&PostParams::default(), &db).await.unwrap();
    let secrets: Api<Secret> = bed.api(&tenant.name);
    let secret = pooled_secret(&secrets, &db_name).await;
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
        .batch_execute("CREATE TABLE ticks (n bigint PRIMARY KEY, at timestamptz DEFAULT now())")
        .await
        .unwrap();
    drop(session);
    crate::pooler::pooler_pods_ready(bed, &server, 2).await;

    let pods: Api<Pod> = bed.api(&tenant.name);
    let secret_name = format!("{db_name}-connection");
    pods.create(
        &PostParams::default(),
        &app_pod(&controller_image(bed).await, &secret_name),
    )
    .await
    .unwrap();
    wait_for(
        "the application's Pod running",
        SETTLE,
        || async { Ok(pods.get("app").await?) },
        |p: &Pod| pod_ready(p),
    )
    .await
    .unwrap();
    let before_rotation = steady(&pods, 0, "at the start").await.len();

    // A password rotation: the Secret moves to the other login; the Pod's environment
    // keeps the previous one, which works for keepPrevious (1h).
    let started = std::time::Instant::now();
    let rotate = json!({"metadata": {"annotations": {"dbops.dev/rotate": "app-1"}}});
    databases
        .patch(&db_name, &PatchParams::default(), &Patch::Merge(&rotate))
        .await
        .unwrap();
    wait_for(
        "the rotation recorded",
        SETTLE,
        || async { Ok(databases.get(&db_name).await?) },
        |d: &Database| {
            d.status
                .as_ref()
                .is_some_and(|s| s.rotation.rotate_request.as_deref() == Some("app-1"))
        },
    )
    .await
    .unwrap();
    let rotated = started.elapsed();
    let before_migration = steady(&pods, before_rotation, "after the rotation")
        .await
        .len();

    // A Logical Migration to pg-target, cut over by itself.
    let migrations: Api<Migration> = bed.api(&tenant.name);
    let (_, took) = logical_move(bed, &tenant.name, &db_name).await;
    let log = steady(&pods, before_migration, "after the migration").await;
    let skipped = log.first().map_or(0, |q| q.n - 1);
    pods.delete("app", &DeleteParams::default()).await.unwrap();

    let failed: Vec<&Query> = log.iter().filter(|q| !q.ok).collect();
    let longest = log.iter().max_by_key(|q| q.millis).unwrap();
    let versions: Vec<&str> =
        log.iter()
            .filter(|q| q.ok)
            .map(|q| q.output.as_str())
            .fold(Vec::new(), |mut seen, v| {
                if seen.last() != Some(&v) {
                    seen.push(v);
                }
                seen
            });
    println!(
        "application Pod: {} queries from its first success ({skipped} before it, while the pooler Pods took in the new login), {} failed; rotation recorded in {:.1}s; Logical migration in {:.1}s; \
         longest query {} ms (#{}, {} of its log); server_version_num in turn {versions:?}",
        log.len(),
        failed.len(),
        rotated.as_secs_f64(),
        took.as_secs_f64(),
        longest.millis,
        longest.n,
        if log.iter().position(|q| q.n == longest.n).unwrap_or(0) >= before_migration {
            "the migration part"
        } else if log.iter().position(|q| q.n == longest.n).unwrap_or(0) >= before_rotation {
            "the rotation part"
        } else {
            "the start"
        },
    );
    assert!(
        failed.is_empty(),
        "{} failed queries, the first: {:?}",
        failed.len(),
        failed.first()
    );
    // Every insert it saw succeed is on the target, where the pooler now routes (with the
    // Secret as the Pod got it, before the rotation).
    let rows = pooled_session(&secret)
        .await
        .unwrap()
        .query("SELECT n FROM ticks", &[])
        .await
        .unwrap();
    let on_target: BTreeSet<i64> = rows.iter().map(|r| r.get(0)).collect();
    let lost: Vec<i64> = log
        .iter()
        .filter(|q| q.ok && !on_target.contains(&q.n))
        .map(|q| q.n)
        .collect();
    assert!(lost.is_empty(), "committed inserts lost: {lost:?}");
    let db = databases.get(&db_name).await.unwrap();
    assert_eq!(db.spec.server_ref.name, TARGET);

    migrations
        .delete("move", &DeleteParams::default())
        .await
        .unwrap();
    remove(bed, &databases, &db_name, &server).await;
}
