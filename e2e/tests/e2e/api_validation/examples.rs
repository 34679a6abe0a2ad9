//! The examples of `deploy/examples` apply and print their columns.

use dbops_e2e::harness::api_validation::{SERVER_COLUMNS, assert_columns, jsonpath};

use crate::bed;

#[tokio::test]
async fn examples_apply_and_print_their_columns() {
    let b = bed("examples").await;
    let dir = dbops_e2e::paths::repo_root().join("deploy/examples");
    let out = b
        .kubectl
        .run(
            &["apply", "-n", b.ns.name(), "-f", &dir.display().to_string()],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.text());
    for created in [
        "database.dbops.dev/orders",
        "database.dbops.dev/orders-pr-42",
        "databaseuser.dbops.dev/orders-dashboard",
        "backup.dbops.dev/orders-manual-1",
        "migration.dbops.dev/orders-to-target",
    ] {
        assert!(
            out.stdout.contains(created),
            "{created} missing from:\n{}",
            out.stdout
        );
    }
    // An example DatabaseServer is cluster-scoped: not this namespace's, and left by its
    // deletion. Its columns are checked and it is deleted here.
    let servers: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("databaseserver.dbops.dev/"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for server in &servers {
        assert_columns(&b, &["dbserver", server], &SERVER_COLUMNS);
        let deleted = b
            .kubectl
            .run(&["delete", "dbserver", server, "--wait=false"], None)
            .unwrap();
        assert!(deleted.success, "{}", deleted.text());
    }
    assert_columns(
        &b,
        &["pgdb", "-n", b.ns.name()],
        &["NAME", "PHASE", "READY", "SERVER", "DATABASE", "AGE"],
    );
    assert_columns(
        &b,
        &["dbuser", "-n", b.ns.name()],
        &["NAME", "DATABASE", "ACCESS", "ROLE", "READY", "ROTATED"],
    );
    assert_columns(
        &b,
        &["pgmig", "-n", b.ns.name()],
        &["DATABASE", "TARGET", "PHASE", "MODE", "STEP"],
    );
    // Defaults land in the stored object.
    assert_eq!(
        jsonpath(&b, "backup", "orders-manual-1", "{.spec.maxRetries}"),
        "3"
    );
}
