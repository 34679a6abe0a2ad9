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

        c.process.signal("TERM").unwrap();
        let status = c.process.wait_exit(Duration::from_secs(15)).unwrap();
        assert!(
            status.success(),
            "{name} exited with {status} on SIGTERM:\n{}",
            c.process.log_tail(3000)
        );
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
    let binary = dbops_e2e::paths::workspace_bin("dbops-backup-controller").unwrap();
    let out = std::process::Command::new(binary)
        .args(["--backup-store", "ftp://example/backups"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("backup-store"), "{stderr}");

    let binary = dbops_e2e::paths::workspace_bin("dbops-database-controller").unwrap();
    let out = std::process::Command::new(binary)
        .args(["--concurrency", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("concurrency"), "{stderr}");
}
