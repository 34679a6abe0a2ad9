//! What every step is handed and what it hands back: the controller's [`State`] (built
//! once in `main`), the [`Saga`] (one reconcile's view of one Migration, with its one
//! guarded status write and its Events) and a step's [`StepOutcome`].
//!
//! Depends on nothing of this crate but `error`, `debug` and `counts` (the baselines it
//! keeps): the saga driver (`saga/`) and the steps (`steps/`, `dump/`, `replication/`)
//! all stand on it.

use std::path::PathBuf;
use std::time::Duration;

use dbops_api::names::annotation;
use dbops_api::names::finalizer::MIGRATION_ROLLBACK as FINALIZER;
use dbops_api::{Database, Migration, MigrationStatus, MigrationStep};
use dbops_shared::controller::Context;
use dbops_shared::events::Recorder;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;
use dbops_shared::status::{Desired, Guard, Note, StatusWriter, Write};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use serde_json::json;

use crate::debug::{self, CrashPoint, Moment};
use crate::error::{Error, Result};

/// The field manager of this controller's writes (the Database's `spec.serverRef`).
pub const FIELD_MANAGER: &str = "dbops-migration-controller";

/// The migration-controller's own state.
pub struct State {
    pub servers: Servers,
    /// The DatabaseServers, their admin and CA Secrets (controllers' namespace) and the
    /// namespaces' labels: a `serverRef` resolved without an API call.
    pub directory: Directory,
    /// Every Database (of `--watch-namespace`), kept by the Database watch: Preflight
    /// counts those on the target for its `databasesPerNamespace` limit.
    pub databases: Store<Database>,
    pub recorder: Recorder,
    /// The one writer of Migration statuses in this process (`dbops_shared::status`).
    pub status_writer: StatusWriter<Migration>,
    pub index: DatabaseIndex,
    /// The `--pg-dump` and `--pg-restore` programs (the Logical mode's schema copy).
    pub pg_dump: PathBuf,
    pub pg_restore: PathBuf,
    /// Those and the programs of each `--pg-bin-dir`: CopyData takes the pair that suits
    /// the two servers (`pg_tools::pick_copy`).
    pub clients: dbops_shared::pg_tools::Clients,
    pub max_attempts: i32,
    /// Verify's counts taken before the freeze (`replication::baseline`), by Migration.
    pub baselines: crate::counts::Baselines,
    pub crash_at: Option<CrashPoint>,
    /// Testing only (`--debug-fail-at`): this step fails for good once its effects are
    /// done, so that a test can roll back from it.
    pub fail_at: Option<MigrationStep>,
    /// The controller's own metrics (saga steps, rollbacks).
    pub metrics: crate::metrics::MigrationMetrics,
}

/// Which Migrations name which Database: Migration → `spec.databaseRef`, kept up to date
/// by every reconcile, so a Database event maps to its Migrations.
pub type DatabaseIndex = dbops_shared::ref_index::RefIndex;

/// What a step's run came to.
#[derive(Debug)]
pub enum StepOutcome {
    /// Its effects are complete; the message goes into the step's record and an Event.
    Done(String),
    /// It waits for another object (a watch brings the reconcile back).
    Wait(String),
    /// It waits for a server (the replication's progress): run again after this long
    /// (at most the resync interval).
    Poll(String, Duration),
}

/// One reconcile's view of one Migration: the latest Migration (replaced after every
/// write), its API and the controller's context.
pub struct Saga<'a> {
    pub ctx: &'a Context<State>,
    pub api: Api<Migration>,
    pub namespace: String,
    pub m: Migration,
}

impl Saga<'_> {
    pub fn status(&self) -> MigrationStatus {
        self.m.status.clone().unwrap_or_default()
    }

    pub fn generation(&self) -> Option<i64> {
        self.m.metadata.generation
    }

    pub fn deleting(&self) -> bool {
        self.m.metadata.deletion_timestamp.is_some()
    }

    /// Writes `status` if it changed: [`Self::write`] without Events.
    pub async fn save(&mut self, status: MigrationStatus) -> Result<()> {
        self.write(Desired::new(status)).await
    }

    /// Writes `desired.status` if it changed, then publishes its Events (`desired.notes`,
    /// [`note`]), through the one status path of `dbops_shared::status` with
    /// [`Guard::ResourceVersion`]: the write holds only over the resourceVersion of
    /// [`Self::m`], the Migration as this reconcile last read or wrote it, so a stale view
    /// or a second replica never writes a decision made on an older status (a step never
    /// goes backwards). That is [`Error::Stale`]: retried with backoff, from a fresh read.
    pub async fn write(&mut self, desired: Desired<MigrationStatus>) -> Result<()> {
        if self.m.status.as_ref() == Some(&desired.status) {
            return Ok(());
        }
        let state = &self.ctx.state;
        let guard = Guard::ResourceVersion;
        let written = state
            .status_writer
            .write(&self.api, &self.m, desired, guard, &state.recorder, None)
            .await?;
        match written {
            Write::Written(m) => {
                self.m = *m;
                Ok(())
            }
            // The writer remembers writing this status, which the Migration as read does
            // not hold: another writer came between. Forget it and read again.
            Write::Unchanged => {
                self.forget_written();
                Err(Error::Stale)
            }
            Write::Conflict | Write::Gone => Err(Error::Stale),
        }
    }

    /// Drops what the status writer remembers of this Migration (its last write is seen,
    /// or it will not be written again).
    pub fn forget_written(&self) {
        if let Some(uid) = self.m.uid() {
            self.ctx.state.status_writer.forget(&uid);
        }
    }

    /// Records this reconcile's trace on the Migration (once, while it runs), so every
    /// later reconcile, and the objects it creates for the other controllers, join one
    /// trace for the whole Migration. Nothing is written when tracing is off.
    pub async fn adopt_trace(&mut self) -> Result<()> {
        if self.m.annotations().contains_key(annotation::TRACEPARENT) {
            return Ok(());
        }
        let Some((key, value)) = dbops_shared::telemetry::trace_annotation() else {
            return Ok(());
        };
        let patch = json!({"metadata": {"annotations": {key: value}}});
        self.m = self
            .api
            .patch(
                &self.m.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    /// Puts the finalizer `dbops.dev/migration-rollback` (a Migration deleted mid-flight
    /// is rolled back first, or once SwitchTraffic has begun, finished first) on (`present`) or takes it off, if needed.
    pub async fn set_finalizer(&mut self, present: bool) -> Result<()> {
        let has = self.m.finalizers().iter().any(|f| f == FINALIZER);
        if has == present {
            return Ok(());
        }
        dbops_shared::finalizer::set(&self.m, &self.api, FINALIZER, present).await?;
        if present {
            self.m = self.api.get(&self.m.name_any()).await?;
        }
        Ok(())
    }

    /// The Database this Migration moves: the one of its name, as long as it is the one
    /// Preflight recorded (a Database deleted and created again under that name since is
    /// another's, and this Migration sees none).
    pub async fn database(&self) -> Result<Option<Database>> {
        let api: Api<Database> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        let recorded = self.status().database_uid;
        Ok(api
            .get_opt(&self.m.spec.database_ref.name)
            .await?
            .filter(|db| recorded.is_none_or(|uid| db.uid().as_ref() == Some(&uid))))
    }

    /// Exits the process (code [`debug::DEBUG_EXIT_CODE`]) if `--debug-exit-at` names
    /// this point.
    pub fn crash_point(&self, step: MigrationStep, moment: Moment) {
        debug::crash_if(self.ctx.state.crash_at, CrashPoint { step, moment });
    }
}

/// An Event of the Migration (action `Migrate`), published once the status that implies
/// it is written ([`Saga::write`]).
pub fn note(normal: bool, reason: impl Into<String>, message: impl Into<String>) -> Note {
    let action = "Migrate";
    if normal {
        Note::normal(action, reason, message)
    } else {
        Note::warning(action, reason, message)
    }
}

/// The W3C trace context of this reconcile, for an object another controller acts on (it
/// continues the trace); empty when tracing is off.
pub fn trace_annotations() -> serde_json::Map<String, serde_json::Value> {
    dbops_shared::telemetry::trace_annotation()
        .map(|(k, v)| (k, serde_json::Value::String(v)))
        .into_iter()
        .collect()
}
