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
        .run(&["get", "dbuser", "-n", b.ns.name()], None)
        .unwrap();
    let header = get.stdout.lines().next().unwrap_or_default().to_string();
    for column in ["NAME", "DATABASE", "ACCESS", "ROLE", "READY", "ROTATED"] {
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

/// A DatabaseUser of the Database `orders` with `extra_spec` (YAML lines indented by two).
fn user(name: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: DatabaseUser
metadata:
  name: {name}
spec:
  databaseRef: {{name: orders}}
{extra_spec}
"#
    )
}

/// [`refused`] of the DatabaseUser [`user`]`(name, extra_spec)`.
fn user_refused(b: &Bed, name: &str, extra_spec: &str, needles: &[&str]) {
    refused(b, &user(name, extra_spec), needles);
}

/// `kubectl get <what> <name> -o jsonpath=<path>` in the test's namespace.
fn jsonpath(b: &Bed, what: &str, name: &str, path: &str) -> String {
    let out = b
        .kubectl
        .run(
            &[
                "get",
                what,
                name,
                "-n",
                b.ns.name(),
                "-o",
                &format!("jsonpath={path}"),
            ],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.text());
    out.stdout.trim().to_string()
}

/// Every field of a DatabaseUser: bad values refused naming the field, good ones (and the
/// defaults) stored, `databaseRef` immutable, the printer columns.
#[tokio::test]
async fn database_users_are_checked() {
    let b = bed("dbuser").await;

    refused(
        &b,
        "apiVersion: dbops.dev/v1alpha1\nkind: DatabaseUser\nmetadata: {name: lost}\nspec: {access: ReadOnly}\n",
        &["spec.databaseRef", "Required value"],
    );

    user_refused(
        &b,
        "admin",
        "  access: Admin",
        &["spec.access", "Unsupported value", "ReadOnly", "ReadWrite"],
    );

    for schemas in ["[public, 'sales; drop']", "[Public]", "['1sales']", "['']"] {
        user_refused(
            &b,
            "schemas",
            &format!("  schemas: {schemas}"),
            &["spec.schemas", "PostgreSQL identifier"],
        );
    }
    // PostgreSQL's own schemas are not the tenant's to hand out.
    user_refused(
        &b,
        "schemas",
        "  schemas: [public, pg_catalog]",
        &["spec.schemas", "pg_*"],
    );
    user_refused(
        &b,
        "schemas",
        "  schemas: [information_schema]",
        &["spec.schemas", "information_schema"],
    );

    user_refused(
        &b,
        "conns",
        "  connectionLimit: -2",
        &["spec.connectionLimit", "greater than or equal to -1"],
    );

    for timeout in ["'30'", "1d", "abc", "-1s", "1h30"] {
        user_refused(
            &b,
            "timeout",
            &format!("  settings: {{statementTimeout: {timeout}}}"),
            &[
                "spec.settings.statementTimeout",
                "statementTimeout must be a duration",
            ],
        );
    }
    user_refused(
        &b,
        "idle",
        "  settings: {idleInTransactionSessionTimeout: 5 minutes}",
        &[
            "spec.settings.idleInTransactionSessionTimeout",
            "must be a duration",
        ],
    );
    user_refused(
        &b,
        "lock",
        "  settings: {lockTimeout: '10'}",
        &["spec.settings.lockTimeout", "must be a duration"],
    );
    // PostgreSQL's units are case-sensitive: `4mb` is refused by the server too.
    for work_mem in ["4mb", "4", "4 MB", "4MiB"] {
        user_refused(
            &b,
            "workmem",
            &format!("  settings: {{workMem: '{work_mem}'}}"),
            &["spec.settings.workMem", "amount of memory"],
        );
    }

    // What PostgreSQL would refuse (INT_MAX milliseconds; work_mem 64kB to INT_MAX kB)
    // is refused here, before a controller tries.
    for (setting, value, needle) in [
        (
            "statementTimeout",
            "596h31m23s648ms",
            "at most 596h31m23s647ms",
        ),
        ("lockTimeout", "600h", "at most 596h31m23s647ms"),
        (
            "idleInTransactionSessionTimeout",
            "99999h",
            "at most 596h31m23s647ms",
        ),
        ("workMem", "32kB", "from 64kB to 2147483647kB"),
        ("workMem", "2TB", "from 64kB to 2147483647kB"),
        ("workMem", "2097152GB", "from 64kB to 2147483647kB"),
    ] {
        user_refused(
            &b,
            "pglimits",
            &format!("  settings: {{{setting}: {value}}}"),
            &[&format!("spec.settings.{setting}"), needle],
        );
    }
    // A number too long for its unit is not a duration (CEL's `duration()` would fail on
    // it, with a message about something else).
    for every in ["100000h", "99999999m", "9999999999s", "2562048h"] {
        user_refused(
            &b,
            "rotation",
            &format!("  passwordRotation: {{every: {every}}}"),
            &["spec.passwordRotation.every", "must be a duration"],
        );
    }
    user_refused(
        &b,
        "rotation",
        "  passwordRotation: {every: 2h, keepPrevious: 999999999h}",
        &["spec.passwordRotation.keepPrevious", "must be a duration"],
    );
    user_refused(
        &b,
        "rotation",
        "  passwordRotation: {every: 30s}",
        &["spec.passwordRotation.every", "at least 1m"],
    );
    user_refused(
        &b,
        "rotation",
        "  passwordRotation: {every: 59s999ms}",
        &["spec.passwordRotation.every", "at least 1m"],
    );
    user_refused(
        &b,
        "rotation",
        "  passwordRotation: {every: bogus}",
        &["spec.passwordRotation.every", "must be a duration"],
    );
    user_refused(
        &b,
        "rotation",
        "  passwordRotation: {every: 720h, keepPrevious: 1 day}",
        &["spec.passwordRotation.keepPrevious", "must be a duration"],
    );
    // The previous login must be gone before the next rotation.
    for keep in ["2h", "1h", "60m"] {
        user_refused(
            &b,
            "rotation",
            &format!("  passwordRotation: {{every: 1h, keepPrevious: {keep}}}"),
            &["spec.passwordRotation.keepPrevious", "shorter than every"],
        );
    }
    // keepPrevious defaults to 1h, so `every` of 1h alone is refused the same way.
    user_refused(
        &b,
        "rotation",
        "  passwordRotation: {every: 1h}",
        &["spec.passwordRotation.keepPrevious", "shorter than every"],
    );

    for key in ["a/b", "'bad key'", "''", "'DATABASE_URL:'", "ü"] {
        user_refused(
            &b,
            "template",
            &format!("  secretTemplate: {{{key}: '{{{{ user }}}}'}}"),
            &["spec.secretTemplate", "Secret key"],
        );
    }

    // Every field at once, valid.
    accepted(
        &b,
        &user(
            "dashboard",
            r#"  access: ReadOnly
  schemas: [public, sales_2024, _staging]
  connectionLimit: 5
  settings: {statementTimeout: 15s, idleInTransactionSessionTimeout: 1h30m, lockTimeout: 250ms, workMem: 16MB}
  passwordRotation: {every: 720h, keepPrevious: 24h}
  secretTemplate:
    DATABASE_URL: "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}"
    spring.datasource.url: "jdbc:postgresql://{{ host }}:{{ port }}/{{ database }}"
    ca-bundle_2.pem: "{{ ca }}""#,
        ),
    );
    // ReadWrite, no limit of its own, rotation only on demand, a short keepPrevious.
    accepted(
        &b,
        &user(
            "app",
            "  access: ReadWrite\n  connectionLimit: -1\n  settings: {statementTimeout: 0s, lockTimeout: 596h31m23s647ms, idleInTransactionSessionTimeout: 35791m23s647ms, workMem: 64kB}\n  passwordRotation: {every: 1m, keepPrevious: 0s}",
        ),
    );
    accepted(
        &b,
        &user("ondemand", "  passwordRotation: {keepPrevious: 6s}"),
    );
    // The longest durations of each unit, and the most memory PostgreSQL takes.
    accepted(
        &b,
        &user(
            "longest",
            "  settings: {workMem: 2047GB, statementTimeout: 999999999ms}\n  passwordRotation: {every: 99999h9999999m999999999s, keepPrevious: 999999999s999999999ms}",
        ),
    );
    // Defaults land in the stored object.
    accepted(&b, &user("minimal", ""));
    assert_eq!(
        jsonpath(
            &b,
            "dbuser",
            "minimal",
            "{.spec.access} {.spec.connectionLimit}"
        ),
        "ReadOnly -1"
    );
    accepted(&b, &user("minimal", "  passwordRotation: {every: 24h}"));
    assert_eq!(
        jsonpath(
            &b,
            "dbuser",
            "minimal",
            "{.spec.passwordRotation.keepPrevious}"
        ),
        "1h"
    );

    // The Database a user belongs to never changes; everything else may.
    refused(
        &b,
        &user("dashboard", "  access: ReadOnly").replace("{name: orders}", "{name: payments}"),
        &["spec.databaseRef", "immutable"],
    );
    accepted(
        &b,
        &user("dashboard", "  access: ReadWrite\n  schemas: [public]"),
    );

    let get = b
        .kubectl
        .run(&["get", "dbuser", "dashboard", "-n", b.ns.name()], None)
        .unwrap();
    assert!(get.success, "{}", get.text());
    let mut lines = get.stdout.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "DATABASE", "ACCESS", "ROLE", "READY", "ROTATED", "AGE"
        ],
        "{}",
        get.stdout
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        row.get(..3),
        Some(&["dashboard", "orders", "ReadWrite"][..]),
        "{}",
        get.stdout
    );
    // The kind is in the category `dbops` too.
    let all = b
        .kubectl
        .run(&["get", "dbops", "-n", b.ns.name(), "-o", "name"], None)
        .unwrap();
    assert!(
        all.stdout.contains("databaseuser.dbops.dev/dashboard"),
        "{}",
        all.text()
    );
}

/// The DatabaseServer's guardrails (`limits.connectionLimit`, `limits.databaseSize`,
/// `sessionLimits`): bad values and a default over its max refused, `0s` as max accepted.
#[tokio::test]
async fn server_guardrails_are_checked() {
    let b = bed("guardrails").await;
    let ok = "  host: pg-main.databases.svc\n  adminSecretRef: {name: pg-main-admin}";

    for limit in ["0", "-1", "100001"] {
        server_refused(
            &b,
            "conns",
            &format!("{ok}\n  limits: {{connectionLimit: {limit}}}"),
            &["spec.limits.connectionLimit"],
        );
    }
    // A Kubernetes quantity (binary or decimal suffix), not PostgreSQL's units.
    for size in ["20GB", "lots", "'20 Gi'", "'-1Gi'", "1.5Gi", "''"] {
        server_refused(
            &b,
            "size",
            &format!("{ok}\n  limits: {{databaseSize: {size}}}"),
            &["spec.limits.databaseSize"],
        );
    }
    server_refused(
        &b,
        "size",
        &format!("{ok}\n  limits: {{databaseSize: 20GB}}"),
        &["spec.limits.databaseSize", "size such as 500Mi"],
    );

    server_refused(
        &b,
        "timeouts",
        &format!("{ok}\n  sessionLimits: {{statementTimeout: {{default: 10m, max: 1m}}}}"),
        &[
            "spec.sessionLimits.statementTimeout.default",
            "default must not exceed max",
        ],
    );
    // `0s` (no timeout) as a default is more than any ceiling but `0s`.
    server_refused(
        &b,
        "timeouts",
        &format!("{ok}\n  sessionLimits: {{lockTimeout: {{default: 0s, max: 1h}}}}"),
        &[
            "spec.sessionLimits.lockTimeout.default",
            "default must not exceed max",
        ],
    );
    server_refused(
        &b,
        "timeouts",
        &format!(
            "{ok}\n  sessionLimits: {{idleInTransactionSessionTimeout: {{default: 90m, max: 1h}}}}"
        ),
        &[
            "spec.sessionLimits.idleInTransactionSessionTimeout.default",
            "default must not exceed max",
        ],
    );
    for max in ["forever", "1d", "'10'"] {
        server_refused(
            &b,
            "timeouts",
            &format!("{ok}\n  sessionLimits: {{statementTimeout: {{default: 30s, max: {max}}}}}"),
            &[
                "spec.sessionLimits.statementTimeout.max",
                "max must be a duration",
            ],
        );
    }
    server_refused(
        &b,
        "timeouts",
        &format!("{ok}\n  sessionLimits: {{lockTimeout: {{default: soon}}}}"),
        &[
            "spec.sessionLimits.lockTimeout.default",
            "default must be a duration",
        ],
    );
    server_refused(
        &b,
        "workmem",
        &format!("{ok}\n  sessionLimits: {{workMem: {{max: 1gb}}}}"),
        &["spec.sessionLimits.workMem.max", "amount of memory"],
    );
    server_refused(
        &b,
        "workmem",
        &format!("{ok}\n  sessionLimits: {{workMem: {{default: 4MiB}}}}"),
        &["spec.sessionLimits.workMem.default", "amount of memory"],
    );
    server_refused(
        &b,
        "workmem",
        &format!("{ok}\n  sessionLimits: {{workMem: {{default: 16kB}}}}"),
        &[
            "spec.sessionLimits.workMem.default",
            "from 64kB to 2147483647kB",
        ],
    );
    server_refused(
        &b,
        "timeouts",
        &format!("{ok}\n  sessionLimits: {{statementTimeout: {{default: 700h, max: 0s}}}}"),
        &[
            "spec.sessionLimits.statementTimeout.default",
            "at most 596h31m23s647ms",
        ],
    );
    // Once CEL's `duration()` failed on these with "type conversion error … default
    // must not exceed max"; now the form itself is refused.
    for (default, max, field) in [("999999999h", "1h", "default"), ("1h", "999999999h", "max")] {
        server_refused(
            &b,
            "timeouts",
            &format!(
                "{ok}\n  sessionLimits: {{statementTimeout: {{default: {default}, max: {max}}}}}"
            ),
            &[
                &format!("spec.sessionLimits.statementTimeout.{field}"),
                "must be a duration",
            ],
        );
    }
    server_refused(
        &b,
        "workmem",
        &format!("{ok}\n  sessionLimits: {{workMem: {{default: 1GB, max: 64MB}}}}"),
        &[
            "spec.sessionLimits.workMem.default",
            "default must not exceed max",
        ],
    );
    server_refused(
        &b,
        "unknown",
        &format!("{ok}\n  sessionLimits: {{searchPath: {{default: public}}}}"),
        &["unknown field", "spec.sessionLimits.searchPath"],
    );

    server_accepted(
        &b,
        "guarded",
        &format!(
            r#"{ok}
  limits: {{databasesPerNamespace: 20, connectionLimit: 50, databaseSize: 20Gi}}
  sessionLimits:
    statementTimeout: {{default: 30s, max: 10m}}
    idleInTransactionSessionTimeout: {{default: 5m, max: 1h}}
    lockTimeout: {{default: 10s, max: 0s}}
    workMem: {{default: 4MB, max: 1GB}}"#
        ),
    );
    // `0s` as max sets no ceiling: any default goes, `0s` (none) included; so does a
    // default equal to its max, or either one alone.
    server_accepted(
        &b,
        "noceiling",
        &format!(
            r#"{ok}
  limits: {{connectionLimit: 1, databaseSize: '1048576'}}
  sessionLimits:
    statementTimeout: {{default: 0s, max: 0s}}
    idleInTransactionSessionTimeout: {{default: 1h, max: 60m}}
    lockTimeout: {{max: 1h30m}}
    workMem: {{default: 1024kB, max: 1MB}}"#
        ),
    );
    server_accepted(
        &b,
        "decimal",
        &format!(
            "{ok}\n  limits: {{databaseSize: 500M}}\n  sessionLimits: {{statementTimeout: {{default: 250ms}}}}"
        ),
    );
    let name = dbops_e2e::fixtures::server_name(b.ns.name(), "guarded");
    let get = b
        .kubectl
        .run(
            &[
                "get",
                "dbserver",
                &name,
                "-o",
                "jsonpath={.spec.limits.connectionLimit} {.spec.sessionLimits.lockTimeout.max}",
            ],
            None,
        )
        .unwrap();
    assert_eq!(get.stdout.trim(), "50 0s", "{}", get.text());
}

/// A Database's `settings`, `passwordRotation` and `secretTemplate` are checked like a
/// DatabaseUser's.
#[tokio::test]
async fn database_access_fields_are_checked() {
    let b = bed("dbaccess").await;
    database_refused(
        &b,
        "orders",
        "  settings: {lockTimeout: x}",
        &["spec.settings.lockTimeout", "must be a duration"],
    );
    database_refused(
        &b,
        "orders",
        "  settings: {workMem: 1gb}",
        &["spec.settings.workMem", "amount of memory"],
    );
    database_refused(
        &b,
        "orders",
        "  settings: {maxConnections: 10}",
        &["unknown field", "spec.settings.maxConnections"],
    );
    database_refused(
        &b,
        "orders",
        "  passwordRotation: {every: 10s}",
        &["spec.passwordRotation.every", "at least 1m"],
    );
    database_refused(
        &b,
        "orders",
        "  passwordRotation: {every: 24h, keepPrevious: 48h}",
        &["spec.passwordRotation.keepPrevious", "shorter than every"],
    );
    database_refused(
        &b,
        "orders",
        "  secretTemplate: {'bad key': '{{ host }}'}",
        &["spec.secretTemplate", "Secret key"],
    );

    accepted(
        &b,
        &database(
            "orders",
            r#"  settings: {statementTimeout: 30s, idleInTransactionSessionTimeout: 5m, lockTimeout: 10s, workMem: 8MB}
  passwordRotation: {every: 720h, keepPrevious: 24h}
  secretTemplate: {DATABASE_URL: "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}"}"#,
        ),
    );
    assert_eq!(
        jsonpath(
            &b,
            "database",
            "orders",
            "{.spec.settings.workMem} {.spec.passwordRotation.every}"
        ),
        "8MB 720h"
    );
}

/// Each number of a cron schedule must be within its field's range.
///
/// The regression of issue 23: the CRD's old rule,
/// `[0-9*/,A-Za-z?-]+( +[0-9*/,A-Za-z?-]+){4}`, only checked the characters and the number
/// of fields, so the API server accepted `61 * * * *` (and hour 24, day 32, month 13, day
/// of week 8), and only the backup-controller found out, later.
#[tokio::test]
async fn backup_schedule_numbers_are_in_range() {
    let b = bed("cronrange").await;
    for schedule in [
        "61 * * * *",
        "60 * * * *",
        "0 24 * * *",
        "0 0 32 * *",
        "0 0 0 * *",
        "0 0 * 13 *",
        "0 0 * 0 *",
        "0 0 * * 8",
        "0-61 * * * *",
        "0,15,75 * * * *",
        "0 22-25 * * *",
        "*/0 * * * *",
        "0 0 * * * *",
        "0 0 * *",
        "@fortnightly",
        "abc * * * *",
        "0 0 FOO * *",
        "0 0 * FOO *",
        "0 0 * * XYZ",
    ] {
        database_refused(
            &b,
            "orders",
            &format!("  backup: {{schedule: '{schedule}'}}"),
            &["spec.backup.schedule", "minute 0-59"],
        );
    }
    for (i, schedule) in [
        "59 23 31 12 7",
        "0 0 1 1 0",
        "*/15 3 * * 1-5",
        "0,30 8-18/2 1,15 */3 *",
        "0 0 L * *",
        "0 0 * * MON-FRI",
        "0 3 * JAN,JUL SUN",
        "0 3 * jan-mar mon",
        "@daily",
        "@hourly",
    ]
    .iter()
    .enumerate()
    {
        accepted(
            &b,
            &database(
                &format!("orders-{i}"),
                &format!("  backup: {{schedule: '{schedule}'}}"),
            ),
        );
    }
}
