//! A Database's fields: the database name an identifier, enums, ports and cron checked,
//! immutable fields, the access fields.

use dbops_e2e::harness::api_validation::{accepted, database, database_refused, jsonpath, refused};

use crate::bed;

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
    for path in [
        "etc/dbops",
        "/etc/dbops/",
        "/etc/../root",
        "/etc/./dbops",
        "/etc/db ops",
    ] {
        database_refused(
            &b,
            "orders",
            &format!("  secretMountPath: '{path}'"),
            &["spec.secretMountPath", "absolute path"],
        );
    }

    accepted(
        &b,
        &database(
            "orders",
            r#"  settings: {statementTimeout: 30s, idleInTransactionSessionTimeout: 5m, lockTimeout: 10s, workMem: 8MB}
  passwordRotation: {every: 720h, keepPrevious: 24h}
  secretTemplate: {DATABASE_URL: "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}"}
  secretMountPath: /etc/dbops/orders-v2.1_a"#,
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
