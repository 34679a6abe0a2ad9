//! The controllers' `/metrics` after a real scenario (a Database Ready, a Backup of it
//! Completed): the values moved, read as Prometheus text from the running processes.

use std::collections::BTreeMap;

use dbops_e2e::ControllerProcess;
use dbops_e2e::harness::observability::World;
use kube::api::PostParams;
use serde_json::json;

/// `/metrics` of a controller as `series -> value` (`name{labels}` as printed).
fn scrape(controller: &ControllerProcess) -> BTreeMap<String, f64> {
    let (code, body) = controller.get("/metrics").unwrap();
    assert_eq!(code, 200, "{body}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The value of `series`, 0 when absent.
fn value(metrics: &BTreeMap<String, f64>, series: &str) -> f64 {
    metrics.get(series).copied().unwrap_or(0.0)
}

/// Scrapes controller `name` until its resource gauge counts one Ready `kind` (its store
/// sees the Ready status); what it then serves.
async fn scrape_until_one_ready(
    controller: &ControllerProcess,
    name: &str,
    kind: &str,
) -> BTreeMap<String, f64> {
    let gauge = format!(
        r#"dbops_resources{{controller="{name}",kind="{kind}",condition="Ready",status="True"}}"#
    );
    dbops_e2e::wait::eventually(
        &format!("the {name} counts one Ready {kind}"),
        dbops_e2e::harness::observability::SLOW,
        || async { Ok(scrape(controller)) },
        |m| value(m, &gauge) == 1.0,
    )
    .await
}

/// Controller `name` counted a successful reconcile.
fn assert_reconciled(metrics: &BTreeMap<String, f64>, name: &str) {
    let series = format!(r#"dbops_reconciles_total{{controller="{name}",outcome="success"}}"#);
    assert!(value(metrics, &series) > 0.0, "{metrics:#?}");
}

/// The requests to `target` (`postgres`, `kubernetes`, `store`) that went well.
fn ok_requests(metrics: &BTreeMap<String, f64>, target: &str) -> f64 {
    let series = format!(r#"dbops_external_requests_total{{target="{target}",outcome="ok"}}"#);
    value(metrics, &series)
}

#[tokio::test]
async fn metrics_move_with_a_database_and_a_backup() {
    let w = World::new("mx", false).await;
    w.create_ready_database("orders", "Delete").await;
    let backup: dbops_api::Backup = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": "orders-1"},
        "spec": {"databaseRef": {"name": "orders"}},
    }))
    .unwrap();
    w.backups()
        .create(&PostParams::default(), &backup)
        .await
        .unwrap();
    w.wait_completed("orders-1").await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();

    // The database-controller: reconciles, their duration, SQL and API requests, and
    // the Ready Database in the resource gauge (its store sees the Ready status).
    let m = scrape_until_one_ready(&w.database_controller, "database-controller", "Database").await;
    assert_reconciled(&m, "database-controller");
    assert!(
        value(
            &m,
            r#"dbops_reconcile_duration_seconds_count{controller="database-controller"}"#
        ) > 0.0
    );
    assert!(ok_requests(&m, "postgres") > 0.0);
    assert!(ok_requests(&m, "kubernetes") > 0.0);
    assert!(
        !m.keys().any(|k| k.starts_with("dbops_backup_bytes_total")),
        "backup metrics belong to the backup-controller"
    );

    // The backup-controller: the completed dump's bytes, duration and time.
    let bk = scrape_until_one_ready(&w.backup_controller, "backup-controller", "Backup").await;
    assert_reconciled(&bk, "backup-controller");
    assert!(value(&bk, "dbops_backup_bytes_total") > 0.0, "{bk:#?}");
    assert_eq!(value(&bk, "dbops_backup_duration_seconds_count"), 1.0);
    let last = value(
        &bk,
        &format!(
            r#"dbops_backup_last_success_timestamp_seconds{{namespace="{}",database="orders"}}"#,
            w.ns()
        ),
    );
    assert!(
        (now - 300.0..=now + 5.0).contains(&last),
        "last success {last}, now {now}"
    );
    assert!(ok_requests(&bk, "postgres") > 0.0);
    // create_artifact, commit, put_manifest of the dump.
    assert!(ok_requests(&bk, "store") >= 3.0, "{bk:#?}");
    assert!(ok_requests(&bk, "kubernetes") > 0.0);
}
