//! A DatabaseServer's fields and its guardrails.

use dbops_e2e::harness::api_validation::{
    SERVER_COLUMNS, assert_columns, jsonpath, server_accepted, server_refused,
};

use crate::bed;

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
    // A DatabaseServer is cluster-scoped: the namespace jsonpath passes is ignored.
    assert_eq!(
        jsonpath(&b, "dbserver", &name, "{.spec.port} {.spec.tls.mode}"),
        "5432 verify-full"
    );
    assert_columns(
        &b,
        &["dbserver", &name],
        &[SERVER_COLUMNS.as_slice(), &["AGE"]].concat(),
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
    assert_eq!(
        jsonpath(
            &b,
            "dbserver",
            &name,
            "{.spec.limits.connectionLimit} {.spec.sessionLimits.lockTimeout.max}",
        ),
        "50 0s"
    );
}

/// `spec.pooler`: each setting out of its range, an unknown pool mode and a pool larger
/// than the clients it may serve are refused naming the field; the defaults fill in.
#[tokio::test]
async fn pooler_settings_are_checked() {
    let b = bed("pooler-fields").await;
    let ok = "  host: pg-main.databases.svc\n  adminSecretRef: {name: pg-main-admin}";
    for (field, value, needle) in [
        ("replicas", "0", "spec.pooler.replicas"),
        ("replicas", "11", "spec.pooler.replicas"),
        (
            "maxClientConnections",
            "9",
            "spec.pooler.maxClientConnections",
        ),
        (
            "maxClientConnections",
            "100001",
            "spec.pooler.maxClientConnections",
        ),
        ("defaultPoolSize", "0", "spec.pooler.defaultPoolSize"),
        ("defaultPoolSize", "1001", "spec.pooler.defaultPoolSize"),
        ("poolMode", "statement", "spec.pooler.poolMode"),
    ] {
        server_refused(
            &b,
            "pooler",
            &format!("{ok}\n  pooler: {{{field}: {value}}}"),
            &[needle],
        );
    }
    server_refused(
        &b,
        "pooler",
        &format!("{ok}\n  pooler: {{maxClientConnections: 50, defaultPoolSize: 100}}"),
        &[
            "spec.pooler.defaultPoolSize",
            "defaultPoolSize must not exceed maxClientConnections",
        ],
    );
    server_refused(
        &b,
        "pooler",
        &format!("{ok}\n  pooler: {{maxConnections: 50}}"),
        &["unknown field", "spec.pooler.maxConnections"],
    );
    server_accepted(&b, "pooled", &format!("{ok}\n  pooler: {{}}"));
    let name = dbops_e2e::fixtures::server_name(b.ns.name(), "pooled");
    assert_eq!(
        jsonpath(
            &b,
            "dbserver",
            &name,
            "{.spec.pooler.replicas} {.spec.pooler.poolMode} {.spec.pooler.maxClientConnections} {.spec.pooler.defaultPoolSize}",
        ),
        "2 transaction 2000 10"
    );
}
