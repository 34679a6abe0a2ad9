//! Bad input is refused by the real API server, with a message naming the field.

use crate::{Bed, bed};

fn database(name: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: Database
metadata:
  name: {name}
spec:
  server:
    host: 127.0.0.1
    adminSecretRef: {{name: pg-admin}}
{extra_spec}
"#
    )
}

/// Applies `yaml`, expects a refusal, and returns kubectl's message.
fn refused(b: &Bed, yaml: &str) -> String {
    let out = b.kubectl.apply(b.ns.name(), yaml).unwrap();
    assert!(
        !out.success,
        "the API server accepted:\n{yaml}\n{}",
        out.text()
    );
    out.text()
}

fn accepted(b: &Bed, yaml: &str) {
    let out = b.kubectl.apply(b.ns.name(), yaml).unwrap();
    assert!(
        out.success,
        "the API server refused:\n{yaml}\n{}",
        out.text()
    );
}

fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "expected {needle:?} in:\n{message}"
        );
    }
}

#[tokio::test]
async fn database_name_must_be_an_identifier() {
    let b = bed("dbname").await;
    let msg = refused(
        &b,
        &database("orders", "  databaseName: 'orders; drop table x'"),
    );
    assert_mentions(&msg, &["spec.databaseName", "PostgreSQL identifier"]);

    let msg = refused(&b, &database("orders", "  owner: Orders"));
    assert_mentions(&msg, &["spec.owner", "PostgreSQL identifier"]);

    let msg = refused(&b, &database("orders", "  owner: pg_owner"));
    assert_mentions(&msg, &["spec.owner", "pg_"]);

    let msg = refused(&b, &database("orders", "  extensions: [pgcrypto, 'x;y']"));
    assert_mentions(&msg, &["spec.extensions", "extension name"]);

    // metadata.name stands in for databaseName only when it can be one.
    let msg = refused(&b, &database("9orders", ""));
    assert_mentions(
        &msg,
        &["spec.databaseName", "is required when metadata.name"],
    );
    accepted(&b, &database("9orders", "  databaseName: orders9"));
    accepted(&b, &database("orders-eu", ""));
}

#[tokio::test]
async fn enums_ports_and_cron_are_checked() {
    let b = bed("enums").await;
    let msg = refused(
        &b,
        &database("orders", "  deletionPolicy: Sometimes")
            .replace("adminSecretRef", "sslMode: maybe\n    adminSecretRef"),
    );
    assert_mentions(
        &msg,
        &[
            "spec.server.sslMode",
            "Unsupported value",
            "spec.deletionPolicy",
        ],
    );

    let msg = refused(
        &b,
        &database("orders", "").replace("host: 127.0.0.1", "host: 127.0.0.1\n    port: 70000"),
    );
    assert_mentions(&msg, &["spec.server.port"]);

    let msg = refused(
        &b,
        &database("orders", "  backup: {schedule: 'every night'}"),
    );
    assert_mentions(&msg, &["spec.backup.schedule", "cron"]);
    accepted(
        &b,
        &database(
            "orders",
            "  backup: {schedule: '*/15 3 * * 1-5', retention: {keepLast: 3}}",
        ),
    );
    accepted(&b, &database("daily", "  backup: {schedule: '@daily'}"));

    let msg = refused(
        &b,
        &database("orders2", "").replace("{name: pg-admin}", "{name: pg-admin, namespace: other}"),
    );
    assert_mentions(
        &msg,
        &["unknown field", "spec.server.adminSecretRef.namespace"],
    );
}

#[tokio::test]
async fn immutable_database_fields_cannot_change() {
    let b = bed("immutable").await;
    accepted(
        &b,
        &database("orders", "  databaseName: orders\n  owner: orders_owner"),
    );

    let msg = refused(
        &b,
        &database("orders", "  databaseName: orders2\n  owner: orders_owner"),
    );
    assert_mentions(&msg, &["spec.databaseName", "immutable"]);

    let msg = refused(&b, &database("orders", "  owner: orders_owner"));
    assert_mentions(&msg, &["spec.databaseName", "immutable"]);

    let msg = refused(
        &b,
        &database("orders", "  databaseName: orders\n  owner: someone_else"),
    );
    assert_mentions(&msg, &["spec.owner", "immutable"]);

    let msg = refused(
        &b,
        &database(
            "orders",
            "  databaseName: orders\n  owner: orders_owner\n  restoreFrom: {backupRef: {name: nightly}}",
        ),
    );
    assert_mentions(
        &msg,
        &[
            "spec.restoreFrom",
            "only be set when the Database is created",
        ],
    );

    // Mutable fields still change.
    accepted(
        &b,
        &database(
            "orders",
            "  databaseName: orders\n  owner: orders_owner\n  connectionLimit: 10",
        ),
    );

    // restoreFrom at creation is fine, and may be dropped afterwards.
    accepted(
        &b,
        &database("restored", "  restoreFrom: {backupRef: {name: nightly}}"),
    );
    accepted(&b, &database("restored", ""));
}

#[tokio::test]
async fn backup_needs_a_database_ref_that_never_changes() {
    let b = bed("backupref").await;
    let msg = refused(
        &b,
        "apiVersion: dbops.dev/v1alpha1\nkind: Backup\nmetadata: {name: b1}\nspec: {maxRetries: 2}\n",
    );
    assert_mentions(&msg, &["spec.databaseRef", "Required value"]);

    let backup = |db: &str| {
        format!(
            "apiVersion: dbops.dev/v1alpha1\nkind: Backup\nmetadata: {{name: b1}}\nspec: {{databaseRef: {{name: {db}}}}}\n"
        )
    };
    accepted(&b, &backup("orders"));
    let msg = refused(&b, &backup("payments"));
    assert_mentions(&msg, &["spec.databaseRef", "immutable"]);

    let msg = refused(
        &b,
        &backup("orders").replace("}}\n", "}, maxRetries: -1}\n"),
    );
    assert_mentions(&msg, &["spec.maxRetries"]);
}

#[tokio::test]
async fn migration_cutover_must_be_known() {
    let b = bed("cutover").await;
    let migration = |cutover: &str, host: &str| {
        format!(
            r#"
apiVersion: dbops.dev/v1alpha1
kind: Migration
metadata: {{name: m1}}
spec:
  databaseRef: {{name: orders}}
  target: {{server: {{host: {host}, adminSecretRef: {{name: target-admin}}}}}}
  cutover: {cutover}
"#
        )
    };
    let msg = refused(&b, &migration("Sometimes", "10.0.0.1"));
    assert_mentions(
        &msg,
        &["spec.cutover", "Unsupported value", "Automatic", "Manual"],
    );

    accepted(&b, &migration("Manual", "pg-new.databases.svc"));
    let msg = refused(&b, &migration("Manual", "pg-other.databases.svc"));
    assert_mentions(&msg, &["spec.target", "immutable"]);
}

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
        "backup.dbops.dev/orders-manual-1",
        "migration.dbops.dev/orders-to-target",
    ] {
        assert!(
            out.stdout.contains(created),
            "{created} missing from:\n{}",
            out.stdout
        );
    }
    let get = b
        .kubectl
        .run(&["get", "pgdb", "-n", b.ns.name()], None)
        .unwrap();
    let header = get.stdout.lines().next().unwrap_or_default().to_string();
    for column in ["NAME", "PHASE", "READY", "SERVER", "DATABASE", "AGE"] {
        assert!(header.contains(column), "column {column} missing: {header}");
    }
    let get = b
        .kubectl
        .run(&["get", "pgmig", "-n", b.ns.name()], None)
        .unwrap();
    let header = get.stdout.lines().next().unwrap_or_default().to_string();
    for column in ["DATABASE", "TARGET", "PHASE", "STEP"] {
        assert!(header.contains(column), "column {column} missing: {header}");
    }
    // Defaults land in the stored object.
    let db = b
        .kubectl
        .run(
            &[
                "get",
                "backup",
                "orders-manual-1",
                "-n",
                b.ns.name(),
                "-o",
                "jsonpath={.spec.maxRetries}",
            ],
            None,
        )
        .unwrap();
    assert_eq!(db.stdout.trim(), "3");
}
