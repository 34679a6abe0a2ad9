//! Settling: what a user would do to let things end (a failed final snapshot deleted to
//! try again), then waiting until every object has settled, and what had not.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Result;
use dbops_api::{Backup, BackupPhase, Database, Migration};
use dbops_shared::checksum::sha256_hex;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::{Resource, ResourceExt};

use super::world::{NS, World, ready_condition};

/// `Ready=False` reasons that no waiting changes: the Database has settled there.
const PERMANENT: [&str; 9] = [
    "BackupNotFound",
    "BackupFailed",
    "ChecksumMismatch",
    "ArtifactNotFound",
    "NameConflict",
    "SecretConflict",
    "DatabaseMissing",
    "QuotaExceeded",
    "FinalSnapshotConflict",
];
/// Of those, the ones nothing in this run should cause: nobody touches PostgreSQL, the
/// store or a connection Secret behind dbops' back, and names are never reused.
pub(crate) const UNEXPECTED: [&str; 5] = [
    "ChecksumMismatch",
    "ArtifactNotFound",
    "NameConflict",
    "SecretConflict",
    "DatabaseMissing",
];

/// An object that had not settled.
#[derive(Clone, Debug)]
pub(crate) struct Unsettled {
    pub kind: &'static str,
    pub name: String,
    pub deleting: Option<Timestamp>,
    pub detail: String,
}

impl Unsettled {
    pub fn controller(&self) -> &'static str {
        controller_of(self.kind)
    }
}

pub(crate) struct Objects {
    pub dbs: Vec<Database>,
    pub backups: Vec<Backup>,
    pub migrations: Vec<Migration>,
    pub secrets: Vec<Secret>,
}

pub(crate) async fn list(world: &World) -> Result<Objects> {
    let lp = ListParams::default();
    let c = &world.client;
    let dbs = Api::<Database>::namespaced(c.clone(), NS).list(&lp).await?;
    let backups = Api::<Backup>::namespaced(c.clone(), NS).list(&lp).await?;
    let migrations = Api::<Migration>::namespaced(c.clone(), NS)
        .list(&lp)
        .await?;
    super::watches::observe_lists(world, &dbs, &backups, &migrations);
    Ok(Objects {
        dbs: dbs.items,
        backups: backups.items,
        migrations: migrations.items,
        secrets: Api::<Secret>::namespaced(c.clone(), NS)
            .list(&lp)
            .await?
            .items,
    })
}

fn meta_line<K: Resource>(o: &K) -> String {
    let m = o.meta();
    format!(
        "generation {}, finalizers {:?}",
        m.generation.unwrap_or(0),
        m.finalizers.clone().unwrap_or_default()
    )
}

pub(crate) fn database_state(d: &Database) -> String {
    let s = d.status.clone().unwrap_or_default();
    let ready = ready_condition(&s.conditions)
        .map(|(st, r, m)| format!("Ready={st} {r}: {m}"))
        .unwrap_or_else(|| "no Ready condition".into());
    let others: Vec<String> = s
        .conditions
        .iter()
        .filter(|c| c.type_ != "Ready")
        .map(|c| format!("{}={} {}", c.type_, c.status, c.reason))
        .collect();
    format!(
        "phase {:?}, observedGeneration {:?}, {ready}; {}",
        s.phase,
        s.observed_generation,
        others.join(", ")
    )
}

/// Whether the Database's connection Secret holds the password it was written with
/// (a rotation asked by an edit is done).
pub(crate) fn secret_consistent(d: &Database, secrets: &[Secret]) -> Result<(), String> {
    let name = d.connection_secret_name();
    let Some(s) = secrets.iter().find(|s| s.name_any() == name) else {
        return Err(format!("Secret {name} missing"));
    };
    let get = |k: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
    };
    let (Some(password), Some(pg)) = (get("password"), get("PGPASSWORD")) else {
        return Err(format!("Secret {name} lacks password or PGPASSWORD"));
    };
    let recorded = s
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("dbops.dev/password-sha256"))
        .cloned()
        .unwrap_or_default();
    if password != pg || recorded != sha256_hex(password.as_bytes()) {
        return Err(format!(
            "Secret {name}: the edited password is not rotated yet (password and PGPASSWORD differ or the recorded hash does not match)"
        ));
    }
    Ok(())
}

fn unsettled_now(o: &Objects) -> Vec<Unsettled> {
    let mut out = Vec::new();
    for d in &o.dbs {
        let name = d.name_any();
        if let Some(ts) = &d.metadata.deletion_timestamp {
            out.push(Unsettled {
                kind: "Database",
                name,
                deleting: Some(ts.0),
                detail: format!(
                    "deletionTimestamp {}, {}, {}",
                    ts.0,
                    meta_line(d),
                    database_state(d)
                ),
            });
            continue;
        }
        let generation = d.metadata.generation;
        let status = d.status.clone().unwrap_or_default();
        let problem = if status.observed_generation != generation {
            Some(format!(
                "not observed at its generation: {}",
                database_state(d)
            ))
        } else {
            match ready_condition(&status.conditions) {
                Some(("True", _, _)) => secret_consistent(d, &o.secrets).err(),
                Some(("False", reason, _)) if PERMANENT.contains(&reason) => None,
                _ => Some(database_state(d)),
            }
        };
        if let Some(detail) = problem {
            out.push(Unsettled {
                kind: "Database",
                name,
                deleting: None,
                detail: format!("{detail}; {}", meta_line(d)),
            });
        }
    }
    // Databases in a permanent reported state (for example restored from a Backup that
    // the driver deleted meanwhile): a Backup of one waits, Pending with
    // WaitingForDatabase, until a person fixes the Database; that is settled too.
    let stuck_for_a_person: BTreeSet<String> = o
        .dbs
        .iter()
        .filter(|d| {
            d.metadata.deletion_timestamp.is_none()
                && d.status.as_ref().is_some_and(|s| {
                    s.observed_generation == d.metadata.generation
                        && matches!(
                            ready_condition(&s.conditions),
                            Some(("False", reason, _)) if PERMANENT.contains(&reason)
                        )
                })
        })
        .map(|d| d.name_any())
        .collect();
    for b in &o.backups {
        let phase = b.status.as_ref().and_then(|s| s.phase);
        let deleting = b.metadata.deletion_timestamp.as_ref().map(|t| t.0);
        let waits_for_a_person = phase == Some(BackupPhase::Pending)
            && stuck_for_a_person.contains(&b.spec.database_ref.name)
            && b.status.as_ref().is_some_and(|s| {
                matches!(
                    ready_condition(&s.conditions),
                    Some(("False", "WaitingForDatabase", _))
                )
            });
        if deleting.is_some()
            || !(matches!(phase, Some(BackupPhase::Completed | BackupPhase::Failed))
                || waits_for_a_person)
        {
            let cond = b
                .status
                .as_ref()
                .and_then(|s| ready_condition(&s.conditions))
                .map(|(st, r, m)| format!("Ready={st} {r}: {m}"))
                .unwrap_or_default();
            out.push(Unsettled {
                kind: "Backup",
                name: b.name_any(),
                deleting,
                detail: format!(
                    "phase {phase:?}{}, {}, {cond}",
                    deleting
                        .map(|t| format!(", deletionTimestamp {t}"))
                        .unwrap_or_default(),
                    meta_line(b)
                ),
            });
        }
    }
    for m in &o.migrations {
        let deleting = m.metadata.deletion_timestamp.as_ref().map(|t| t.0);
        if deleting.is_some() || !super::world::migration_terminal(m) {
            let s = m.status.clone().unwrap_or_default();
            out.push(Unsettled {
                kind: "Migration",
                name: m.name_any(),
                deleting,
                detail: format!(
                    "phase {:?}, step {:?}{}, {}, Database {}",
                    s.phase,
                    s.current_step,
                    deleting
                        .map(|t| format!(", deletionTimestamp {t}"))
                        .unwrap_or_default(),
                    meta_line(m),
                    m.spec.database_ref.name
                ),
            });
        }
    }
    out
}

/// What the Database's condition tells the user to do when the final snapshot of a
/// `Snapshot` deletion failed ("delete Backup <name> to try again"): the deletion waits
/// for a person, by design. The harness is that person.
async fn retry_failed_final_snapshots(world: &World, o: &Objects) {
    retry_final_snapshots(world, &o.dbs, &o.backups).await;
}

/// See [`retry_failed_final_snapshots`]; also what the driver does as a user.
pub(crate) async fn retry_final_snapshots(world: &World, dbs: &[Database], all: &[Backup]) {
    let backups: Api<Backup> = Api::namespaced(world.client.clone(), NS);
    for d in dbs
        .iter()
        .filter(|d| d.metadata.deletion_timestamp.is_some())
    {
        let uid = d.uid().unwrap_or_default();
        for b in all.iter().filter(|b| {
            b.labels().get("dbops.dev/final-snapshot-of") == Some(&uid)
                && b.status.as_ref().and_then(|s| s.phase) == Some(BackupPhase::Failed)
                && b.metadata.deletion_timestamp.is_none()
        }) {
            if backups
                .delete(&b.name_any(), &kube::api::DeleteParams::default())
                .await
                .is_ok()
            {
                world
                    .journal
                    .final_retries
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Ok(mut p) = world.waited_for_person.lock() {
                    p.insert(d.name_any());
                }
                world.journal.line(
                    "USER",
                    format!(
                        "Database {} waits for a person: its final Backup {} failed; deleting it, as the condition says, to try again",
                        d.name_any(),
                        b.name_any()
                    ),
                );
            }
        }
    }
}

/// Waits until every object has settled, at most `limit`; what had not.
pub(crate) async fn settle(world: &World, limit: Duration) -> Vec<Unsettled> {
    let deadline = Instant::now() + limit;
    let mut last_print = Instant::now();
    let mut last = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), list(world)).await {
            Ok(Ok(o)) => {
                last = unsettled_now(&o);
                if last.is_empty() {
                    return last;
                }
                retry_failed_final_snapshots(world, &o).await;
            }
            Ok(Err(e)) => world.journal.line("SETTLE", format!("cannot list: {e:#}")),
            Err(_) => world.journal.line("SETTLE", "listing timed out"),
        }
        if Instant::now() > deadline {
            return last;
        }
        if last_print.elapsed() > Duration::from_secs(30) {
            last_print = Instant::now();
            let some: Vec<String> = last
                .iter()
                .take(4)
                .map(|u| format!("{} {}: {}", u.kind, u.name, u.detail))
                .collect();
            world.journal.line(
                "SETTLE",
                format!("{} unsettled, e.g. {}", last.len(), some.join(" | ")),
            );
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

/// The controller that serves objects of `kind`.
pub(crate) fn controller_of(kind: &str) -> &'static str {
    match kind {
        "Database" => "database-controller",
        "Backup" => "backup-controller",
        _ => "migration-controller",
    }
}
