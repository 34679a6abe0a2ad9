//! Traces across controllers, read back through a real Jaeger's HTTP API: a Database with
//! `deletionPolicy: Snapshot` is deleted, the database-controller creates its final
//! Backup with its trace context in `dbops.dev/traceparent`, and the backup-controller's
//! reconciles of that Backup continue the same trace.

use dbops_e2e::harness::observability::{BACKUP_CONTROLLER, DATABASE_CONTROLLER, SLOW, World};
use dbops_e2e::jaeger::{Jaeger, Trace};
use dbops_e2e::wait::eventually;

/// The trace in which the backup-controller reconciled Backup `backup`, once it also holds
/// a span of the database-controller.
fn trace_across_controllers(jaeger: &Jaeger, backup: &str) -> anyhow::Result<Option<Trace>> {
    Ok(jaeger.traces(BACKUP_CONTROLLER)?.into_iter().find(|t| {
        t.spans_of(BACKUP_CONTROLLER, "reconcile Backup")
            .any(|s| s.tag("object.name").as_deref() == Some(backup))
            && t.services().contains(DATABASE_CONTROLLER)
    }))
}

/// Every tag value of every span of `service` Jaeger holds.
fn all_tag_values(jaeger: &Jaeger, service: &str) -> Vec<(String, String, String)> {
    let mut values = Vec::new();
    for trace in jaeger.traces(service).unwrap() {
        for span in &trace.spans {
            for tag in &span.tags {
                let value = match &tag.value {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                values.push((span.operation_name.clone(), tag.key.clone(), value));
            }
        }
    }
    values
}

#[tokio::test]
async fn a_final_snapshot_is_one_trace_across_both_controllers() {
    let w = World::new("tr-snapshot", true).await;
    let jaeger = w.jaeger.as_ref().unwrap();
    let db = w.create_ready_database("snap", "Snapshot").await;
    let owner_password = w.owner_password("snap").await;
    let final_name = dbops_e2e::fixtures::delete_for_final_snapshot(&w.b.client, &db, SLOW)
        .await
        .unwrap();
    let backup = w.wait_completed(&final_name).await;

    // The Backup carries the creating reconcile's trace context.
    let traceparent = backup
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("dbops.dev/traceparent"))
        .cloned()
        .unwrap_or_else(|| panic!("no dbops.dev/traceparent on {backup:?}"));
    let trace_id = traceparent.split('-').nth(1).unwrap().to_string();

    // Spans are exported in batches: wait for the trace to hold both services.
    let found = eventually(
        "one trace with spans of both controllers",
        SLOW,
        || async { trace_across_controllers(jaeger, &final_name) },
        Option::is_some,
    )
    .await
    .unwrap();
    assert_eq!(found.trace_id, trace_id, "the annotation names the trace");
    // The same trace by id, through /api/traces/<id>.
    let trace = jaeger.trace(&trace_id).unwrap();
    assert_eq!(
        trace.services(),
        [BACKUP_CONTROLLER, DATABASE_CONTROLLER].into()
    );

    // The database-controller's reconcile of the deleted Database, with its attributes.
    let db_reconcile = trace
        .spans_of(DATABASE_CONTROLLER, "reconcile Database")
        .next()
        .unwrap_or_else(|| panic!("no database reconcile span in {trace:#?}"));
    assert_eq!(
        db_reconcile.tag("controller").as_deref(),
        Some("database-controller")
    );
    assert_eq!(db_reconcile.tag("kind").as_deref(), Some("Database"));
    assert_eq!(
        db_reconcile.tag("object.namespace").as_deref(),
        Some(w.ns())
    );
    assert_eq!(db_reconcile.tag("object.name").as_deref(), Some("snap"));
    // Deletion moves a custom resource's generation past the one it was created with.
    let generation: i64 = db_reconcile
        .tag("object.generation")
        .unwrap()
        .parse()
        .unwrap();
    assert!(generation > db.metadata.generation.unwrap(), "{generation}");
    assert_eq!(db_reconcile.tag("outcome").as_deref(), Some("success"));
    // It created the Backup: a POST backups child span.
    assert!(
        trace
            .spans
            .iter()
            .any(|s| s.operation_name == "POST backups"
                && s.parent_id() == Some(db_reconcile.span_id.as_str())),
        "no POST backups under the database reconcile: {:#?}",
        trace
            .spans
            .iter()
            .map(|s| &s.operation_name)
            .collect::<Vec<_>>()
    );

    // The backup-controller's reconciles of the final Backup are its children.
    let backup_reconciles: Vec<_> = trace
        .spans_of(BACKUP_CONTROLLER, "reconcile Backup")
        .collect();
    assert!(!backup_reconciles.is_empty());
    for span in &backup_reconciles {
        assert_eq!(span.parent_id(), Some(db_reconcile.span_id.as_str()));
        assert_eq!(span.tag("controller").as_deref(), Some("backup-controller"));
        assert_eq!(span.tag("kind").as_deref(), Some("Backup"));
        assert_eq!(
            span.tag("object.name").as_deref(),
            Some(final_name.as_str())
        );
        assert_eq!(span.tag("object.namespace").as_deref(), Some(w.ns()));
        assert!(span.tag("object.generation").is_some());
        assert!(span.tag("outcome").is_some());
        assert_eq!(span.tag("trace.continued").as_deref(), Some("parent"));
    }

    // SQL child spans: the statement, no parameters, under a reconcile of the trace.
    let sql: Vec<_> = trace
        .spans
        .iter()
        .filter(|s| {
            s.tag("db.system").as_deref() == Some("postgresql") && s.tag("db.statement").is_some()
        })
        .collect();
    assert!(
        sql.iter().any(
            // The server's version, which picks the pg_dump (one per major).
            |s| s.tag("db.statement").as_deref()
                == Some(
                    "SELECT current_setting('server_version'), current_setting('server_version_num')::int"
                )
                && trace.service_of(s) == BACKUP_CONTROLLER
        ),
        "no SQL span of the backup-controller: {sql:#?}"
    );
    for s in &sql {
        let parent = trace.span(s.parent_id().unwrap()).unwrap();
        assert!(
            parent.operation_name.starts_with("reconcile ")
                || parent.operation_name.starts_with("store ")
                || parent.tag("db.system").is_some(),
            "SQL span {} under {}",
            s.operation_name,
            parent.operation_name
        );
    }

    // Store I/O of the dump, under the Backup's reconcile.
    for operation in [
        "store create_artifact",
        "store commit",
        "store put_manifest",
    ] {
        let span = trace
            .spans_of(BACKUP_CONTROLLER, operation)
            .next()
            .unwrap_or_else(|| panic!("no {operation} span"));
        let parent = trace.span(span.parent_id().unwrap()).unwrap();
        assert_eq!(parent.operation_name, "reconcile Backup");
        assert!(span.tag("store.location").unwrap().starts_with("file://"));
    }

    // The role was created in a trace of its own, then given its verifier in a statement
    // of its own (unlogged on the server), masked.
    let db_tags = all_tag_values(jaeger, DATABASE_CONTROLLER);
    let statements = |kind: &str| -> Vec<&String> {
        db_tags
            .iter()
            .filter(|(op, key, _)| op == kind && key == "db.statement")
            .map(|(_, _, statement)| statement)
            .collect()
    };
    let create_role = statements("CREATE ROLE");
    assert!(!create_role.is_empty(), "no CREATE ROLE span");
    for statement in &create_role {
        assert!(!statement.contains("PASSWORD"), "{statement}");
    }
    let alter_role = statements("ALTER ROLE");
    assert!(!alter_role.is_empty(), "no ALTER ROLE span");
    for statement in &alter_role {
        assert!(statement.contains("PASSWORD '***'"), "{statement}");
    }

    // No span attribute of either service holds a password or a verifier.
    let mut every = db_tags;
    every.extend(all_tag_values(jaeger, BACKUP_CONTROLLER));
    assert!(
        every.len() > 50,
        "too few tags to mean anything: {}",
        every.len()
    );
    for (op, key, value) in &every {
        assert!(
            !value.contains(&w.pg.test_admin_password()),
            "the admin password is in {op}/{key}"
        );
        assert!(
            !value.contains(&owner_password),
            "the owner password is in {op}/{key}"
        );
        assert!(
            !value.contains("SCRAM-SHA-256$"),
            "a verifier is in {op}/{key}"
        );
    }
}
