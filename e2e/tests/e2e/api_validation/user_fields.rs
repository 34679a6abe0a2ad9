//! Every field of a DatabaseUser.

use dbops_e2e::harness::api_validation::{accepted, jsonpath, refused, user, user_refused};

use crate::bed;

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
