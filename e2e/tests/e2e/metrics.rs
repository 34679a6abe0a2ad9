//! The controllers' `/metrics` after a real scenario (a Database Ready, a Backup of it
//! Completed): the values moved, read as Prometheus text from the running processes.
//! And the Grafana dashboard (deploy/components/grafana-dashboard): every query of it
//! finds series among those the three controllers export after a scenario that moves
//! every family the dashboard reads (`promtool test rules` on the scraped series).

use std::collections::{BTreeMap, BTreeSet};

use dbops_api::{Backup, BackupPhase, MigrationPhase};
use dbops_e2e::ControllerProcess;
use dbops_e2e::fixtures::{
    create_backup, create_database, create_server, server_name, server_spec,
};
use dbops_e2e::harness::migration::{READY, SOURCE_ADMIN, Setup};
use dbops_e2e::harness::observability::World;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

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

/// Where the dashboard and its component live.
const DASHBOARD_DIR: &str = "deploy/components/grafana-dashboard";

/// The dashboard, parsed.
fn dashboard() -> Value {
    let path = dbops_e2e::paths::repo_root()
        .join(DASHBOARD_DIR)
        .join("dbops.json");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every panel, those nested in collapsed rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        all.extend(panel["panels"].as_array().into_iter().flatten());
    }
    all
}

/// One PromQL query of the dashboard: where it is (panel title and refId, or variable)
/// and its text as written, with Grafana's variables.
#[derive(Debug)]
struct Query {
    place: String,
    expr: String,
}

/// The queries of every panel target, and of every `label_values(<selector>, <label>)`
/// variable as `count by (<label>) (<selector>)`.
fn queries(dashboard: &Value) -> Vec<Query> {
    let mut all = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            all.push(Query {
                place: format!(
                    "panel {} {:?}, target {}",
                    panel["id"],
                    panel["title"].as_str().unwrap_or_default(),
                    target["refId"].as_str().unwrap_or_default()
                ),
                expr: target["expr"].as_str().unwrap_or_default().to_string(),
            });
        }
    }
    let variables = dashboard["templating"]["list"].as_array();
    for variable in variables.into_iter().flatten() {
        if variable["type"] != "query" {
            continue;
        }
        let definition = variable["definition"].as_str().unwrap_or_default();
        let (selector, label) = definition
            .strip_prefix("label_values(")
            .and_then(|d| d.strip_suffix(')'))
            .and_then(|d| d.rsplit_once(','))
            .unwrap_or_else(|| panic!("variable {}: {definition:?}", variable["name"]));
        all.push(Query {
            place: format!("variable {}", variable["name"]),
            expr: format!("count by ({}) ({selector})", label.trim()),
        });
    }
    all
}

/// `expr` with Grafana's variables as the test evaluates it: every rate window 5m,
/// every job (`job=~"$job"` matches all).
fn substituted(expr: &str) -> String {
    let expr = expr
        .replace("$__rate_interval", "5m")
        .replace("${job}", ".*")
        .replace("$job", ".*");
    assert!(
        !expr.contains('$'),
        "a variable the test does not know in {expr}"
    );
    expr
}

/// The dashboard is JSON Grafana imports (schemaVersion, the `datasource` and `job`
/// variables), each panel has a title, a unique id and (rows aside) at least one
/// query on the chosen data source filtered by `$job`; the component makes it the
/// ConfigMap Grafana's sidecar loads, holding the same JSON.
#[test]
fn the_grafana_dashboard_is_well_formed_and_ships_as_a_component() {
    let d = dashboard();
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36, "schemaVersion");
    assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let variables = d["templating"]["list"].as_array().unwrap();
    let variable = |name: &str| {
        variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no variable {name}"))
    };
    assert_eq!(variable("datasource")["type"], "datasource");
    assert_eq!(variable("datasource")["query"], "prometheus");
    assert_eq!(variable("job")["allValue"], ".*");

    let mut ids = BTreeSet::new();
    for panel in panels(&d) {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(!title.trim().is_empty(), "a panel without a title: {panel}");
        let id = panel["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("{title}: no id"));
        assert!(ids.insert(id), "panel id {id} twice ({title})");
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(expr.contains(r#"job=~"$job""#), "{title}: {expr}");
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
        }
    }
    assert!(queries(&d).len() >= 30, "{:#?}", queries(&d));

    let deploy = dbops_e2e::paths::repo_root().join("deploy");
    let overlay = dbops_e2e::chart::overlay(&deploy, &["grafana-dashboard"]).unwrap();
    let text = dbops_e2e::chart::kustomize_text(overlay.path()).unwrap();
    let docs = dbops_e2e::chart::parse_documents(&text).unwrap();
    let map = docs
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "dbops-grafana-dashboard")
        .expect("the dashboard's ConfigMap");
    assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(map["metadata"]["namespace"], "dbops-system");
    let shipped: Value =
        serde_json::from_str(map["data"]["dbops.json"].as_str().expect("data dbops.json")).unwrap();
    assert_eq!(shipped, d);
}

/// `/metrics` of a controller, as served.
fn exposition(controller: &ControllerProcess) -> String {
    let (code, body) = controller.get("/metrics").unwrap();
    assert_eq!(code, 200, "{body}");
    body
}

/// Scrapes `controller` until its text holds every one of `wanted` (series prefixes).
async fn exposition_with(controller: &ControllerProcess, name: &str, wanted: &[&str]) -> String {
    dbops_e2e::wait::eventually(
        &format!("the {name} exports {wanted:?}"),
        dbops_e2e::harness::observability::SLOW,
        || async { Ok(exposition(controller)) },
        |body| {
            wanted
                .iter()
                .all(|w| body.lines().any(|l| l.starts_with(w)))
        },
    )
    .await
}

/// The samples of `body` as promtool `input_series`, labelled `job` and `instance` as a
/// Prometheus scrape labels them, over 20 one-minute steps: counters and histograms
/// (by their `# TYPE`) growing by 1 a step, so that their rates are not 0; gauges at
/// the value scraped.
fn input_series(body: &str, job: &str, instance: &str) -> Vec<Value> {
    let cumulative: BTreeSet<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (family, kind) = l.split_once(' ')?;
            matches!(kind.trim(), "counter" | "histogram").then_some(family)
        })
        .collect();
    let scrape_labels = format!(r#"job="{job}",instance="{instance}""#);
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            let name = series.split('{').next().unwrap();
            let is_cumulative = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|suffix| name.strip_suffix(suffix))
                .any(|family| cumulative.contains(family));
            let series = match series.strip_suffix('}') {
                Some(open) => format!("{open},{scrape_labels}}}"),
                None => format!("{series}{{{scrape_labels}}}"),
            };
            let values = if is_cumulative {
                "0+1x20".to_string()
            } else {
                let value: f64 = value.parse().unwrap();
                format!("{value}+0x20")
            };
            json!({"series": series, "values": values})
        })
        .collect()
}

/// Every query of the dashboard returns series when Prometheus holds what the three
/// controllers export after a scenario that moves each family the dashboard reads: a
/// Database Ready and moved to a second server (its snapshot a completed Backup), a
/// scheduled Database whose schedule verifies and a verified Backup of it (no
/// verification server here: the verification ends in Error), a Migration rolled back
/// at Preflight (its name taken on the target), and a Database on a server nobody
/// listens on (failed reconciles). The scraped series become promtool `input_series`; each query, its
/// variables substituted, is a `promql_expr_test` of `clamp_max(count(<query>), 1)`
/// expecting 1: a query naming a metric or a label value the controllers do not export
/// finds nothing and fails.
#[tokio::test]
async fn dashboard_queries_find_the_series_the_controllers_export() {
    let mut s = Setup::new("mx-dash").await;
    s.start_migration_controller(&[]);
    let ns = s.ns().to_string();
    let client = s.b.client.clone();

    s.create_database("app").await;
    s.create_database_spec(
        "sched",
        json!({"backup": {"schedule": "0 3 * * *", "verify": true}}),
    )
    .await;
    s.create_database("clash").await;
    s.target
        .connect_as_superuser()
        .await
        .unwrap()
        .batch_execute("CREATE DATABASE clash")
        .await
        .unwrap();
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut spec = server_spec(&s.source, SOURCE_ADMIN);
    spec["port"] = json!(closed);
    create_server(&client, &ns, &server_name(&ns, "nowhere"), spec)
        .await
        .unwrap();
    create_database(&client, &ns, "lost", "nowhere", json!({}))
        .await
        .unwrap();

    // Of the scheduled Database: the last success of a Database without a schedule is
    // not kept.
    create_backup(&client, &ns, "sched-1", "sched", json!({"verify": true}))
        .await
        .unwrap();
    let backups: Api<Backup> = Api::namespaced(client.clone(), &ns);
    dbops_e2e::wait::eventually(
        "Backup sched-1 Completed",
        READY,
        || async { Ok(backups.get("sched-1").await?.status) },
        |st| {
            st.as_ref()
                .is_some_and(|st| st.phase == Some(BackupPhase::Completed))
        },
    )
    .await;
    s.migrate("app-move", "app", json!({}), MigrationPhase::Succeeded)
        .await;
    s.create_migration("clash-move", "clash", json!({})).await;
    s.wait_phase("clash-move", MigrationPhase::RolledBack, READY)
        .await;

    let started = std::time::Instant::now();
    let scraped = [
        (
            "database-controller",
            s.database_controller.as_ref().unwrap(),
            &[
                "dbops_reconcile_errors_total{",
                "dbops_database_size_bytes{",
                "dbops_resources{controller=\"database-controller\",kind=\"Database\",condition=\"Ready\",status=\"False\"}",
            ][..],
        ),
        (
            "backup-controller",
            s.backup_controller.as_ref().unwrap(),
            &[
                "dbops_backup_verifications_total{",
                "dbops_backup_schedule_interval_seconds{",
                "dbops_backup_last_verified_timestamp_seconds{",
                "dbops_backup_last_success_timestamp_seconds{",
            ][..],
        ),
        (
            "migration-controller",
            s.migration_controller.as_ref().unwrap(),
            &[
                "dbops_migration_rollbacks_total{",
                "dbops_migration_step_duration_seconds_count{step=\"SwitchTraffic\"}",
                "dbops_resources{controller=\"migration-controller\",kind=\"Migration\"",
            ][..],
        ),
    ];
    let mut series = Vec::new();
    for (name, controller, wanted) in scraped {
        let body = exposition_with(controller, name, wanted).await;
        let job = format!("dbops-{name}-metrics");
        let instance = format!("127.0.0.1:{}", controller.metrics_port);
        series.extend(input_series(&body, &job, &instance));
    }

    let d = dashboard();
    let queries = queries(&d);
    let tests: Vec<Value> = queries
        .iter()
        .map(|q| {
            json!({
                "expr": format!("clamp_max(count({}), 1)", substituted(&q.expr)),
                "eval_time": "10m",
                "exp_samples": [{"labels": "{}", "value": 1}],
            })
        })
        .collect();
    let file = json!({
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
    });
    let dir = tempfile::Builder::new()
        .prefix("dbops-dashboard-")
        .tempdir()
        .unwrap();
    std::fs::write(
        dir.path().join("dashboard.test.yaml"),
        serde_norway::to_string(&file).unwrap(),
    )
    .unwrap();
    let out = std::process::Command::new(dbops_e2e::paths::promtool().unwrap())
        .args(["test", "rules", "dashboard.test.yaml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // promtool quotes each failing expression as Go's %q does (the same as {:?} here).
    let failing: Vec<String> = queries
        .iter()
        .filter(|q| {
            let expr = format!("clamp_max(count({}), 1)", substituted(&q.expr));
            report.contains(&format!("{expr:?}"))
        })
        .map(|q| format!("{}: {}", q.place, q.expr))
        .collect();
    assert!(
        out.status.success() && failing.is_empty(),
        "dashboard queries without series among the controllers' exports:\n{}\n\npromtool test rules:\n{report}",
        failing.join("\n")
    );
    tracing::info!(
        queries = queries.len(),
        series = file["tests"][0]["input_series"].as_array().map_or(0, Vec::len),
        took = ?started.elapsed(),
        "every dashboard query finds series"
    );
}
