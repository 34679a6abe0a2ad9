//! A Migration's cutover and mode: known values only, the mode immutable.

use dbops_e2e::harness::api_validation::{accepted, jsonpath, refused};

use crate::bed;

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
    assert_eq!(
        jsonpath(&b, "migration", "m1", "{.spec.mode}"),
        "Auto",
        "the default lands in the object"
    );
    refused(&b, &migration(", mode: Dump"), &["spec.mode", "immutable"]);
}
