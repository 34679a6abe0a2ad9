//! The Migration reconcile: the saga driver.
//!
//! Each reconcile reads the Migration fresh from the API (a status write carries the
//! resourceVersion it was computed from, so a stale view or a second replica gets a 409
//! instead of overwriting progress), then:
//!
//! 1. a finished Migration (Succeeded, Failed, RolledBack) only loses its finalizer;
//! 2. one not started yet is refused if another Migration of its Database is active;
//! 3. the finalizer `dbops.dev/migration-rollback` goes on before the first step, so a
//!    Migration deleted mid-flight is rolled back first (or, once SwitchTraffic has begun,
//!    finished first);
//! 4. then step after step: the step's record is written `Running` before its side
//!    effects and `Succeeded` after them; a step that must wait (the snapshot Backup, the
//!    Database Ready on the target) returns and its watch brings the reconcile back;
//! 5. a step that cannot succeed, or fails `--step-max-attempts` times, before
//!    SwitchTraffic starts the rollback: compensations in reverse order, each recorded as
//!    it completes, ending `RolledBack`. From SwitchTraffic on there is no way back:
//!    failures are retried with backoff.
//!
//! The step list is the mode's (`progress::saga_steps`): Dump's until Preflight records
//! the mode. A Manual cutover waits before SwitchTraffic in Dump mode and before
//! FreezeSource in Logical mode, where each reconcile (every resync interval) checks the
//! replication meanwhile and rolls back from Replicate when it fails.

use std::path::PathBuf;
use std::sync::Arc;

use dbops_api::{
    ChosenMode, Cutover, Database, Migration, MigrationPhase, MigrationStatus, MigrationStep,
};
use dbops_shared::controller::{Context, ReconcileError};
use dbops_shared::events::Recorder;
use dbops_shared::postgres::Servers;
use dbops_shared::server::Directory;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::Store;
use serde_json::json;

use crate::error::{Error, Result};
use crate::progress;
use crate::steps::{self, Outcome};

pub const FINALIZER: &str = "dbops.dev/migration-rollback";
pub const FIELD_MANAGER: &str = "dbops-migration-controller";

/// Where a hidden debug flag makes the process exit, to test resumption (see `main`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashPoint {
    pub step: MigrationStep,
    pub moment: Moment,
}

/// A moment of a step at which a [`CrashPoint`] can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// `started`: right after the step's Running record is written, before its side
    /// effects.
    Started,
    /// `slot-created` (Replicate only): right after CREATE SUBSCRIPTION created the
    /// replication slot on the source, before anything is recorded of it in status.
    SlotCreated,
    /// `done`: after its side effects, before its Succeeded record.
    Done,
}

impl Moment {
    pub fn as_str(self) -> &'static str {
        match self {
            Moment::Started => "started",
            Moment::SlotCreated => "slot-created",
            Moment::Done => "done",
        }
    }
}

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
    pub index: DatabaseIndex,
    /// The `--pg-dump` and `--pg-restore` programs (the Logical mode's schema copy).
    pub pg_dump: PathBuf,
    pub pg_restore: PathBuf,
    /// Those and the programs of each `--pg-bin-dir`: CopyData takes the pair that suits
    /// the two servers (`pg_tools::pick_copy`).
    pub clients: dbops_shared::pg_tools::Clients,
    pub max_attempts: i32,
    pub crash_at: Option<CrashPoint>,
    /// Testing only (`--debug-fail-at`): this step fails for good once its effects are
    /// done, so that a test can roll back from it.
    pub fail_at: Option<MigrationStep>,
}

/// Which Migrations name which Database: Migration → `spec.databaseRef`, kept up to date
/// by every reconcile, so a Database event maps to its Migrations.
pub type DatabaseIndex = dbops_shared::ref_index::RefIndex;

/// The entry point: see the module documentation.
pub async fn reconcile(obj: Arc<Migration>, ctx: Arc<Context<State>>) -> Result<Action> {
    let namespace = obj.namespace().unwrap_or_default();
    let api: Api<Migration> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(m) = api.get_opt(&obj.name_any()).await? else {
        ctx.state.index.forget(&namespace, &obj.name_any());
        return Ok(Action::await_change());
    };
    ctx.state
        .index
        .record(&namespace, &m.name_any(), &m.spec.database_ref.name);
    let mut saga = Saga {
        ctx: &ctx,
        api,
        namespace,
        m,
    };
    saga.run().await
}

/// One reconcile's view: the latest Migration (replaced after every write).
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

    fn generation(&self) -> Option<i64> {
        self.m.metadata.generation
    }

    fn deleting(&self) -> bool {
        self.m.metadata.deletion_timestamp.is_some()
    }

    /// Writes the status if it changed, guarded by the resourceVersion it was built on.
    pub async fn save(&mut self, status: MigrationStatus) -> Result<()> {
        if self.m.status.as_ref() == Some(&status) {
            return Ok(());
        }
        let patch = json!({
            "metadata": {"resourceVersion": self.m.resource_version()},
            "status": status,
        });
        self.m = self
            .api
            .patch_status(
                &self.m.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    pub async fn event(&self, normal: bool, reason: &str, note: &str) {
        dbops_shared::events::publish(
            &self.ctx.state.recorder,
            &self.m,
            normal,
            "Migrate",
            reason,
            note,
        )
        .await;
    }

    /// Records this reconcile's trace on the Migration (once, while it runs), so every
    /// later reconcile, and the objects it creates for the other controllers, join one
    /// trace for the whole Migration. Nothing is written when tracing is off.
    async fn adopt_trace(&mut self) -> Result<()> {
        if self
            .m
            .annotations()
            .contains_key(dbops_shared::telemetry::TRACEPARENT_ANNOTATION)
        {
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

    async fn set_finalizer(&mut self, present: bool) -> Result<()> {
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

    async fn run(&mut self) -> Result<Action> {
        let status = self.status();
        if progress::is_terminal(&status) {
            self.set_finalizer(false).await?;
            return Ok(Action::await_change());
        }
        if !progress::any_started(&status) && status.phase != Some(MigrationPhase::RollingBack) {
            if self.deleting() {
                self.set_finalizer(false).await?;
                return Ok(Action::await_change());
            }
            if let Some(other) = self.active_sibling().await? {
                let mut status = status;
                progress::refused(&mut status, self.generation(), &other);
                self.save(status).await?;
                self.event(
                    false,
                    "MigrationAlreadyActive",
                    &format!("refused: Migration {other} of the same Database is active"),
                )
                .await;
                return Ok(Action::await_change());
            }
        }
        if !self.deleting() {
            self.set_finalizer(true).await?;
            self.adopt_trace().await?;
        }
        self.drive().await
    }

    /// A Migration of the same Database that is active, or that was created first and
    /// has not ended (so two created at once never both run, nor both get refused).
    async fn active_sibling(&self) -> Result<Option<String>> {
        let all = self.api.list(&ListParams::default()).await?;
        let me = (
            self.m.metadata.creation_timestamp.clone(),
            self.m.name_any(),
        );
        Ok(all
            .items
            .into_iter()
            .filter(|o| o.spec.database_ref.name == self.m.spec.database_ref.name)
            .filter(|o| o.name_any() != self.m.name_any())
            .filter(|o| o.metadata.deletion_timestamp.is_none())
            .find(|o| {
                let s = o.status.clone().unwrap_or_default();
                if progress::is_terminal(&s) {
                    return false;
                }
                progress::any_started(&s)
                    || (o.metadata.creation_timestamp.clone(), o.name_any()) < me
            })
            .map(|o| o.name_any()))
    }

    /// Runs steps until one waits, fails or the saga ends.
    async fn drive(&mut self) -> Result<Action> {
        loop {
            let status = self.status();
            if status.phase == Some(MigrationPhase::RollingBack) {
                return self.roll_back().await;
            }
            let Some(step) = progress::next_step(&status) else {
                return self.finish().await;
            };
            let before_switch =
                !matches!(step, MigrationStep::SwitchTraffic | MigrationStep::Cleanup);
            let db = self.database().await?;
            let db_going = db
                .as_ref()
                .is_none_or(|d| d.metadata.deletion_timestamp.is_some());
            let switched = self.switched(&status, db.as_ref());
            // A Database deleted (or gone) before its server was switched: nothing is
            // gained by going on, and its deletion waits for this Migration. Roll back at
            // once, so the source is writable and the target clean again and the
            // Database's deletion policy then applies to the source.
            if db_going && progress::any_started(&status) && !switched {
                let mut status = status;
                let what = if db.is_some() {
                    "is being deleted"
                } else {
                    "is gone"
                };
                progress::begin_rollback(
                    &mut status,
                    step,
                    "DatabaseDeleted",
                    &format!(
                        "Database {} {what} and its server was not switched yet; the Migration is rolled back so that its deletion can proceed on the source",
                        self.m.spec.database_ref.name
                    ),
                    self.generation(),
                );
                self.start_rollback(status, step).await?;
                continue;
            }
            if self.deleting() && !progress::started(&status, MigrationStep::SwitchTraffic) {
                let mut status = status;
                progress::begin_rollback(
                    &mut status,
                    step,
                    "MigrationDeleted",
                    "the Migration was deleted before SwitchTraffic",
                    self.generation(),
                );
                self.start_rollback(status, step).await?;
                continue;
            }
            // Manual cutover: Dump waits after Verify (the source frozen), Logical while
            // replicating, before the freeze (the source writable).
            let approval_before = match status.mode {
                Some(ChosenMode::Logical) => MigrationStep::FreezeSource,
                _ => MigrationStep::SwitchTraffic,
            };
            if step == approval_before
                && self.m.spec.cutover == Cutover::Manual
                && !self.m.spec.approved
                && !progress::started(&status, step)
            {
                if status.mode == Some(ChosenMode::Logical) {
                    return self.await_approval_replicating(status).await;
                }
                return self.await_approval(status, step).await;
            }
            let db = match db {
                Some(db) => db,
                // Switched, then deleted and gone: the data is on the target; what is
                // left (the switch's wait, Cleanup) needs only the names in status.
                None if switched => {
                    self.finish_without_database(step).await?;
                    continue;
                }
                None if step == MigrationStep::Preflight => {
                    let mut status = status;
                    progress::pending(
                        &mut status,
                        self.generation(),
                        "DatabaseNotFound",
                        format!(
                            "Database {}/{} does not exist",
                            self.namespace, self.m.spec.database_ref.name
                        ),
                    );
                    self.save(status).await?;
                    return Ok(Action::requeue(self.ctx.resync_interval));
                }
                None => {
                    return Err(Error::transient(
                        "DatabaseNotFound",
                        format!("Database {} does not exist", self.m.spec.database_ref.name),
                    ));
                }
            };

            let mut status = status;
            progress::start(&mut status, step, self.generation());
            self.save(status).await?;
            self.crash_point(step, Moment::Started);

            let outcome = match steps::run(self, step, &db).await {
                Ok(Outcome::Done(_)) if self.ctx.state.fail_at == Some(step) => {
                    Err(injected_failure(step))
                }
                outcome => outcome,
            };
            match outcome {
                Ok(Outcome::Done(message)) => {
                    self.crash_point(step, Moment::Done);
                    self.succeeded(step, message).await?;
                }
                Ok(Outcome::Wait(message)) => {
                    let mut status = self.status();
                    progress::waiting(&mut status, step, message);
                    self.save(status).await?;
                    return Ok(Action::requeue(self.ctx.resync_interval));
                }
                Ok(Outcome::Poll(message, after)) => {
                    let mut status = self.status();
                    progress::waiting(&mut status, step, message);
                    self.save(status).await?;
                    return Ok(Action::requeue(after.min(self.ctx.resync_interval)));
                }
                Err(Error::Fatal { reason, message }) if before_switch => {
                    let mut status = self.status();
                    progress::begin_rollback(
                        &mut status,
                        step,
                        reason,
                        &message,
                        self.generation(),
                    );
                    self.start_rollback(status, step).await?;
                }
                Err(e) if e.counts_as_attempt() => {
                    let mut status = self.status();
                    let message = e.to_string();
                    let attempts = progress::attempt_failed(&mut status, step, message.clone());
                    if before_switch && attempts >= self.ctx.state.max_attempts {
                        progress::begin_rollback(
                            &mut status,
                            step,
                            e.reason(),
                            &format!("{message} (after {attempts} attempts)"),
                            self.generation(),
                        );
                        self.start_rollback(status, step).await?;
                        continue;
                    }
                    self.save(status).await?;
                    self.event(
                        false,
                        &format!("{}Retrying", step.as_str()),
                        &format!("attempt {attempts} failed: {message}"),
                    )
                    .await;
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether SwitchTraffic has changed the Database's server: recorded in status, or
    /// seen on the Database (patched, then a crash before the record).
    fn switched(&self, status: &MigrationStatus, db: Option<&Database>) -> bool {
        status.switched_generation.is_some()
            || (progress::started(status, MigrationStep::SwitchTraffic)
                && db.is_some_and(|d| d.spec.server_ref == self.m.spec.target.server_ref))
    }

    /// The steps left after the switch when the Database object is gone (it was deleted
    /// after SwitchTraffic): SwitchTraffic has nothing left to wait for; Cleanup works from
    /// the names Preflight recorded.
    async fn finish_without_database(&mut self, step: MigrationStep) -> Result<()> {
        let mut status = self.status();
        progress::start(&mut status, step, self.generation());
        self.save(status).await?;
        let message = match step {
            MigrationStep::Cleanup => steps::cleanup(self, None).await?,
            _ => format!(
                "Database {} was deleted after its server was switched to the target; nothing left to wait for",
                self.m.spec.database_ref.name
            ),
        };
        self.succeeded(step, message).await
    }

    /// Records the step Succeeded with `message`, its duration and an Event.
    async fn succeeded(&mut self, step: MigrationStep, message: String) -> Result<()> {
        let mut status = self.status();
        let seconds = progress::succeed(&mut status, step, message.clone());
        self.save(status).await?;
        if let Some(metrics) = self.ctx.metrics.migration() {
            metrics.observe_step(step.as_str(), seconds);
        }
        self.event(true, &format!("{}Succeeded", step.as_str()), &message)
            .await;
        Ok(())
    }

    /// Exits the process (code [`DEBUG_EXIT_CODE`]) if `--debug-exit-at` names this point.
    pub(crate) fn crash_point(&self, step: MigrationStep, moment: Moment) {
        let here = CrashPoint { step, moment };
        if self.ctx.state.crash_at == Some(here) {
            tracing::warn!(
                step = step.as_str(),
                moment = moment.as_str(),
                "--debug-exit-at reached: exiting now"
            );
            std::process::exit(DEBUG_EXIT_CODE);
        }
    }

    /// The Database this Migration moves: the one of its name, as long as it is the one
    /// Preflight recorded (a Database deleted and created again under that name since is
    /// another's, and this Migration sees none).
    async fn database(&self) -> Result<Option<Database>> {
        let api: Api<Database> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        let recorded = self.status().database_uid;
        Ok(api
            .get_opt(&self.m.spec.database_ref.name)
            .await?
            .filter(|db| recorded.is_none_or(|uid| db.uid().as_ref() == Some(&uid))))
    }

    async fn start_rollback(&mut self, status: MigrationStatus, step: MigrationStep) -> Result<()> {
        let (reason, message) = progress::failure(&status);
        self.save(status).await?;
        if let Some(metrics) = self.ctx.metrics.migration() {
            metrics.record_rollback(step.as_str());
        }
        self.event(
            false,
            "RollbackStarted",
            &format!("{reason}: {message}; undoing the steps that ran"),
        )
        .await;
        Ok(())
    }

    /// Compensations in reverse order, each recorded as done; then RolledBack.
    async fn roll_back(&mut self) -> Result<Action> {
        let db = self.database().await?;
        let mut pending: Option<(MigrationStep, Error)> = None;
        for step in progress::to_compensate(&self.status()) {
            if progress::is_compensated(&self.status(), step) {
                continue;
            }
            match steps::compensate(self, step, db.as_ref()).await {
                Ok(message) => {
                    let mut status = self.status();
                    progress::compensated(&mut status, step, message.clone());
                    self.save(status).await?;
                    self.event(true, &format!("{}Compensated", step.as_str()), &message)
                        .await;
                }
                // A server that cannot be reached holds up its own compensation only:
                // the others (above all unfreezing the source) go ahead; this one is
                // retried with backoff.
                Err(e) if pending.is_none() && !matches!(e, Error::Kube(_)) => {
                    pending = Some((step, e));
                }
                Err(e) => return Err(e),
            }
        }
        if let Some((step, e)) = pending {
            let mut status = self.status();
            progress::compensation_failed(&mut status, step, &e.to_string(), self.generation());
            self.save(status).await?;
            return Err(e);
        }
        let mut status = self.status();
        progress::rolled_back(&mut status, self.generation());
        self.save(status).await?;
        let (reason, message) = progress::failure(&self.status());
        self.event(
            false,
            "RolledBack",
            &format!("{reason}: {message}; every step that ran was undone"),
        )
        .await;
        self.set_finalizer(false).await?;
        Ok(Action::await_change())
    }

    async fn await_approval(
        &mut self,
        mut status: MigrationStatus,
        next: MigrationStep,
    ) -> Result<Action> {
        let first = status.phase != Some(MigrationPhase::AwaitingApproval);
        progress::awaiting_approval(&mut status, next, self.generation());
        self.save(status).await?;
        if first {
            self.event(
                true,
                "AwaitingApproval",
                progress::approval_message(self.status().mode),
            )
            .await;
        }
        Ok(Action::await_change())
    }

    /// Logical mode, Manual cutover: the replication goes on while the Migration waits
    /// for approval; each reconcile (every resync interval) checks it and records its
    /// progress, and a failure (an apply error, a schema change on the source) rolls the
    /// Migration back from Replicate.
    async fn await_approval_replicating(&mut self, status: MigrationStatus) -> Result<Action> {
        self.await_approval(status, MigrationStep::FreezeSource)
            .await?;
        match crate::replicate::watch_replication(self).await {
            Ok(()) => Ok(Action::requeue(self.ctx.resync_interval)),
            Err(Error::Fatal { reason, message }) => {
                let mut status = self.status();
                progress::begin_rollback(
                    &mut status,
                    MigrationStep::Replicate,
                    reason,
                    &message,
                    self.generation(),
                );
                self.start_rollback(status, MigrationStep::Replicate)
                    .await?;
                Box::pin(self.drive()).await
            }
            Err(e) => Err(e),
        }
    }

    async fn finish(&mut self) -> Result<Action> {
        let mut status = self.status();
        let message = format!(
            "Database {} now lives on DatabaseServer {}",
            self.m.spec.database_ref.name, self.m.spec.target.server_ref.name
        );
        progress::succeeded(&mut status, self.generation(), message.clone());
        self.save(status).await?;
        self.event(true, "Succeeded", &message).await;
        self.set_finalizer(false).await?;
        Ok(Action::await_change())
    }
}

/// The exit code of `--debug-exit-at`.
pub const DEBUG_EXIT_CODE: i32 = 86;

/// The failure `--debug-fail-at` puts in place of a step's success: fatal, so the
/// rollback begins at once.
fn injected_failure(step: MigrationStep) -> Error {
    tracing::warn!(
        step = step.as_str(),
        "--debug-fail-at reached: failing the step"
    );
    Error::fatal(
        "InjectedFailure",
        format!(
            "--debug-fail-at={}: the step's effects are done and it fails for good, as the test asked",
            step.as_str()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_maps_a_database_to_its_migrations() {
        let index = DatabaseIndex::default();
        index.record("shop", "m1", "orders");
        index.record("shop", "m2", "orders");
        index.record("other", "m1", "orders");
        let mut of = index.referrers_of("shop", "orders");
        of.sort();
        assert_eq!(of, ["m1", "m2"]);
        index.forget("shop", "m1");
        assert_eq!(index.referrers_of("shop", "orders"), ["m2"]);
        index.forget("shop", "m2");
        assert!(index.referrers_of("shop", "orders").is_empty());
        assert_eq!(index.referrers_of("other", "orders"), ["m1"]);
    }
}
