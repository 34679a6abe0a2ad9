//! Snapshot: the Backup `<migration>-snapshot`, owned by the Migration; waits for it. Its
//! compensation keeps it as the rollback point.

use dbops_api::names::{annotation, label};
use dbops_api::{Backup, BackupPhase, Database, MigrationReason, condition};
use kube::api::{Api, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::context::{Saga, StepOutcome, trace_annotations};
use crate::error::{Error, Result};

/// The snapshot Backup dumps this very Database (its UID), and continues the trace.
fn snapshot_annotations(db: &Database) -> serde_json::Map<String, serde_json::Value> {
    let mut annotations = trace_annotations();
    annotations.insert(
        annotation::DATABASE_UID.to_string(),
        serde_json::Value::String(db.uid().unwrap_or_default()),
    );
    annotations
}

pub async fn snapshot(saga: &mut Saga<'_>, db: &Database) -> Result<StepOutcome> {
    let name = format!("{}-snapshot", saga.m.name_any());
    let backups: Api<Backup> = Api::namespaced(saga.ctx.client.clone(), &saga.namespace);
    let backup = match backups.get_opt(&name).await? {
        Some(b) => b,
        None => {
            let owner = saga.m.controller_owner_ref(&()).map(|r| vec![r]);
            let b: Backup = serde_json::from_value(json!({
                "apiVersion": "dbops.dev/v1alpha1",
                "kind": "Backup",
                "metadata": {
                    "name": name,
                    "namespace": saga.namespace,
                    "labels": {label::MIGRATION: saga.m.name_any()},
                    "annotations": snapshot_annotations(db),
                    "ownerReferences": owner,
                },
                "spec": {"databaseRef": {"name": db.name_any()}, "deletionPolicy": "Retain"},
            }))
            .map_err(|e| Error::step(MigrationReason::InternalError, e.to_string()))?;
            match backups.create(&PostParams::default(), &b).await {
                Ok(b) => b,
                Err(kube::Error::Api(e)) if e.code == 409 => backups.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    let ours = backup
        .owner_references()
        .iter()
        .any(|r| Some(&r.uid) == saga.m.metadata.uid.as_ref());
    if !ours {
        return Err(Error::step(
            MigrationReason::NameConflict,
            format!("Backup {name} exists and does not belong to this Migration"),
        ));
    }
    let mut status = saga.status();
    if status.snapshot_ref.is_none() {
        status.snapshot_ref = Some(dbops_api::LocalObjectReference { name: name.clone() });
        saga.save(status).await?;
    }
    let backup_status = backup.status.clone().unwrap_or_default();
    match backup_status.phase {
        Some(BackupPhase::Completed) => Ok(StepOutcome::Done(format!(
            "Backup {name} completed ({} bytes, sha256 {})",
            backup_status.size_bytes.unwrap_or_default(),
            backup_status.checksum.as_deref().unwrap_or("?")
        ))),
        Some(BackupPhase::Failed) => {
            let why = dbops_shared::conditions::get(&backup_status.conditions, condition::FAILED)
                .map(|c| format!("{}: {}", c.reason, c.message))
                .unwrap_or_else(|| "no reason given".into());
            Err(Error::step(
                MigrationReason::SnapshotFailed,
                format!("snapshot Backup {name} failed ({why})"),
            ))
        }
        phase => Ok(StepOutcome::Wait(format!(
            "waiting for snapshot Backup {name} ({})",
            phase.map_or("not started".to_string(), |p| format!("{p:?}"))
        ))),
    }
}
