//! What the scheduler's unit tests share.

use dbops_api::BackupPhase;
use jiff::Timestamp;

use crate::schedule::cron::{Schedule, parse_schedule};
use crate::schedule::scheduled::Scheduled;

pub fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

pub fn every_minute() -> Schedule {
    parse_schedule("* * * * *").unwrap()
}

pub fn scheduled(name: &str, slot: &str, phase: Option<BackupPhase>) -> Scheduled {
    Scheduled {
        name: name.to_string(),
        uid: format!("uid-{name}"),
        slot: at(slot),
        phase,
        deleting: false,
        owned_by_database: false,
    }
}

pub const COMPLETED: Option<BackupPhase> = Some(BackupPhase::Completed);
pub const FAILED: Option<BackupPhase> = Some(BackupPhase::Failed);
pub const RUNNING: Option<BackupPhase> = Some(BackupPhase::Running);
