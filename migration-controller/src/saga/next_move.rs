//! What the saga does next, decided: a pure function of the Migration, its status and its
//! Database ([`next_move`]), and of a failed step's attempts ([`gives_up`]). `drive`
//! executes the move; every decision is tested here without a cluster.

use dbops_api::{
    ChosenMode, Cutover, Database, Migration, MigrationPhase, MigrationReason, MigrationStatus,
    MigrationStep,
};

use crate::progress;

/// The Database of the Migration, as far as the decision knows it.
#[derive(Debug, Clone, Copy)]
pub enum DatabaseView<'a> {
    /// Not read yet: [`next_move`] asks for it ([`Move::ReadDatabase`]) only when its
    /// decision depends on it.
    Unread,
    /// Read: no Database of that name, or one of another UID than Preflight recorded.
    Gone,
    /// Read: the Database.
    Found(&'a Database),
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Move {
    /// The decision depends on the Database: read it (a GET) and decide again.
    ReadDatabase,
    /// The Migration is rolling back: run the compensations (`rollback`).
    Compensate,
    /// Every step has succeeded: the Migration ends Succeeded.
    Finish,
    /// Start the rollback from `step`.
    RollBack {
        step: MigrationStep,
        reason: MigrationReason,
        message: String,
    },
    /// Manual cutover: wait for `spec.approved` before `next`; `replicating` in the
    /// Logical mode, whose replication is checked meanwhile.
    AwaitApproval {
        next: MigrationStep,
        replicating: bool,
    },
    /// The Database was deleted after its server was switched: `step` (the switch's wait,
    /// Cleanup) finishes from the names in status.
    FinishWithoutDatabase(MigrationStep),
    /// Preflight found no Database: Pending, looked at again after the resync interval.
    DatabaseNotFound,
    /// No Database where the saga needs one and none of the above applies: retried.
    DatabaseMissing,
    /// Run `step` on the Database (its Running record first).
    Run(MigrationStep),
}

/// The next move of the Migration `m` with `status` (the latest written) and its Database.
pub fn next_move(m: &Migration, status: &MigrationStatus, db: DatabaseView<'_>) -> Move {
    if status.phase == Some(MigrationPhase::RollingBack) {
        return Move::Compensate;
    }
    let Some(step) = progress::next_step(status) else {
        return Move::Finish;
    };
    let db = match db {
        DatabaseView::Unread => return Move::ReadDatabase,
        DatabaseView::Gone => None,
        DatabaseView::Found(db) => Some(db),
    };
    let switched = switched(m, status, db);
    // A Database deleted (or gone) before its server was switched: nothing is gained by
    // going on, and its deletion waits for this Migration. Roll back at once, so the
    // source is writable and the target clean again and the Database's deletion policy
    // then applies to the source.
    let db_going = db.is_none_or(|d| d.metadata.deletion_timestamp.is_some());
    if db_going && progress::any_started(status) && !switched {
        let what = if db.is_some() {
            "is being deleted"
        } else {
            "is gone"
        };
        return Move::RollBack {
            step,
            reason: MigrationReason::DatabaseDeleted,
            message: format!(
                "Database {} {what} and its server was not switched yet; the Migration is rolled back so that its deletion can proceed on the source",
                m.spec.database_ref.name
            ),
        };
    }
    if m.metadata.deletion_timestamp.is_some()
        && !progress::started(status, MigrationStep::SwitchTraffic)
    {
        return Move::RollBack {
            step,
            reason: MigrationReason::MigrationDeleted,
            message: "the Migration was deleted before SwitchTraffic".into(),
        };
    }
    // Manual cutover: Dump waits after Verify (the source frozen), Logical while
    // replicating, before the freeze (the source writable).
    let logical = status.mode == Some(ChosenMode::Logical);
    let approval_before = if logical {
        MigrationStep::FreezeSource
    } else {
        MigrationStep::SwitchTraffic
    };
    if step == approval_before
        && m.spec.cutover == Cutover::Manual
        && !m.spec.approved
        && !progress::started(status, step)
    {
        return Move::AwaitApproval {
            next: step,
            replicating: logical,
        };
    }
    match db {
        Some(_) => Move::Run(step),
        None if switched => Move::FinishWithoutDatabase(step),
        None if step == MigrationStep::Preflight => Move::DatabaseNotFound,
        None => Move::DatabaseMissing,
    }
}

/// Whether SwitchTraffic has changed the Database's server: recorded in status, or seen
/// on the Database (patched, then a crash before the record).
pub fn switched(m: &Migration, status: &MigrationStatus, db: Option<&Database>) -> bool {
    status.switched_generation.is_some()
        || (progress::started(status, MigrationStep::SwitchTraffic)
            && db.is_some_and(|d| d.spec.server_ref == m.spec.target.server_ref))
}

/// Whether a failure of `step` can still roll the Migration back: before SwitchTraffic,
/// the point of no return.
pub fn before_switch(step: MigrationStep) -> bool {
    !matches!(step, MigrationStep::SwitchTraffic | MigrationStep::Cleanup)
}

/// Whether the Migration gives `step` up after `attempts` failed attempts (and rolls
/// back): only before the switch, after `max_attempts`; from the switch on it retries.
pub fn gives_up(step: MigrationStep, attempts: i32, max_attempts: i32) -> bool {
    before_switch(step) && attempts >= max_attempts
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_api::MigrationStep::*;
    use serde_json::json;

    fn migration(spec: serde_json::Value, deleted: bool) -> Migration {
        let mut spec_json = json!({
            "databaseRef": {"name": "orders"},
            "target": {"serverRef": {"name": "pg-17"}},
        });
        for (k, v) in spec.as_object().into_iter().flatten() {
            spec_json[k] = v.clone();
        }
        let mut metadata = json!({"name": "m", "namespace": "shop", "finalizers": ["x"]});
        if deleted {
            metadata["deletionTimestamp"] = json!("2026-11-25T04:00:00Z");
        }
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Migration",
            "metadata": metadata,
            "spec": spec_json,
        }))
        .unwrap()
    }

    fn database(server: &str, deleting: bool) -> Database {
        let mut metadata = json!({"name": "orders", "namespace": "shop", "uid": "d1"});
        if deleting {
            metadata["deletionTimestamp"] = json!("2026-11-25T04:00:00Z");
            metadata["finalizers"] = json!(["x"]);
        }
        serde_json::from_value(json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Database",
            "metadata": metadata,
            "spec": {"serverRef": {"name": server}},
        }))
        .unwrap()
    }

    /// A status in `mode` whose steps before `running` succeeded and `running` began.
    fn status_at(mode: ChosenMode, running: MigrationStep) -> MigrationStatus {
        let mut status = MigrationStatus::default();
        progress::choose_mode(&mut status, mode);
        for &step in mode.steps() {
            progress::start(&mut status, step, Some(1));
            if step == running {
                break;
            }
            progress::succeed(&mut status, step, "done".into());
        }
        status
    }

    fn plain() -> Migration {
        migration(json!({}), false)
    }

    #[test]
    fn a_new_migration_reads_its_database_then_runs_preflight_or_waits_for_it() {
        let fresh = MigrationStatus::default();
        let db = database("pg-16", false);
        assert_eq!(
            next_move(&plain(), &fresh, DatabaseView::Unread),
            Move::ReadDatabase
        );
        assert_eq!(
            next_move(&plain(), &fresh, DatabaseView::Found(&db)),
            Move::Run(Preflight)
        );
        assert_eq!(
            next_move(&plain(), &fresh, DatabaseView::Gone),
            Move::DatabaseNotFound
        );
    }

    #[test]
    fn rolling_back_and_finishing_need_no_database() {
        let mut status = status_at(ChosenMode::Dump, CopyData);
        let verify_failed = MigrationReason::VerifyFailed.as_str();
        progress::begin_rollback(&mut status, CopyData, verify_failed, "differ", Some(1));
        assert_eq!(
            next_move(&plain(), &status, DatabaseView::Unread),
            Move::Compensate
        );
        let mut done = status_at(ChosenMode::Dump, Cleanup);
        progress::succeed(&mut done, Cleanup, "done".into());
        assert_eq!(
            next_move(&plain(), &done, DatabaseView::Unread),
            Move::Finish
        );
    }

    #[test]
    fn a_database_going_away_before_the_switch_rolls_the_migration_back() {
        let copying = status_at(ChosenMode::Dump, CopyData);
        let deleting = database("pg-16", true);
        for (db, what) in [
            (DatabaseView::Found(&deleting), "is being deleted"),
            (DatabaseView::Gone, "is gone"),
        ] {
            match next_move(&plain(), &copying, db) {
                Move::RollBack {
                    step,
                    reason,
                    message,
                } => {
                    assert_eq!((step, reason), (CopyData, MigrationReason::DatabaseDeleted));
                    assert!(message.contains(what), "{message}");
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        // Once switched, a Database gone only leaves the rest to finish from status.
        let mut switched = status_at(ChosenMode::Dump, SwitchTraffic);
        switched.switched_generation = Some(3);
        assert_eq!(
            next_move(&plain(), &switched, DatabaseView::Gone),
            Move::FinishWithoutDatabase(SwitchTraffic)
        );
        // Patched, then a crash before the record: the Database on the target says so.
        let patched = status_at(ChosenMode::Dump, SwitchTraffic);
        let there = database("pg-17", true);
        assert_eq!(
            next_move(&plain(), &patched, DatabaseView::Found(&there)),
            Move::Run(SwitchTraffic)
        );
    }

    #[test]
    fn a_deleted_migration_rolls_back_only_before_the_switch() {
        let deleted = migration(json!({}), true);
        let db = database("pg-16", false);
        let verifying = status_at(ChosenMode::Dump, Verify);
        assert_eq!(
            next_move(&deleted, &verifying, DatabaseView::Found(&db)),
            Move::RollBack {
                step: Verify,
                reason: MigrationReason::MigrationDeleted,
                message: "the Migration was deleted before SwitchTraffic".into(),
            }
        );
        let switching = status_at(ChosenMode::Dump, SwitchTraffic);
        assert_eq!(
            next_move(&deleted, &switching, DatabaseView::Found(&db)),
            Move::Run(SwitchTraffic)
        );
    }

    #[test]
    fn a_manual_cutover_waits_before_the_switch_in_dump_and_before_the_freeze_in_logical() {
        let manual = migration(json!({"cutover": "Manual"}), false);
        let approved = migration(json!({"cutover": "Manual", "approved": true}), false);
        let db = database("pg-16", false);
        let automatic = plain();
        let mut verified = status_at(ChosenMode::Dump, Verify);
        progress::succeed(&mut verified, Verify, "same".into());
        let mut replicated = status_at(ChosenMode::Logical, Replicate);
        progress::succeed(&mut replicated, Replicate, "lag 0".into());
        let freezing = status_at(ChosenMode::Logical, FreezeSource);
        let cases = [
            (
                &manual,
                &verified,
                Move::AwaitApproval {
                    next: SwitchTraffic,
                    replicating: false,
                },
            ),
            (&approved, &verified, Move::Run(SwitchTraffic)),
            (&automatic, &verified, Move::Run(SwitchTraffic)),
            (
                &manual,
                &replicated,
                Move::AwaitApproval {
                    next: FreezeSource,
                    replicating: true,
                },
            ),
            // A freeze already begun (approved, then the approval withdrawn) goes on.
            (&manual, &freezing, Move::Run(FreezeSource)),
        ];
        for (i, (m, status, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                next_move(m, status, DatabaseView::Found(&db)),
                want,
                "case {i}"
            );
        }
    }

    #[test]
    fn failures_give_up_after_the_attempts_only_before_the_switch() {
        assert!(!gives_up(CopyData, 2, 3));
        assert!(gives_up(CopyData, 3, 3));
        assert!(gives_up(Preflight, 1, 1));
        assert!(
            !gives_up(SwitchTraffic, 10, 3),
            "past the point of no return"
        );
        assert!(!gives_up(Cleanup, 10, 3));
        assert!(before_switch(CatchUp) && !before_switch(SwitchTraffic));
    }
}
