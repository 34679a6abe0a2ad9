//! The hidden testing flags: `--debug-exit-at` ([`CrashPoint`]: exit at a moment of a
//! step, to prove that a new process resumes from there) and `--debug-fail-at` (a step
//! fails for good once its effects are done, to prove the rollback from there).

use dbops_api::{MigrationReason, MigrationStep};

use crate::error::Error;

/// The exit code of `--debug-exit-at`.
pub const DEBUG_EXIT_CODE: i32 = 86;

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
    /// `subscription-paused` (FreezeSource only, Logical mode): right after Verify's
    /// counts paused the subscription, before they enable it again.
    SubscriptionPaused,
    /// `done`: after its side effects, before its Succeeded record.
    Done,
}

impl Moment {
    pub fn as_str(self) -> &'static str {
        match self {
            Moment::Started => "started",
            Moment::SlotCreated => "slot-created",
            Moment::SubscriptionPaused => "subscription-paused",
            Moment::Done => "done",
        }
    }
}

/// Exits the process (code [`DEBUG_EXIT_CODE`]) if `--debug-exit-at` (`crash_at`) names
/// `here`.
pub fn crash_if(crash_at: Option<CrashPoint>, here: CrashPoint) {
    if crash_at == Some(here) {
        tracing::warn!(
            step = here.step.as_str(),
            moment = here.moment.as_str(),
            "--debug-exit-at reached: exiting now"
        );
        std::process::exit(DEBUG_EXIT_CODE);
    }
}

/// The failure `--debug-fail-at` puts in place of a step's success: fatal, so the
/// rollback begins at once.
pub fn injected_failure(step: MigrationStep) -> Error {
    tracing::warn!(
        step = step.as_str(),
        "--debug-fail-at reached: failing the step"
    );
    Error::step(
        MigrationReason::InjectedFailure,
        format!(
            "--debug-fail-at={}: the step's effects are done and it fails for good, as the test asked",
            step.as_str()
        ),
    )
}

fn parse_step(step: &str) -> Result<MigrationStep, String> {
    MigrationStep::ALL
        .into_iter()
        .find(|s| s.as_str() == step)
        .ok_or_else(|| format!("unknown step {step:?}"))
}

/// `--debug-exit-at`: `<Step>:started`, `<Step>:done`, `Replicate:slot-created` or
/// `FreezeSource:subscription-paused`.
pub fn parse_crash_point(value: &str) -> Result<CrashPoint, String> {
    let (step, point) = value
        .split_once(':')
        .ok_or_else(|| format!("expected <Step>:started or <Step>:done, got {value:?}"))?;
    let step = parse_step(step)?;
    let moment = match point {
        "started" => Moment::Started,
        "done" => Moment::Done,
        "slot-created" if step == MigrationStep::Replicate => Moment::SlotCreated,
        "slot-created" => return Err("slot-created is a moment of Replicate only".into()),
        "subscription-paused" if step == MigrationStep::FreezeSource => Moment::SubscriptionPaused,
        "subscription-paused" => {
            return Err("subscription-paused is a moment of FreezeSource only".into());
        }
        other => {
            return Err(format!(
                "expected started, done, slot-created or subscription-paused, got {other:?}"
            ));
        }
    };
    Ok(CrashPoint { step, moment })
}

/// `--debug-fail-at`: a step before SwitchTraffic.
pub fn parse_fail_point(value: &str) -> Result<MigrationStep, String> {
    let step = parse_step(value)?;
    if matches!(step, MigrationStep::SwitchTraffic | MigrationStep::Cleanup) {
        return Err(format!(
            "{value} is past the point of no return: a failure there is retried, never rolled back"
        ));
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_debug_exit_point_names_a_step_and_a_moment() {
        assert_eq!(
            parse_crash_point("CopyData:done"),
            Ok(CrashPoint {
                step: MigrationStep::CopyData,
                moment: Moment::Done
            })
        );
        assert_eq!(
            parse_crash_point("Preflight:started"),
            Ok(CrashPoint {
                step: MigrationStep::Preflight,
                moment: Moment::Started
            })
        );
        assert_eq!(
            parse_crash_point("Replicate:slot-created"),
            Ok(CrashPoint {
                step: MigrationStep::Replicate,
                moment: Moment::SlotCreated
            })
        );
        assert_eq!(
            parse_crash_point("FreezeSource:subscription-paused"),
            Ok(CrashPoint {
                step: MigrationStep::FreezeSource,
                moment: Moment::SubscriptionPaused
            })
        );
        assert!(parse_crash_point("Replicate:subscription-paused").is_err());
        assert!(parse_crash_point("CopyData:slot-created").is_err());
        assert!(parse_crash_point("Copy:done").is_err());
        assert!(parse_crash_point("CopyData").is_err());
        assert!(parse_crash_point("CopyData:later").is_err());
    }

    #[test]
    fn a_failure_is_injected_only_before_the_point_of_no_return() {
        assert_eq!(parse_fail_point("CatchUp"), Ok(MigrationStep::CatchUp));
        assert_eq!(parse_fail_point("Preflight"), Ok(MigrationStep::Preflight));
        assert!(parse_fail_point("SwitchTraffic").is_err());
        assert!(parse_fail_point("Cleanup").is_err());
        assert!(parse_fail_point("Replicate:done").is_err());
    }
}
