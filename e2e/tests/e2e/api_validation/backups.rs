//! A Backup's database reference (required, immutable) and its schedule's numbers.

use dbops_e2e::harness::api_validation::{accepted, database, database_refused, refused};

use crate::bed;

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
