//! SwitchTraffic: the point of no return. Patches the Database's `spec.serverRef` to the
//! target and waits until it is Ready there at the new generation; then, when the source's
//! pooler held the database (`crate::pooled`), until every pooler instance routes it to
//! the target and has let its clients go on.

use dbops_api::{Database, condition};
use dbops_shared::status::Desired;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::context::{FIELD_MANAGER, Saga, StepOutcome, note, trace_annotations};
use crate::error::Result;

/// Needs no session: the target is named, not resolved, so the switch and its wait do not
/// depend on the server caches (but for a pooler's cutover, which resolves both servers).
pub async fn switch_traffic(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let target = saga.m.spec.target.server_ref.clone();
    let mut status = saga.status();
    let mut db = db.clone();
    if db.spec.server_ref != target {
        let databases: Api<Database> = Api::namespaced(saga.ctx.client.clone(), &saga.namespace);
        let mut metadata = json!({"name": db.name_any(), "annotations": trace_annotations()});
        // Only the Database Preflight recorded is moved, never one created again under
        // its name since (`Saga::database` sees none then): its UID is a precondition.
        if let Some(uid) = &status.database_uid {
            metadata["uid"] = json!(uid);
        }
        let patch = json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": metadata,
            "spec": {"serverRef": {"name": target.name}},
        });
        db = databases
            .patch(
                &db.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        status.switched_generation = db.metadata.generation;
        let switched = note(
            true,
            "TrafficSwitched",
            format!(
                "Database {} spec.serverRef now {}; waiting for it to be Ready there",
                db.name_any(),
                target.name
            ),
        );
        saga.write(Desired::new(status.clone()).with(switched))
            .await?;
    } else if status.switched_generation.is_none() {
        // Patched, then a crash before the record: this generation is at least the patched one.
        status.switched_generation = db.metadata.generation;
        saga.save(status.clone()).await?;
    }
    let generation = status.switched_generation.unwrap_or_default();
    if db.metadata.deletion_timestamp.is_some() {
        // Deleted after the switch: it will never be Ready there, and need not be; its
        // deletion policy applies on the target once this Migration ends. Whatever the
        // source's pooler held is let go (no route will follow a Database being deleted).
        let pooled = let_go(saga).await?.map(|m| format!("; {m}"));
        return Ok(StepOutcome::Done(format!(
            "Database {} now refers to DatabaseServer {} (generation {generation}) and is being deleted; its deletionPolicy applies there once this Migration ends{}",
            db.name_any(),
            target.name,
            pooled.unwrap_or_default()
        )));
    }
    if ready_at(&db, generation) {
        let pooled = match release(saga).await? {
            crate::pooled::Release::Waiting(message) => {
                return Ok(StepOutcome::Poll(message, crate::pooled::ROUTE_POLL));
            }
            crate::pooled::Release::Done(said) => said.map(|m| format!("; {m}")),
        };
        Ok(StepOutcome::Done(format!(
            "Database {} is Ready on DatabaseServer {} (generation {generation}); Secret {} points there{}",
            db.name_any(),
            target.name,
            db.connection_secret_name(),
            pooled.unwrap_or_default()
        )))
    } else {
        Ok(StepOutcome::Wait(format!(
            "waiting for Database {} to be Ready on DatabaseServer {} at generation {generation}",
            db.name_any(),
            target.name
        )))
    }
}

/// The source's pooler, if it held the database, routes it to the target and lets its
/// clients go on (`crate::pooled::release`).
async fn release(saga: &mut Saga<'_>) -> Result<crate::pooled::Release> {
    let held = saga.status().pooler.is_some_and(|p| p.holds());
    if !held {
        return Ok(crate::pooled::Release::Done(
            saga.status().pooler.and_then(|p| p.message),
        ));
    }
    let source = crate::servers::source_server(saga).await?;
    let target = crate::servers::target_server(saga).await?;
    Box::pin(crate::pooled::release(saga, &source, &target)).await
}

/// The source's pooler, if it holds the database still, resumes it where it routes it.
async fn let_go(saga: &mut Saga<'_>) -> Result<Option<String>> {
    let held = saga.status().pooler.is_some_and(|p| p.holds());
    if !held {
        return Ok(None);
    }
    let source = crate::servers::source_server(saga).await?;
    Box::pin(crate::pooled::let_go(saga, &source)).await
}

/// Whether `db` is Ready at `generation` or a later one.
fn ready_at(db: &Database, generation: i64) -> bool {
    db.status.as_ref().is_some_and(|s| {
        s.observed_generation.unwrap_or_default() >= generation
            && dbops_shared::conditions::get(&s.conditions, condition::READY).is_some_and(|c| {
                c.status == "True" && c.observed_generation.unwrap_or_default() >= generation
            })
    })
}
