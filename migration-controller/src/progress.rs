//! The saga's progress in `status`, as pure functions: which step is next, and how a step
//! starting, finishing or failing, a rollback and the end change the status. The saga's
//! driver (`saga::drive`) writes each result before and after the step's side effects;
//! Preflight records the mode and CatchUp reads its step's record through it.

use dbops_api::MigrationReason as R;
use dbops_api::{
    ChosenMode, MigrationPhase, MigrationStatus, MigrationStep, StepState, StepStatus, condition,
};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, now, set_condition};

/// The condition saying which mode Preflight chose and why.
pub const MODE_CHOSEN: &str = "ModeChosen";

/// The steps of the Migration's mode in saga order: Dump's until Preflight has chosen
/// (Preflight is the first step of both).
pub fn saga_steps(status: &MigrationStatus) -> &'static [MigrationStep] {
    status.mode.unwrap_or(ChosenMode::Dump).steps()
}

/// Every step of the mode, Pending, in saga order (the list is complete from the first
/// write on, and replaced by the chosen mode's when Preflight records it).
pub fn initial_steps(steps: &[MigrationStep]) -> Vec<StepStatus> {
    steps
        .iter()
        .map(|&name| StepStatus {
            name,
            state: StepState::Pending,
            started_at: None,
            finished_at: None,
            message: None,
            failed_attempts: None,
        })
        .collect()
}

pub fn step(status: &MigrationStatus, name: MigrationStep) -> Option<&StepStatus> {
    status.steps.iter().find(|s| s.name == name)
}

fn step_mut(status: &mut MigrationStatus, name: MigrationStep) -> &mut StepStatus {
    let order = saga_steps(status);
    if !status
        .steps
        .iter()
        .map(|s| s.name)
        .eq(order.iter().copied())
    {
        let mut steps = initial_steps(order);
        for s in &mut steps {
            if let Some(old) = status.steps.iter().find(|o| o.name == s.name) {
                *s = old.clone();
            }
        }
        status.steps = steps;
    }
    match status.steps.iter().position(|s| s.name == name) {
        Some(at) => &mut status.steps[at],
        // A step of neither list is never asked for; recorded at the end if it is.
        None => {
            status.steps.extend(initial_steps(&[name]));
            let last = status.steps.len() - 1;
            &mut status.steps[last]
        }
    }
}

/// Records the mode Preflight chose: from then on the status lists its steps.
pub fn choose_mode(status: &mut MigrationStatus, mode: ChosenMode) {
    status.mode = Some(mode);
    let _ = step_mut(status, MigrationStep::Preflight);
}

/// Where the step is in the saga of the Migration's mode.
fn position(status: &MigrationStatus, name: MigrationStep) -> Option<usize> {
    saga_steps(status).iter().position(|s| *s == name)
}

/// The first step that has not succeeded, if any.
pub fn next_step(status: &MigrationStatus) -> Option<MigrationStep> {
    saga_steps(status)
        .iter()
        .copied()
        .find(|&name| step(status, name).is_none_or(|s| s.state != StepState::Succeeded))
}

/// Whether the step has begun (its effects may exist).
pub fn started(status: &MigrationStatus, name: MigrationStep) -> bool {
    step(status, name).is_some_and(|s| s.state != StepState::Pending)
}

/// Whether any step has begun.
pub fn any_started(status: &MigrationStatus) -> bool {
    MigrationStep::ALL.into_iter().any(|s| started(status, s))
}

/// Whether the phase is final.
pub fn is_terminal(status: &MigrationStatus) -> bool {
    status.phase.is_some_and(MigrationPhase::is_final)
}

/// Sets the three conditions at once.
pub fn conditions(
    status: &mut MigrationStatus,
    generation: Option<i64>,
    ready: (bool, &str, String),
    progressing: (bool, &str, String),
    failed: (bool, &str, String),
) {
    let t = now();
    for (type_, (value, reason, message)) in [
        (condition::READY, ready),
        (condition::PROGRESSING, progressing),
        (condition::FAILED, failed),
    ] {
        set_condition(
            &mut status.conditions,
            ConditionSpec {
                type_,
                status: ConditionStatus::from(value),
                reason,
                message,
                observed_generation: generation,
            },
            t.clone(),
        );
    }
    status.observed_generation = generation;
}

/// The step begins (or resumes: a step found Running keeps its start time).
pub fn start(status: &mut MigrationStatus, name: MigrationStep, generation: Option<i64>) {
    let s = step_mut(status, name);
    if s.state != StepState::Running {
        s.state = StepState::Running;
        s.started_at = Some(now());
        s.finished_at = None;
    }
    status.phase = Some(MigrationPhase::Running);
    status.current_step = Some(name);
    conditions(
        status,
        generation,
        (
            false,
            R::InProgress.as_str(),
            format!("step {} is running", name.as_str()),
        ),
        (
            true,
            name.as_str(),
            format!("step {} is running", name.as_str()),
        ),
        (false, R::NoFailure.as_str(), "no step has failed".into()),
    );
}

/// Notes what a running step is waiting for.
pub fn waiting(status: &mut MigrationStatus, name: MigrationStep, message: String) {
    step_mut(status, name).message = Some(message);
}

/// The step succeeded; returns its duration in seconds.
pub fn succeed(status: &mut MigrationStatus, name: MigrationStep, message: String) -> f64 {
    let t = now();
    let s = step_mut(status, name);
    s.state = StepState::Succeeded;
    s.message = Some(message);
    let seconds = s
        .started_at
        .as_ref()
        .map(|started| (t.0.as_millisecond() - started.0.as_millisecond()).max(0) as f64 / 1000.0)
        .unwrap_or_default();
    s.finished_at = Some(t);
    seconds
}

/// A retryable failure of the step; returns the failed attempts so far.
pub fn attempt_failed(status: &mut MigrationStatus, name: MigrationStep, message: String) -> i32 {
    let s = step_mut(status, name);
    let attempts = s.failed_attempts.unwrap_or_default() + 1;
    s.failed_attempts = Some(attempts);
    s.message = Some(message);
    attempts
}

/// The step failed for good: the rollback begins.
pub fn begin_rollback(
    status: &mut MigrationStatus,
    name: MigrationStep,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    let s = step_mut(status, name);
    s.state = StepState::Failed;
    if s.started_at.is_none() {
        s.started_at = Some(now());
    }
    s.finished_at = Some(now());
    s.message = Some(message.to_string());
    status.phase = Some(MigrationPhase::RollingBack);
    status.current_step = Some(name);
    status.failed_step = Some(name);
    conditions(
        status,
        generation,
        (
            false,
            R::RollingBack.as_str(),
            format!("rolling back after {} failed", name.as_str()),
        ),
        (
            true,
            R::RollingBack.as_str(),
            "undoing the steps that ran, in reverse order".into(),
        ),
        (true, reason, format!("{}: {message}", name.as_str())),
    );
}

/// The steps to compensate, latest first: every step that began, up to the failed one.
pub fn to_compensate(status: &MigrationStatus) -> Vec<MigrationStep> {
    let failed = status.failed_step.and_then(|f| position(status, f));
    saga_steps(status)
        .iter()
        .copied()
        .enumerate()
        .filter(|&(at, s)| started(status, s) && failed.is_none_or(|f| at <= f))
        .map(|(_, s)| s)
        .rev()
        .collect()
}

/// The compensation of a step is done. The failed step keeps its state Failed (the
/// message says it was compensated); the others become Compensated.
pub fn compensated(status: &mut MigrationStatus, name: MigrationStep, message: String) {
    let failed = status.failed_step == Some(name);
    let s = step_mut(status, name);
    if failed {
        if !s
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("compensated:")
        {
            s.message = Some(format!(
                "{}; compensated: {message}",
                s.message.as_deref().unwrap_or("failed")
            ));
        }
    } else {
        s.state = StepState::Compensated;
        s.message = Some(format!("compensated: {message}"));
    }
}

/// A compensation failed (it is retried); the others went ahead.
pub fn compensation_failed(
    status: &mut MigrationStatus,
    name: MigrationStep,
    message: &str,
    generation: Option<i64>,
) {
    let (reason, failure) = failure(status);
    conditions(
        status,
        generation,
        (
            false,
            R::RollingBack.as_str(),
            format!(
                "rolling back after {} failed",
                status.failed_step.map_or("a step", |s| s.as_str())
            ),
        ),
        (
            true,
            R::CompensationRetrying.as_str(),
            format!("undoing {} failed, retrying: {message}", name.as_str()),
        ),
        (true, &reason, failure),
    );
}

/// Whether the step's compensation is recorded as done.
pub fn is_compensated(status: &MigrationStatus, name: MigrationStep) -> bool {
    step(status, name).is_some_and(|s| {
        s.state == StepState::Compensated
            || (s.state == StepState::Failed
                && s.message
                    .as_deref()
                    .is_some_and(|m| m.contains("; compensated: ")))
    })
}

/// Every compensation ran.
pub fn rolled_back(status: &mut MigrationStatus, generation: Option<i64>) {
    let failed = status.failed_step.map(|s| s.as_str()).unwrap_or("a step");
    let (reason, message) = failure(status);
    status.phase = Some(MigrationPhase::RolledBack);
    conditions(
        status,
        generation,
        (
            false,
            R::RolledBack.as_str(),
            format!(
                "{failed} failed; every step that ran was undone; the source is writable again"
            ),
        ),
        (false, R::RolledBack.as_str(), "nothing left to do".into()),
        (true, &reason, message),
    );
}

/// The Failed condition's reason and message, as set when the rollback began.
pub fn failure(status: &MigrationStatus) -> (String, String) {
    dbops_shared::conditions::get(&status.conditions, condition::FAILED)
        .filter(|c| c.status == "True")
        .map(|c| (c.reason.clone(), c.message.clone()))
        .unwrap_or_else(|| (R::StepFailed.as_str().into(), "a step failed".into()))
}

/// The saga finished.
pub fn succeeded(status: &mut MigrationStatus, generation: Option<i64>, message: String) {
    status.phase = Some(MigrationPhase::Succeeded);
    conditions(
        status,
        generation,
        (true, R::Succeeded.as_str(), message),
        (false, R::Succeeded.as_str(), "nothing left to do".into()),
        (false, R::NoFailure.as_str(), "no step has failed".into()),
    );
}

/// What a Migration waiting for approval tells the user, by mode.
pub fn approval_message(mode: Option<ChosenMode>) -> &'static str {
    match mode {
        Some(ChosenMode::Logical) => {
            "the target is replicating and the source stays writable; set spec.approved: true to freeze the source, catch up and switch traffic"
        }
        _ => "the copy is verified; set spec.approved: true to switch traffic",
    }
}

/// Waiting for `spec.approved: true` before `next` (SwitchTraffic in Dump mode,
/// FreezeSource in Logical mode).
pub fn awaiting_approval(
    status: &mut MigrationStatus,
    next: MigrationStep,
    generation: Option<i64>,
) {
    status.phase = Some(MigrationPhase::AwaitingApproval);
    status.current_step = Some(next);
    let message = approval_message(status.mode);
    conditions(
        status,
        generation,
        (false, R::AwaitingApproval.as_str(), message.into()),
        (
            false,
            R::AwaitingApproval.as_str(),
            "waiting for spec.approved: true (cutover: Manual)".into(),
        ),
        (false, R::NoFailure.as_str(), "no step has failed".into()),
    );
}

/// Refused: another Migration of the same Database is active.
pub fn refused(status: &mut MigrationStatus, generation: Option<i64>, other: &str) {
    status.phase = Some(MigrationPhase::Failed);
    let message = format!(
        "Migration {other} of the same Database is active; only one Migration per Database may run. Nothing was changed."
    );
    conditions(
        status,
        generation,
        (false, R::MigrationAlreadyActive.as_str(), message.clone()),
        (false, R::MigrationAlreadyActive.as_str(), "refused".into()),
        (true, R::MigrationAlreadyActive.as_str(), message),
    );
}

/// Preflight cannot begin yet (for example the Database is not Ready).
pub fn pending(status: &mut MigrationStatus, generation: Option<i64>, reason: R, message: String) {
    status.phase = Some(MigrationPhase::Pending);
    conditions(
        status,
        generation,
        (false, reason.as_str(), message.clone()),
        (true, reason.as_str(), message),
        (false, R::NoFailure.as_str(), "no step has failed".into()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> MigrationStatus {
        MigrationStatus {
            steps: initial_steps(&MigrationStep::DUMP),
            ..MigrationStatus::default()
        }
    }

    #[test]
    fn steps_run_in_saga_order() {
        let mut s = fresh();
        assert_eq!(next_step(&s), Some(MigrationStep::Preflight));
        start(&mut s, MigrationStep::Preflight, Some(1));
        assert_eq!(
            next_step(&s),
            Some(MigrationStep::Preflight),
            "running, not done"
        );
        succeed(&mut s, MigrationStep::Preflight, "ok".into());
        assert_eq!(next_step(&s), Some(MigrationStep::Snapshot));
        for step in MigrationStep::DUMP {
            start(&mut s, step, Some(1));
            succeed(&mut s, step, "ok".into());
        }
        assert_eq!(next_step(&s), None);
    }

    #[test]
    fn the_logical_mode_lists_its_own_steps_once_preflight_chose_it() {
        let mut s = MigrationStatus::default();
        start(&mut s, MigrationStep::Preflight, Some(1));
        let names = |s: &MigrationStatus| s.steps.iter().map(|x| x.name).collect::<Vec<_>>();
        assert_eq!(names(&s), MigrationStep::DUMP, "Dump's list until chosen");
        choose_mode(&mut s, ChosenMode::Logical);
        assert_eq!(names(&s), MigrationStep::LOGICAL);
        assert_eq!(
            step(&s, MigrationStep::Preflight).unwrap().state,
            StepState::Running,
            "the Preflight record is kept"
        );
        succeed(&mut s, MigrationStep::Preflight, "ok".into());
        for next in [
            MigrationStep::Snapshot,
            MigrationStep::ProvisionTarget,
            MigrationStep::Replicate,
        ] {
            assert_eq!(next_step(&s), Some(next));
            start(&mut s, next, Some(1));
            succeed(&mut s, next, "ok".into());
        }
        start(&mut s, MigrationStep::FreezeSource, Some(1));
        begin_rollback(&mut s, MigrationStep::FreezeSource, "X", "y", Some(1));
        assert_eq!(
            to_compensate(&s),
            [
                MigrationStep::FreezeSource,
                MigrationStep::Replicate,
                MigrationStep::ProvisionTarget,
                MigrationStep::Snapshot,
                MigrationStep::Preflight
            ],
            "FreezeSource comes after ProvisionTarget in Logical mode"
        );
    }

    #[test]
    fn a_resumed_step_keeps_its_start_time() {
        let mut s = fresh();
        start(&mut s, MigrationStep::Preflight, Some(1));
        let first = step(&s, MigrationStep::Preflight)
            .unwrap()
            .started_at
            .clone();
        start(&mut s, MigrationStep::Preflight, Some(1));
        assert_eq!(
            step(&s, MigrationStep::Preflight).unwrap().started_at,
            first
        );
    }

    #[test]
    fn a_rollback_compensates_what_began_latest_first_and_ends_rolled_back() {
        let mut s = fresh();
        for step in [
            MigrationStep::Preflight,
            MigrationStep::Snapshot,
            MigrationStep::FreezeSource,
        ] {
            start(&mut s, step, Some(1));
            succeed(&mut s, step, "ok".into());
        }
        start(&mut s, MigrationStep::ProvisionTarget, Some(1));
        begin_rollback(
            &mut s,
            MigrationStep::ProvisionTarget,
            "ServerUnreachable",
            "target down",
            Some(1),
        );
        assert_eq!(s.phase, Some(MigrationPhase::RollingBack));
        assert_eq!(
            to_compensate(&s),
            [
                MigrationStep::ProvisionTarget,
                MigrationStep::FreezeSource,
                MigrationStep::Snapshot,
                MigrationStep::Preflight
            ]
        );
        for step in to_compensate(&s) {
            assert!(!is_compensated(&s, step));
            compensated(&mut s, step, "undone".into());
            assert!(is_compensated(&s, step));
        }
        let failed = step(&s, MigrationStep::ProvisionTarget).unwrap();
        assert_eq!(failed.state, StepState::Failed);
        assert_eq!(
            step(&s, MigrationStep::FreezeSource).unwrap().state,
            StepState::Compensated
        );
        rolled_back(&mut s, Some(1));
        assert_eq!(s.phase, Some(MigrationPhase::RolledBack));
        assert_eq!(s.failed_step, Some(MigrationStep::ProvisionTarget));
        let (reason, _) = failure(&s);
        assert_eq!(reason, "ServerUnreachable");
        assert!(is_terminal(&s));
    }

    #[test]
    fn failed_attempts_are_counted() {
        let mut s = fresh();
        start(&mut s, MigrationStep::CopyData, Some(1));
        assert_eq!(
            attempt_failed(&mut s, MigrationStep::CopyData, "x".into()),
            1
        );
        assert_eq!(
            attempt_failed(&mut s, MigrationStep::CopyData, "y".into()),
            2
        );
    }
}
