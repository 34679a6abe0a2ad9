//! Bad input is refused by the real API server, with a message naming the field.

use dbops_e2e::kubectl::Output;

use crate::{Bed, bed};

fn database(name: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: Database
metadata:
  name: {name}
spec:
  serverRef: {{name: pg-main}}
{extra_spec}
"#
    )
}

/// A DatabaseServer of this test (named after its namespace and labelled with it, so the
/// namespace's cleanup deletes it) with `spec` (YAML lines indented by two).
fn server(b: &Bed, name: &str, spec: &str) -> String {
    let ns = b.ns.name();
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: DatabaseServer
metadata:
  name: {}
  labels: {{{}: {ns}}}
spec:
{spec}
"#,
        dbops_e2e::fixtures::server_name(ns, name),
        dbops_e2e::fixtures::TEST_NAMESPACE_LABEL,
    )
}

/// Applies the DatabaseServer [`server`]`(b, name, spec)` (cluster-scoped: no namespace),
/// expects a refusal, and that kubectl's message mentions each of `needles`.
fn server_refused(b: &Bed, name: &str, spec: &str, needles: &[&str]) {
    let yaml = server(b, name, spec);
    let out = b.kubectl.run(&["apply", "-f", "-"], Some(&yaml)).unwrap();
    expect_refused(&out, &yaml, needles);
}

/// Applies the DatabaseServer [`server`]`(b, name, spec)` and expects it accepted.
fn server_accepted(b: &Bed, name: &str, spec: &str) {
    let yaml = server(b, name, spec);
    let out = b.kubectl.run(&["apply", "-f", "-"], Some(&yaml)).unwrap();
    expect_accepted(&out, &yaml);
}

/// Applies `yaml`, expects a refusal, and that kubectl's message mentions each of
/// `needles`.
fn refused(b: &Bed, yaml: &str, needles: &[&str]) {
    expect_refused(&b.kubectl.apply(b.ns.name(), yaml).unwrap(), yaml, needles);
}

fn accepted(b: &Bed, yaml: &str) {
    expect_accepted(&b.kubectl.apply(b.ns.name(), yaml).unwrap(), yaml);
}

/// [`refused`] of the Database [`database`]`(name, extra_spec)`.
fn database_refused(b: &Bed, name: &str, extra_spec: &str, needles: &[&str]) {
    refused(b, &database(name, extra_spec), needles);
}

/// `kubectl apply` of `yaml` failed, saying each of `needles`.
fn expect_refused(out: &Output, yaml: &str, needles: &[&str]) {
    assert!(
        !out.success,
        "the API server accepted:\n{yaml}\n{}",
        out.text()
    );
    assert_mentions(&out.text(), needles);
}

fn expect_accepted(out: &Output, yaml: &str) {
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
    database_refused(
        &b,
        "orders",
        "  databaseName: 'orders; drop table x'",
        &["spec.databaseName", "PostgreSQL identifier"],
    );

    database_refused(
        &b,
        "orders",
        "  owner: Orders",
        &["spec.owner", "PostgreSQL identifier"],
    );

    database_refused(&b, "orders", "  owner: pg_owner", &["spec.owner", "pg_"]);

    database_refused(
        &b,
        "orders",
        "  extensions: [pgcrypto, 'x;y']",
        &["spec.extensions", "extension name"],
    );

    // metadata.name stands in for databaseName only when it can be one.
    database_refused(
        &b,
        "9orders",
        "",
        &["spec.databaseName", "is required when metadata.name"],
    );
    accepted(&b, &database("9orders", "  databaseName: orders9"));
    accepted(&b, &database("orders-eu", ""));
}

#[tokio::test]
async fn enums_ports_and_cron_are_checked() {
    let b = bed("enums").await;
    database_refused(
        &b,
        "orders",
        "  deletionPolicy: Sometimes",
        &["spec.deletionPolicy", "Unsupported value"],
    );

    database_refused(
        &b,
        "orders",
        "  backup: {schedule: 'every night'}",
        &["spec.backup.schedule", "cron"],
    );
    accepted(
        &b,
        &database(
            "orders",
            "  backup: {schedule: '*/15 3 * * 1-5', retention: {keepLast: 3}}",
        ),
    );
    accepted(&b, &database("daily", "  backup: {schedule: '@daily'}"));

    // A server is named, never reached across namespaces or by address.
    refused(
        &b,
        &database("orders2", "").replace("{name: pg-main}", "{name: pg-main, namespace: other}"),
        &["unknown field", "spec.serverRef.namespace"],
    );
    refused(
        &b,
        &database("orders2", "").replace("{name: pg-main}", "{name: 'pg main'}"),
        &["spec.serverRef.name"],
    );
    refused(
        &b,
        &database("orders2", "  deletionPolicy: Retain")
            .replace("  serverRef: {name: pg-main}\n", ""),
        &["spec.serverRef", "Required value"],
    );
    refused(
        &b,
        &database("orders2", "").replace(
            "serverRef: {name: pg-main}",
            "server: {host: 127.0.0.1, adminSecretRef: {name: pg-admin}}\n  serverRef: {name: pg-main}",
        ),
        &["unknown field \"spec.server\""],
    );
}

#[tokio::test]
async fn database_servers_are_checked() {
    let b = bed("dbserver").await;
    let ok = "  host: pg-main.databases.svc\n  adminSecretRef: {name: pg-main-admin}";

    server_refused(&b, "port0", &format!("{ok}\n  port: 0"), &["spec.port"]);
    server_refused(&b, "port7", &format!("{ok}\n  port: 70000"), &["spec.port"]);

    server_refused(
        &b,
        "badhost",
        "  host: 'bad host!'\n  adminSecretRef: {name: pg-main-admin}",
        &["spec.host", "DNS name or an IP address"],
    );

    server_refused(
        &b,
        "plainca",
        &format!("{ok}\n  tls: {{mode: disable, caSecretRef: {{name: pg-main-ca}}}}"),
        &[
            "spec.tls.caSecretRef",
            "caSecretRef needs a TLS mode other than disable",
        ],
    );

    // libpq's `prefer` (TLS when offered, plain otherwise) is not a mode dbops offers.
    server_refused(
        &b,
        "prefer",
        &format!("{ok}\n  tls: {{mode: prefer}}"),
        &["spec.tls.mode", "Unsupported value"],
    );

    server_refused(
        &b,
        "noadmin",
        "  host: pg-main.databases.svc",
        &["spec.adminSecretRef", "Required value"],
    );

    // The admin Secret is in the controllers' namespace: no namespace to name.
    server_refused(
        &b,
        "elsewhere",
        "  host: pg-main.databases.svc\n  adminSecretRef: {name: pg-main-admin, namespace: tenant}",
        &["unknown field", "spec.adminSecretRef.namespace"],
    );

    server_refused(
        &b,
        "quota",
        &format!("{ok}\n  limits: {{databasesPerNamespace: -1}}"),
        &["spec.limits.databasesPerNamespace"],
    );

    // What is left out is defaulted: port 5432, TLS verify-full against the system's roots.
    server_accepted(&b, "main", ok);
    server_accepted(
        &b,
        "tls",
        &format!(
            "{ok}\n  tls: {{mode: verify-ca, caSecretRef: {{name: pg-main-ca}}}}\n  allowedNamespaces: {{matchLabels: {{dbops.dev/tenant: 'true'}}}}\n  limits: {{databasesPerNamespace: 20}}"
        ),
    );
    let name = dbops_e2e::fixtures::server_name(b.ns.name(), "main");
    let get = b
        .kubectl
        .run(
            &[
                "get",
                "dbserver",
                &name,
                "-o",
                "jsonpath={.spec.port} {.spec.tls.mode}",
            ],
            None,
        )
        .unwrap();
    assert_eq!(get.stdout.trim(), "5432 verify-full", "{}", get.text());
    let get = b.kubectl.run(&["get", "dbserver", &name], None).unwrap();
    let header = get.stdout.lines().next().unwrap_or_default().to_string();
    for column in [
        "NAME",
        "HOST",
        "PORT",
        "TLS",
        "READY",
        "VERSION",
        "DATABASES",
        "AGE",
    ] {
        assert!(header.contains(column), "column {column} missing: {header}");
    }
}

#[tokio::test]
async fn immutable_database_fields_cannot_change() {
    let b = bed("immutable").await;
    accepted(
        &b,
        &database("orders", "  databaseName: orders\n  owner: orders_owner"),
    );

    database_refused(
        &b,
        "orders",
        "  databaseName: orders2\n  owner: orders_owner",
        &["spec.databaseName", "immutable"],
    );

    database_refused(
        &b,
        "orders",
        "  owner: orders_owner",
        &["spec.databaseName", "immutable"],
    );

    database_refused(
        &b,
        "orders",
        "  databaseName: orders\n  owner: someone_else",
        &["spec.owner", "immutable"],
    );

    database_refused(
        &b,
        "orders",
        "  databaseName: orders\n  owner: orders_owner\n  restoreFrom: {backupRef: {name: nightly}}",
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
    refused(
        &b,
        "apiVersion: dbops.dev/v1alpha1\nkind: Backup\nmetadata: {name: b1}\nspec: {maxRetries: 2}\n",
        &["spec.databaseRef", "Required value"],
    );

    let backup = |db: &str| {
        format!(
            "apiVersion: dbops.dev/v1alpha1\nkind: Backup\nmetadata: {{name: b1}}\nspec: {{databaseRef: {{name: {db}}}}}\n"
        )
    };
    accepted(&b, &backup("orders"));
    refused(&b, &backup("payments"), &["spec.databaseRef", "immutable"]);

    refused(
        &b,
        &backup("orders").replace("}}\n", "}, maxRetries: -1}\n"),
        &["spec.maxRetries"],
    );
}

#[tokio::test]
async fn migration_cutover_must_be_known() {
    let b = bed("cutover").await;
    let migration = |cutover: &str, target: &str| {
        format!(
            r#"
apiVersion: dbops.dev/v1alpha1
kind: Migration
metadata: {{name: m1}}
spec:
  databaseRef: {{name: orders}}
  target: {target}
  cutover: {cutover}
"#
        )
    };
    refused(
        &b,
        &migration("Sometimes", "{serverRef: {name: pg-new}}"),
        &["spec.cutover", "Unsupported value", "Automatic", "Manual"],
    );

    refused(
        &b,
        &migration("Manual", "{}"),
        &["spec.target.serverRef", "Required value"],
    );
    refused(
        &b,
        &migration(
            "Manual",
            "{server: {host: pg-new.databases.svc, adminSecretRef: {name: target-admin}}}",
        ),
        &["spec.target"],
    );

    accepted(&b, &migration("Manual", "{serverRef: {name: pg-new}}"));
    refused(
        &b,
        &migration("Manual", "{serverRef: {name: pg-other}}"),
        &["spec.target", "immutable"],
    );
}

#[tokio::test]
async fn migration_mode_must_be_known_and_is_immutable() {
    let b = bed("migmode").await;
    let migration = |mode: &str| {
        format!(
            "apiVersion: dbops.dev/v1alpha1\nkind: Migration\nmetadata: {{name: m1}}\nspec: {{databaseRef: {{name: orders}}, target: {{serverRef: {{name: pg-new}}}}{mode}}}\n"
        )
    };
    refused(
        &b,
        &migration(", mode: Online"),
        &["spec.mode", "Unsupported value", "Auto", "Logical", "Dump"],
    );
    accepted(&b, &migration(""));
    let mode = b
        .kubectl
        .run(
            &[
                "get",
                "migration",
                "m1",
                "-n",
                b.ns.name(),
                "-o",
                "jsonpath={.spec.mode}",
            ],
            None,
        )
        .unwrap();
    assert_eq!(
        mode.stdout.trim(),
        "Auto",
        "the default lands in the object"
    );
    refused(&b, &migration(", mode: Dump"), &["spec.mode", "immutable"]);
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
    // An example DatabaseServer is cluster-scoped: not this namespace's, and left by its
    // deletion. Its columns are checked and it is deleted here.
    let servers: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("databaseserver.dbops.dev/"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for server in &servers {
        let get = b.kubectl.run(&["get", "dbserver", server], None).unwrap();
        let header = get.stdout.lines().next().unwrap_or_default().to_string();
        for column in [
            "NAME",
            "HOST",
            "PORT",
            "TLS",
            "READY",
            "VERSION",
            "DATABASES",
        ] {
            assert!(header.contains(column), "column {column} missing: {header}");
        }
        let deleted = b
            .kubectl
            .run(&["delete", "dbserver", server, "--wait=false"], None)
            .unwrap();
        assert!(deleted.success, "{}", deleted.text());
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
    for column in ["DATABASE", "TARGET", "PHASE", "MODE", "STEP"] {
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
