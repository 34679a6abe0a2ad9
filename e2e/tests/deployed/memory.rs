//! The deployed controllers' memory, as the kernel counts it for their containers (cgroup
//! v1 `memory.usage_in_bytes` less inactive file pages: the working set kubelet evicts and
//! the OOM killer acts on), at idle and with 1,000 Databases, against the Deployments'
//! limits. The figures go to stderr for docs/benchmarks.md; the test fails when a
//! container comes within 80% of its limit.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dbops_api::Database;
use dbops_e2e::fixtures::manifest;
use dbops_e2e::wait::{Want, database_has, wait_for};
use futures::stream::{self, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

use crate::bed::{Bed, CONTROLLERS, MAIN, Tenant, bed, container_id};
use crate::observe::http_get;

/// The working set of `pod`'s first container, in bytes.
fn working_set(pod: &Pod) -> u64 {
    let uid = pod.uid().unwrap();
    let id = container_id(pod).unwrap();
    let qos = pod
        .status
        .as_ref()
        .and_then(|s| s.qos_class.as_deref())
        .unwrap_or("Burstable")
        .to_lowercase();
    let pod_dir = format!("pod{uid}");
    let base = PathBuf::from("/sys/fs/cgroup/memory/dbops-cluster/kubepods");
    let dir = if qos == "guaranteed" {
        base.join(pod_dir).join(&id)
    } else {
        base.join(qos).join(pod_dir).join(&id)
    };
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.join(f).display()))
    };
    let usage: u64 = read("memory.usage_in_bytes").trim().parse().unwrap();
    let inactive: u64 = read("memory.stat")
        .lines()
        .find_map(|l| l.strip_prefix("total_inactive_file "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    usage.saturating_sub(inactive)
}

fn bytes(q: &Quantity) -> u64 {
    let s = q.0.as_str();
    let (num, mult) = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)]
        .iter()
        .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n, *m)))
        .unwrap_or((s, 1));
    num.parse::<u64>().unwrap() * mult
}

/// (controller, pod, working set, limit) of every controller Pod.
async fn measure(bed: &Bed) -> Vec<(String, String, u64, u64)> {
    let mut out = Vec::new();
    for controller in CONTROLLERS {
        for pod in bed.pods_of(controller).await.unwrap() {
            let limit = pod.spec.as_ref().unwrap().containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get("memory"))
                .map(bytes)
                .expect("a memory limit");
            out.push((
                controller.to_owned(),
                pod.name_any(),
                working_set(&pod),
                limit,
            ));
        }
    }
    out
}

fn report(when: &str, figures: &[(String, String, u64, u64)]) {
    for (controller, pod, ws, limit) in figures {
        eprintln!(
            "memory {when}: {controller} {pod}: {:.1} MiB of {:.0} MiB ({:.0}%)",
            *ws as f64 / 1048576.0,
            *limit as f64 / 1048576.0,
            100.0 * *ws as f64 / *limit as f64
        );
        assert!(
            *ws * 10 < *limit * 8,
            "{controller} {pod} uses {ws} bytes of its {limit}-byte limit {when}"
        );
    }
}

#[tokio::test]
async fn controllers_memory_at_idle_and_with_1000_databases() {
    let bed = bed().await;
    let count: usize = std::env::var("DBOPS_DEPLOYED_DATABASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    for c in CONTROLLERS {
        bed.rolled_out(c, Duration::from_secs(180)).await.unwrap();
    }
    report("at idle", &measure(bed).await);

    let tenant = Tenant::create(bed, "memory").await.unwrap();
    let api: Api<Database> = bed.api(&tenant.name);
    let start = Instant::now();
    stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let name = tenant.db(&format!("m{i:04}"));
            async move {
                let spec = json!({"serverRef": {"name": MAIN}, "deletionPolicy": "Delete"});
                let db: Database = manifest(&name, spec).unwrap();
                api.create(&PostParams::default(), &db).await.map(|_| ())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .unwrap();
    wait_for(
        &format!("{count} Databases Ready"),
        Duration::from_secs(900),
        || async { Ok(api.list(&ListParams::default()).await?.items) },
        |ds: &Vec<Database>| {
            ds.len() == count
                && ds
                    .iter()
                    .all(|d| database_has(d, Want::new("Ready", "True", None)))
        },
    )
    .await
    .unwrap();
    eprintln!(
        "{count} Databases Ready in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    // Where the time went, from the leader's own metrics: a slow run (142.7 s against
    // 33.7-49.7 s in other CI runs) left nothing to tell throttling from a stall.
    match leader_metrics(bed).await {
        Ok(body) => eprintln!("database-controller leader, {}", spent(&body)),
        Err(e) => eprintln!("database-controller leader's metrics not read: {e:#}"),
    }
    report(&format!("with {count} Databases"), &measure(bed).await);
}

/// The `/metrics` of the Pod that leads the database-controller, by its Pod IP.
async fn leader_metrics(bed: &Bed) -> anyhow::Result<String> {
    use anyhow::Context;
    let leader = bed
        .leader("database-controller")
        .await?
        .context("no leader")?;
    let pod = bed
        .pods_of("database-controller")
        .await?
        .into_iter()
        .find(|p| p.name_any() == leader)
        .with_context(|| format!("the leader {leader} is not one of the Pods"))?;
    let ip = pod
        .status
        .and_then(|s| s.pod_ip)
        .with_context(|| format!("{leader} has no Pod IP"))?;
    let (status, body) = http_get(&ip, 8080, "/metrics")?;
    anyhow::ensure!(status == 200, "{leader}/metrics answered {status}");
    Ok(body)
}

/// API requests by verb, the API's refusals, and the time spent waiting for the rate
/// limit and for PostgreSQL session slots, from a controller's `/metrics`.
fn spent(body: &str) -> String {
    let total = dbops_e2e::controllers::series_sum;
    let requests = "dbops_kubernetes_requests_total";
    let verbs: Vec<String> = ["get", "list", "create", "patch", "update", "delete"]
        .iter()
        .map(|v| format!("{v} {}", total(body, requests, &[&format!("verb=\"{v}\"")])))
        .collect();
    let external = "dbops_external_requests_total";
    let kube = r#"target="kubernetes""#;
    let wait = "dbops_queue_wait_seconds_sum";
    format!(
        "API requests: {} ({}); refused {} (4xx), failed {} (5xx); waited {:.1} s for the rate limit, {:.1} s for session slots; reconcile errors {}",
        total(body, requests, &[]) - total(body, requests, &[r#"verb="watch""#]),
        verbs.join(", "),
        total(body, external, &[kube, r#"outcome="client_error""#]),
        total(body, external, &[kube, r#"outcome="server_error""#]),
        total(body, wait, &[r#"queue="api_rate_limit""#]),
        total(body, wait, &[r#"queue="postgres_session""#]),
        total(body, "dbops_reconcile_errors_total", &[]),
    )
}

#[test]
fn spent_reads_the_families_it_names() {
    let body = "# TYPE dbops_kubernetes_requests counter\n\
        dbops_kubernetes_requests_total{verb=\"get\",resource=\"secrets\"} 3\n\
        dbops_kubernetes_requests_total{verb=\"watch\",resource=\"databases\"} 1\n\
        dbops_kubernetes_requests_total{verb=\"patch\",resource=\"databases/status\"} 2\n\
        dbops_external_requests_total{target=\"kubernetes\",outcome=\"client_error\"} 4\n\
        dbops_queue_wait_seconds_sum{queue=\"api_rate_limit\"} 1.5\n\
        dbops_reconcile_errors_total{controller=\"database-controller\",reason=\"X\"} 2\n";
    let line = spent(body);
    assert!(
        line.starts_with("API requests: 5 (get 3, list 0, create 0, patch 2"),
        "{line}"
    );
    assert!(line.contains("refused 4 (4xx)"), "{line}");
    assert!(line.contains("waited 1.5 s for the rate limit"), "{line}");
    assert!(line.ends_with("reconcile errors 2"), "{line}");
}
