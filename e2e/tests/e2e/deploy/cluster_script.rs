//! `e2e/cluster up` refuses to start a node on a nearly full disk: a run that started on
//! one ended with the kubelet evicting the images it needed. The floor is
//! `DBOPS_CLUSTER_MIN_FREE_GIB`; here it is set above any disk, so the refusal must come
//! before anything is made or started.

use dbops_e2e::paths;

#[test]
fn cluster_up_refuses_to_start_without_room_and_says_why() {
    let scratch = tempfile::tempdir().unwrap();
    let state = scratch.path().join("no-cluster");
    let out = std::process::Command::new(paths::repo_root().join("e2e/cluster"))
        .arg("up")
        .env("DBOPS_CLUSTER_MIN_FREE_GIB", "1000000")
        .env("DBOPS_CLUSTER_DIR", &state)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("e2e/cluster up needs 1000000 GiB (DBOPS_CLUSTER_MIN_FREE_GIB)"),
        "{stderr}"
    );
    assert!(!state.exists(), "nothing is made before the refusal");
}
