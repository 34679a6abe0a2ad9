//! The driver: what application teams do, at random, all the time: Databases created
//! (three deletion policies, some with a schedule, some restored from a Backup), edited
//! (connection limit, deletion policy, schedule, the connection Secret's password) and
//! deleted; Backups created and deleted; Migrations created (both directions, Automatic
//! or Manual), approved and deleted. Refusals and API errors are counted, not fatal.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result};
use dbops_api::{Backup, BackupPhase, Database, Migration};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::json;

use super::world::{NS, World, is_ready, migration_terminal};
use super::writer::Writers;

/// Most Backups and Migrations kept around (older ones are deleted first).
const MAX_BACKUPS: usize = 40;
const MAX_MIGRATIONS: usize = 10;
/// Most Migrations running at once (each dumps and restores).
const MAX_ACTIVE_MIGRATIONS: usize = 3;

#[derive(Clone, Copy, Debug)]
enum Action {
    CreateDatabase,
    DeleteDatabase,
    EditConnectionLimit,
    EditDeletionPolicy,
    ToggleSchedule,
    RotatePassword,
    CreateBackup,
    DeleteBackup,
    CreateMigration,
    ApproveMigration,
    DeleteMigration,
}

struct Snapshot {
    dbs: Vec<Database>,
    backups: Vec<Backup>,
    migrations: Vec<Migration>,
}

struct Driver {
    world: Arc<World>,
    writers: Arc<Writers>,
    rng: StdRng,
    seq: u64,
    max_databases: usize,
    dbs: Api<Database>,
    backups: Api<Backup>,
    migrations: Api<Migration>,
    secrets: Api<Secret>,
}

pub(crate) async fn run(world: Arc<World>, writers: Arc<Writers>, max_databases: usize, seed: u64) {
    let client = world.client.clone();
    let mut d = Driver {
        world: world.clone(),
        writers,
        rng: StdRng::seed_from_u64(seed),
        seq: 0,
        max_databases,
        dbs: Api::namespaced(client.clone(), NS),
        backups: Api::namespaced(client.clone(), NS),
        migrations: Api::namespaced(client.clone(), NS),
        secrets: Api::namespaced(client, NS),
    };
    let mut last_list_error = std::time::Instant::now() - Duration::from_secs(60);
    loop {
        let gap = Duration::from_millis(d.rng.random_range(300..2000));
        if world.nap(gap).await {
            return;
        }
        let snap = match tokio::time::timeout(Duration::from_secs(20), d.snapshot()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                if last_list_error.elapsed() > Duration::from_secs(10) {
                    world.journal.line("DRIVER", format!("cannot list: {e:#}"));
                    last_list_error = std::time::Instant::now();
                }
                continue;
            }
            Err(_) => continue,
        };
        // A user reads the conditions: a Snapshot deletion whose final Backup failed
        // asks for that Backup to be deleted.
        super::settle::retry_final_snapshots(&world, &snap.dbs, &snap.backups).await;
        let Some(action) = d.choose(&snap) else {
            continue;
        };
        let done = tokio::time::timeout(Duration::from_secs(30), d.act(action, &snap)).await;
        let done = match done {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("timed out")),
        };
        world.journal.actions.fetch_add(1, Ordering::Relaxed);
        match done {
            Ok(what) => world.journal.line("ACTION", what),
            Err(e) => {
                world.journal.action_errors.fetch_add(1, Ordering::Relaxed);
                world
                    .journal
                    .line("ACTION-ERR", format!("{action:?}: {}", one_line(&e)));
            }
        }
    }
}

/// Merge-patches the object `name` (the error as the apiserver gives it: the journal's
/// lines name the action already).
async fn merge<K>(api: &Api<K>, name: &str, patch: serde_json::Value) -> kube::Result<K>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
}

fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

impl Driver {
    async fn snapshot(&self) -> Result<Snapshot> {
        let lp = ListParams::default();
        let (dbs, backups, migrations) = (
            self.dbs.list(&lp).await?,
            self.backups.list(&lp).await?,
            self.migrations.list(&lp).await?,
        );
        super::watches::observe_lists(&self.world, &dbs, &backups, &migrations);
        Ok(Snapshot {
            dbs: dbs.items,
            backups: backups.items,
            migrations: migrations.items,
        })
    }

    fn pick<'a, T>(&mut self, items: &[&'a T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            Some(items[self.rng.random_range(0..items.len())])
        }
    }

    fn choose(&mut self, s: &Snapshot) -> Option<Action> {
        let live: Vec<&Database> = s
            .dbs
            .iter()
            .filter(|d| d.metadata.deletion_timestamp.is_none())
            .collect();
        let ready = live.iter().filter(|d| is_ready(d)).count();
        let active = s
            .migrations
            .iter()
            .filter(|m| !migration_terminal(m))
            .count();
        let awaiting = s.migrations.iter().any(|m| {
            m.spec.cutover == dbops_api::Cutover::Manual
                && !m.spec.approved
                && m.metadata.deletion_timestamp.is_none()
        });
        let mut options: Vec<(u32, Action)> = Vec::new();
        if live.len() < self.max_databases {
            options.push((20, Action::CreateDatabase));
        }
        if live.len() > self.max_databases / 4 {
            options.push((9, Action::DeleteDatabase));
        }
        if !live.is_empty() {
            options.push((10, Action::EditConnectionLimit));
            options.push((3, Action::EditDeletionPolicy));
            options.push((5, Action::ToggleSchedule));
            options.push((12, Action::CreateBackup));
        }
        if ready > 0 {
            options.push((8, Action::RotatePassword));
            if active < MAX_ACTIVE_MIGRATIONS {
                options.push((8, Action::CreateMigration));
            }
        }
        if !s.backups.is_empty() {
            let w = if s.backups.len() > MAX_BACKUPS { 30 } else { 5 };
            options.push((w, Action::DeleteBackup));
        }
        if awaiting {
            options.push((6, Action::ApproveMigration));
        }
        if !s.migrations.is_empty() {
            let w = if s.migrations.len() > MAX_MIGRATIONS {
                20
            } else {
                2
            };
            options.push((w, Action::DeleteMigration));
        }
        let total: u32 = options.iter().map(|(w, _)| w).sum();
        if total == 0 {
            return None;
        }
        let mut roll = self.rng.random_range(0..total);
        for (w, a) in options {
            if roll < w {
                return Some(a);
            }
            roll -= w;
        }
        None
    }

    async fn act(&mut self, action: Action, s: &Snapshot) -> Result<String> {
        let live: Vec<&Database> = s
            .dbs
            .iter()
            .filter(|d| d.metadata.deletion_timestamp.is_none())
            .collect();
        let ready: Vec<&Database> = live.iter().copied().filter(|d| is_ready(d)).collect();
        match action {
            Action::CreateDatabase => self.create_database(s).await,
            Action::DeleteDatabase => {
                let d = self.pick(&live).context("none")?;
                self.dbs
                    .delete(&d.name_any(), &DeleteParams::default())
                    .await?;
                Ok(format!(
                    "delete Database {} (policy {:?}, on {})",
                    d.name_any(),
                    d.spec.deletion_policy,
                    d.spec.server_ref.name
                ))
            }
            Action::EditConnectionLimit => {
                let d = self.pick(&live).context("none")?;
                let limit = [-1, 10, 20, 50, 100][self.rng.random_range(0..5)];
                self.edit_spec(d, "connectionLimit", d.spec.connection_limit, limit)
                    .await
            }
            Action::EditDeletionPolicy => {
                let d = self.pick(&live).context("none")?;
                let policy = ["Retain", "Delete", "Snapshot"][self.rng.random_range(0..3)];
                let was = format!("{:?}", d.spec.deletion_policy);
                self.edit_spec(d, "deletionPolicy", was, policy).await
            }
            Action::ToggleSchedule => {
                let d = self.pick(&live).context("none")?;
                let (patch, what) = if d.spec.backup.is_some() {
                    (
                        json!({"spec": {"backup": null}}),
                        "schedule removed".to_string(),
                    )
                } else {
                    let keep = self.rng.random_range(1..=3);
                    let on_deletion = if self.rng.random_bool(0.5) {
                        "Retain"
                    } else {
                        "Delete"
                    };
                    (
                        json!({"spec": {"backup": {"schedule": "* * * * *", "retention": {"keepLast": keep}, "onDatabaseDeletion": on_deletion}}}),
                        format!(
                            "schedule every minute, keepLast {keep}, onDatabaseDeletion {on_deletion}"
                        ),
                    )
                };
                merge(&self.dbs, &d.name_any(), patch).await?;
                Ok(format!("Database {}: {what}", d.name_any()))
            }
            Action::RotatePassword => {
                let d = self.pick(&ready).context("none")?;
                let secret = format!("{}-connection", d.name_any());
                let password = crate::bed::random_password();
                merge(
                    &self.secrets,
                    &secret,
                    json!({"stringData": {"password": password}}),
                )
                .await?;
                Ok(format!("Secret {secret}: password edited (rotation asked)"))
            }
            Action::CreateBackup => {
                let d = self.pick(&live).context("none")?;
                self.seq += 1;
                let name = format!("bk-{:04}", self.seq);
                let policy = if self.rng.random_bool(0.5) {
                    "Retain"
                } else {
                    "Delete"
                };
                let retries = self.rng.random_range(0..=3);
                let b: Backup = serde_json::from_value(json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
                    "metadata": {"name": name},
                    "spec": {"databaseRef": {"name": d.name_any()}, "deletionPolicy": policy, "maxRetries": retries}
                }))?;
                self.backups.create(&PostParams::default(), &b).await?;
                Ok(format!(
                    "create Backup {name} of {} (policy {policy}, maxRetries {retries})",
                    d.name_any()
                ))
            }
            Action::DeleteBackup => {
                let all: Vec<&Backup> = s
                    .backups
                    .iter()
                    .filter(|b| b.metadata.deletion_timestamp.is_none())
                    .collect();
                // Over the bound: the oldest first.
                let b = if s.backups.len() > MAX_BACKUPS {
                    all.iter()
                        .min_by_key(|b| b.metadata.creation_timestamp.clone().map(|t| t.0))
                        .copied()
                } else {
                    self.pick(&all)
                }
                .context("none")?;
                self.backups
                    .delete(&b.name_any(), &DeleteParams::default())
                    .await?;
                Ok(format!(
                    "delete Backup {} (policy {:?}, phase {:?})",
                    b.name_any(),
                    b.spec.deletion_policy,
                    b.status.as_ref().and_then(|s| s.phase)
                ))
            }
            Action::CreateMigration => {
                let busy: Vec<&str> = s
                    .migrations
                    .iter()
                    .filter(|m| !migration_terminal(m))
                    .map(|m| m.spec.database_ref.name.as_str())
                    .collect();
                let free: Vec<&Database> = ready
                    .iter()
                    .copied()
                    .filter(|d| !busy.contains(&d.name_any().as_str()))
                    .collect();
                let d = self
                    .pick(&free)
                    .context("no Ready Database without a Migration")?;
                let from = d.spec.server_ref.name.clone();
                let to = if from == "chaos-a" {
                    "chaos-b"
                } else {
                    "chaos-a"
                };
                let manual = self.rng.random_bool(0.25);
                self.seq += 1;
                let name = format!("mig-{:04}", self.seq);
                let m: Migration = serde_json::from_value(json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "Migration",
                    "metadata": {"name": name},
                    "spec": {
                        "databaseRef": {"name": d.name_any()},
                        "target": {"serverRef": {"name": to}},
                        "cutover": if manual { "Manual" } else { "Automatic" },
                        "sourceRetention": "Drop",
                    }
                }))?;
                // The writer first: rows committed before the freeze must arrive.
                self.writers
                    .ensure(&self.world, &d.name_any(), &d.uid().unwrap_or_default());
                self.migrations.create(&PostParams::default(), &m).await?;
                Ok(format!(
                    "create Migration {name}: {} {from} -> {to} ({})",
                    d.name_any(),
                    if manual { "Manual" } else { "Automatic" }
                ))
            }
            Action::ApproveMigration => {
                let waiting: Vec<&Migration> = s
                    .migrations
                    .iter()
                    .filter(|m| m.spec.cutover == dbops_api::Cutover::Manual && !m.spec.approved)
                    .collect();
                let m = self.pick(&waiting).context("none")?;
                merge(
                    &self.migrations,
                    &m.name_any(),
                    json!({"spec": {"approved": true}}),
                )
                .await?;
                Ok(format!(
                    "approve Migration {} (phase {:?})",
                    m.name_any(),
                    m.status.as_ref().and_then(|s| s.phase)
                ))
            }
            Action::DeleteMigration => {
                let all: Vec<&Migration> = s
                    .migrations
                    .iter()
                    .filter(|m| m.metadata.deletion_timestamp.is_none())
                    .collect();
                let finished: Vec<&Migration> = all
                    .iter()
                    .copied()
                    .filter(|m| migration_terminal(m))
                    .collect();
                // Mostly finished ones; now and then one in flight (rolled back or finished
                // first, by the controller's rules).
                let m = if !finished.is_empty() && self.rng.random_bool(0.8) {
                    self.pick(&finished)
                } else {
                    self.pick(&all)
                }
                .context("none")?;
                self.migrations
                    .delete(&m.name_any(), &DeleteParams::default())
                    .await?;
                Ok(format!(
                    "delete Migration {} (phase {:?})",
                    m.name_any(),
                    m.status.as_ref().and_then(|s| s.phase)
                ))
            }
        }
    }

    /// Sets `spec.<field>` of `d` from `was` to `to`; the action as the journal says it.
    async fn edit_spec(
        &self,
        d: &Database,
        field: &str,
        was: impl std::fmt::Display,
        to: impl serde::Serialize + std::fmt::Display,
    ) -> Result<String> {
        merge(&self.dbs, &d.name_any(), json!({"spec": {field: &to}})).await?;
        Ok(format!("Database {}: {field} {was} -> {to}", d.name_any()))
    }

    async fn create_database(&mut self, s: &Snapshot) -> Result<String> {
        self.seq += 1;
        let name = format!("db-{:04}", self.seq);
        let server = if self.rng.random_bool(0.5) {
            "chaos-a"
        } else {
            "chaos-b"
        };
        let policy =
            ["Retain", "Delete", "Delete", "Snapshot", "Snapshot"][self.rng.random_range(0..5)];
        let limit = [-1, -1, 10, 50][self.rng.random_range(0..4)];
        let mut spec = json!({
            "serverRef": {"name": server},
            "deletionPolicy": policy,
            "connectionLimit": limit,
        });
        let mut what = format!("create Database {name} on {server} (policy {policy}");
        if self.rng.random_bool(0.2) {
            spec["extensions"] = json!(["pgcrypto"]);
            what.push_str(", pgcrypto");
        }
        if self.rng.random_bool(0.25) {
            let keep = self.rng.random_range(1..=3);
            spec["backup"] = json!({"schedule": "* * * * *", "retention": {"keepLast": keep}});
            what.push_str(&format!(", every minute keepLast {keep}"));
        }
        let completed: Vec<&Backup> = s
            .backups
            .iter()
            .filter(|b| b.status.as_ref().and_then(|s| s.phase) == Some(BackupPhase::Completed))
            .collect();
        if self.rng.random_bool(0.12)
            && let Some(b) = self.pick(&completed)
        {
            spec["restoreFrom"] = json!({"backupRef": {"name": b.name_any()}});
            what.push_str(&format!(", restored from {}", b.name_any()));
        }
        what.push(')');
        let db: Database = serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": name},
            "spec": spec,
        }))?;
        self.dbs.create(&PostParams::default(), &db).await?;
        Ok(what)
    }
}

/// Once the faults stop: schedules removed (they would make Backups for ever) and every
/// Manual Migration approved, so that everything can end.
pub(crate) async fn quiesce(world: &World) {
    let dbs: Api<Database> = Api::namespaced(world.client.clone(), NS);
    let migrations: Api<Migration> = Api::namespaced(world.client.clone(), NS);
    for attempt in 0..10 {
        let mut failed = false;
        match dbs.list(&ListParams::default()).await {
            Ok(list) => {
                for d in list.items.iter().filter(|d| d.spec.backup.is_some()) {
                    let r = merge(&dbs, &d.name_any(), json!({"spec": {"backup": null}})).await;
                    failed |= r.is_err() && d.metadata.deletion_timestamp.is_none();
                    world.journal.line(
                        "QUIESCE",
                        format!("Database {}: schedule removed", d.name_any()),
                    );
                }
            }
            Err(_) => failed = true,
        }
        match migrations.list(&ListParams::default()).await {
            Ok(list) => {
                for m in list
                    .items
                    .iter()
                    .filter(|m| m.spec.cutover == dbops_api::Cutover::Manual && !m.spec.approved)
                {
                    let r = merge(
                        &migrations,
                        &m.name_any(),
                        json!({"spec": {"approved": true}}),
                    )
                    .await;
                    failed |= r.is_err();
                    world
                        .journal
                        .line("QUIESCE", format!("Migration {}: approved", m.name_any()));
                }
            }
            Err(_) => failed = true,
        }
        if !failed {
            return;
        }
        world.journal.line(
            "QUIESCE",
            format!("attempt {} incomplete, again", attempt + 1),
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}
