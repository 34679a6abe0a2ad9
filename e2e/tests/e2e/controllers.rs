//! The three controller binaries start against the real apiserver, serve health and
//! metrics, and stop cleanly on SIGTERM.

use std::time::{Duration, Instant};

use dbops_e2e::ControllerProcess;

use crate::{bed, control_plane};

const CONTROLLERS: [&str; 3] = [
    "database-controller",
    "backup-controller",
    "migration-controller",
];

/// Polls `check` every 100 ms until it holds or `timeout` passes.
fn eventually(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    check()
}

#[tokio::test]
async fn each_controller_serves_health_and_metrics_and_stops_on_sigterm() {
    let b = bed("health").await;
    let cp = b.cp;
    // One object of each kind, so every controller has something to reconcile.
    let examples = dbops_e2e::paths::repo_root().join("deploy/examples");
    let out = b
        .kubectl
        .run(
            &[
                "apply",
                "-n",
                b.ns.name(),
                "-f",
                &examples.display().to_string(),
            ],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.text());
    let logs = tempfile::tempdir().unwrap();
    // Only this test's namespace: the other tests' objects belong to their own controllers.
    let scope = [format!("--watch-namespace={}", b.ns.name())];
    let identities = crate::controller_identities(cp).await;
    for name in CONTROLLERS {
        let mut c = ControllerProcess::start(name, &identities[name], logs.path(), &scope).unwrap();

        assert_eq!(c.get("/healthz").unwrap().0, 200);
        assert!(
            eventually(Duration::from_secs(30), || c
                .get("/readyz")
                .is_ok_and(|(code, _)| code == 200)),
            "{name} never became ready: {:?}\n{}",
            c.get("/readyz"),
            c.process.log_tail(3000)
        );
        assert!(
            eventually(Duration::from_secs(30), || c.get("/metrics").is_ok_and(
                |(code, body)| code == 200 && body.contains("dbops_reconcile")
            )),
            "{name} metrics never showed a reconcile: {:?}",
            c.get("/metrics")
        );

        assert_one_watch_per_kind(name, &c);

        let status = c
            .process
            .signal_and_wait("TERM", Duration::from_secs(15))
            .unwrap();
        assert!(
            status.success(),
            "{name} exited with {status} on SIGTERM:\n{}",
            c.process.log_tail(3000)
        );
    }
}

/// The kinds a process's controllers share are watched once (issue 41): the database-
/// controller's three controllers once each of Databases, DatabaseUsers, Migrations,
/// DatabaseServers and namespaces (it was 4, 2, 3, 3 and 2 watches), the backup-
/// controller's two once each of Databases and DatabaseServers (it was 2 and 2), the
/// migration-controller once of DatabaseServers (it was 2): the DatabaseServer directory's
/// watches, which run from the process's start, are the controllers' too. Counted by the
/// process's own `dbops_kubernetes_requests_total{verb="watch"}` once every watch the
/// process opens at start has begun.
fn assert_one_watch_per_kind(name: &str, c: &ControllerProcess) {
    let shared: &[&str] = match name {
        "database-controller" => &[
            "databases",
            "databaseusers",
            "migrations",
            "databaseservers",
            "namespaces",
        ],
        "backup-controller" => &["databases", "databaseservers"],
        _ => &["databaseservers"],
    };
    let watches = |resource: &str| {
        c.metric_sum(
            "dbops_kubernetes_requests_total",
            &[r#"verb="watch""#, &format!(r#"resource="{resource}""#)],
        )
    };
    assert!(
        eventually(Duration::from_secs(30), || shared
            .iter()
            .all(|r| watches(r) >= 1.0)),
        "{name} never watched all of {shared:?}"
    );
    for resource in shared {
        assert_eq!(watches(resource), 1.0, "{name}'s watches of {resource}");
    }
}

#[tokio::test]
async fn a_controller_refuses_to_start_without_a_kubeconfig_that_works() {
    let cp = control_plane().await;
    let logs = tempfile::tempdir().unwrap();
    let missing = logs.path().join("no-such-kubeconfig");
    let err = ControllerProcess::start("database-controller", &missing, logs.path(), &[])
        .expect_err("a controller without credentials must not report healthy");
    let text = format!("{err:#}");
    assert!(text.contains("exited"), "{text}");
    // The control plane is untouched by the failed start.
    assert!(cp.client().await.is_ok());
}

#[tokio::test]
async fn bad_flags_are_refused_with_a_message() {
    assert_refused(
        "backup-controller",
        &["--backup-store", "ftp://example/backups"],
        "backup-store",
    );
    assert_refused(
        "database-controller",
        &["--concurrency", "0"],
        "concurrency",
    );
}

/// `dbops-<controller>` started with `args` exits unsuccessfully, its stderr naming
/// `flag`.
fn assert_refused(controller: &str, args: &[&str], flag: &str) {
    let binary = dbops_e2e::paths::workspace_bin(&format!("dbops-{controller}")).unwrap();
    let out = std::process::Command::new(binary)
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(flag), "{stderr}");
}

/// After a kube-apiserver restart the database-controller works again within a bound
/// and the same process goes on: a Database created after the restart is reconciled
/// (were the process to exit, this test would start it again, as its Deployment would,
/// and fail). And a watch that fails without a break ends the process within
/// `--watch-stall-timeout`, naming the watch. Issue 12: after a 4 s outage the apiserver
/// refuses watches (429, "storage is (re)initializing") while the storage of each custom
/// resource starts. Issue 35: one backoff around all of a controller's watches (kube's
/// default) let each watch's error pause the others, so the controller's own watch went
/// minutes without a request, and the stall check, fed by the watch streams, ended the
/// process; now each watch backs off on its own and every answered list or watch start
/// counts as working.
///
/// A control plane of its own, since its kube-apiserver is stopped.
#[tokio::test]
async fn after_an_apiserver_restart_work_resumes_and_a_stalled_watch_ends_the_process() {
    use dbops_api::Database;
    use dbops_e2e::wait::{Want, database_has};
    use kube::api::{Api, PostParams};

    const STALL: Duration = Duration::from_secs(30);
    dbops_e2e::init_test_logging();
    let dir = tempfile::Builder::new()
        .prefix("dbops-watch-stall-")
        .tempdir()
        .unwrap();
    let mut cp = dbops_e2e::ControlPlane::start(dbops_e2e::controlplane::Options {
        dir: dir.path().to_path_buf(),
        apiserver_port: None,
    })
    .await
    .unwrap();
    let logs = dir.path().join("controller-logs");
    std::fs::create_dir_all(&logs).unwrap();
    let args: Vec<String> = vec![
        "--watch-namespace=default".into(),
        "--controller-namespace=default".into(),
        "--server-selector=dbops.dev/test=none".into(),
        "--resync-interval=3s".into(),
        format!("--watch-stall-timeout={}s", STALL.as_secs()),
    ];
    let kubeconfig = cp.kubeconfig().to_path_buf();
    let start = || ControllerProcess::start("database-controller", &kubeconfig, &logs, &args);
    let mut controller = start().unwrap();
    let log = |c: &ControllerProcess| c.process.log_tail(6000);

    // A Database on a server that does not exist: the controller says so (ServerNotFound),
    // which shows that it reconciles. The controller is started again whenever it exited
    // (a Deployment's restart), counting the exits.
    let client = cp.client().await.unwrap();
    let databases: Api<Database> = Api::namespaced(client, "default");
    let mut exits = Vec::new();
    let mut reconciled = async |name: &str, controller: &mut ControllerProcess| {
        let db: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": {"name": name},
            "spec": {"serverRef": {"name": "nowhere"}},
        }))
        .unwrap();
        let deadline = Instant::now() + 3 * STALL + Duration::from_secs(60);
        let mut created = false;
        loop {
            if !created {
                created = databases.create(&PostParams::default(), &db).await.is_ok();
            }
            let want = Want::not_ready("ServerNotFound");
            if let Ok(found) = databases.get(name).await
                && database_has(&found, want)
            {
                return;
            }
            if let Some(status) = controller.process.try_exit().unwrap() {
                exits.push(format!("{status}: {}", log(controller)));
                *controller = start().unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "Database {name} not reconciled in time; exits: {exits:#?}\n{}",
                log(controller)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    reconciled("before", &mut controller).await;
    let restarted = Instant::now();
    cp.restart_apiserver("KILL", Duration::from_secs(4))
        .await
        .unwrap();
    reconciled("after", &mut controller).await;
    eprintln!(
        "after the apiserver restart: reconciled in {:?}, {} exit(s) of the controller",
        restarted.elapsed(),
        exits.len()
    );
    // Issue 35: every watch lists and watches again after the restart (each with its
    // own backoff) and says so, so no streak of failures outlasts the restart: the
    // process lives on.
    assert!(
        exits.is_empty(),
        "an apiserver restart ended the controller: {exits:#?}"
    );

    // The apiserver gone for good: every watch fails again and again.
    cp.stop_apiserver("KILL").unwrap();
    let stopped = Instant::now();
    let status = controller
        .process
        .wait_exit(3 * STALL)
        .unwrap_or_else(|e| panic!("{e:#}\n{}", log(&controller)));
    assert_eq!(status.code(), Some(1), "{}", log(&controller));
    assert!(
        log(&controller).contains("has failed without a break for"),
        "the exit names the stalled watch:\n{}",
        log(&controller)
    );
    eprintln!(
        "the process ended {:?} after the apiserver stopped",
        stopped.elapsed()
    );
}
