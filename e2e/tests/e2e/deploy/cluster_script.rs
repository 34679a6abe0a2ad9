//! `e2e/cluster up` refuses to start a node on a nearly full disk: a run that started on
//! one ended with the kubelet evicting the images it needed. The floor is
//! `DBOPS_CLUSTER_MIN_FREE_GIB`. The previous run's state directory, which `up` removes
//! before it starts, counts as free: a CI run was refused its second node because the first
//! node's 2.2 GiB were counted as taken.

use dbops_e2e::paths;
use std::path::Path;
use std::process::{Command, Output};

fn cluster(command: &str, state: &Path, floor_gib: u64) -> Output {
    Command::new(paths::repo_root().join("e2e/cluster"))
        .arg(command)
        .env("DBOPS_CLUSTER_MIN_FREE_GIB", floor_gib.to_string())
        .env("DBOPS_CLUSTER_DIR", state)
        .output()
        .unwrap()
}

/// Free space, in KiB, on the filesystem of `dir`, as `df` reports it.
fn free_kib(dir: &Path) -> u64 {
    let out = Command::new("df").arg("-Pk").arg(dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().nth(1).unwrap_or_default();
    line.split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("df -Pk {}: {text}", dir.display()))
}

#[test]
fn cluster_up_refuses_to_start_without_room_and_says_why() {
    let scratch = tempfile::tempdir().unwrap();
    let state = scratch.path().join("no-cluster");
    let out = cluster("up", &state, 1_000_000);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("e2e/cluster up needs 1000000 GiB (DBOPS_CLUSTER_MIN_FREE_GIB)"),
        "{stderr}"
    );
    assert!(!state.exists(), "nothing is made before the refusal");
}

#[test]
fn the_previous_runs_state_counts_as_free() {
    const GIB: u64 = 1024 * 1024;
    // A state directory holding 2 GiB of allocated blocks, as a previous node leaves.
    let scratch = tempfile::tempdir_in(paths::repo_root().join("target")).unwrap();
    let state = scratch.path().join("cluster");
    std::fs::create_dir_all(&state).unwrap();
    let status = Command::new("fallocate")
        .args(["-l", "2GiB"])
        .arg(state.join("old-node"))
        .status()
        .unwrap();
    assert!(status.success(), "fallocate");
    // A floor 1 GiB above what is free now: met only when the old state counts.
    let floor = free_kib(&state) / GIB + 1;
    let out = cluster("room", &state, floor);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "floor {floor} GiB with 2 GiB of old state: {stderr}"
    );
    // Without the old state, a floor 1 GiB above what is free is refused.
    std::fs::remove_file(state.join("old-node")).unwrap();
    let out = cluster("room", &state, free_kib(&state) / GIB + 1);
    assert!(
        !out.status.success(),
        "a floor above what is free is refused"
    );
}
