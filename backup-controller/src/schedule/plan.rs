//! What one reconcile does for a Database's schedule: the slot to take, the slots
//! skipped, the Backups retention prunes, the next slot. Pure.

use jiff::Timestamp;

use crate::schedule::cron::Schedule;
use crate::schedule::retention::{Prune, retention};
use crate::schedule::scheduled::Scheduled;

/// The Backup name of `database`'s slot `at`: `<database>-<YYYYMMDDHHMM>` (UTC).
pub fn backup_name(database: &str, at: Timestamp) -> String {
    format!("{database}-{}", at.strftime("%Y%m%d%H%M"))
}

/// The Backup to create for a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Take {
    pub slot: Timestamp,
    pub name: String,
    /// Slots between the newest scheduled Backup (or the Database's creation) and this
    /// one that get no Backup.
    pub skipped: u32,
}

/// What one reconcile does for a Database's schedule.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub take: Option<Take>,
    /// The slot is due but this scheduled Backup has not finished yet.
    pub waiting_for: Option<String>,
    pub prune: Vec<Prune>,
    /// The next slot after now.
    pub next: Option<Timestamp>,
}

/// Decides, from the clock and the Database's scheduled Backups, which slot to take and
/// which Backups to prune (see the module documentation). Pure.
pub fn plan(
    schedule: &Schedule,
    database: &str,
    created: Timestamp,
    now: Timestamp,
    existing: &[Scheduled],
    keep_last: Option<usize>,
) -> Plan {
    let newest = existing.iter().map(|b| b.slot).max();
    let due = schedule
        .latest_at_or_before(now)
        .filter(|slot| *slot >= created && newest.is_none_or(|newest| *slot > newest));
    let unfinished = existing
        .iter()
        .filter(|b| !b.finished() && !b.deleting)
        .max_by_key(|b| b.slot);
    let (take, waiting_for) = match (due, unfinished) {
        (Some(_), Some(busy)) => (None, Some(busy.name.clone())),
        (Some(slot), None) => {
            let skipped = match newest {
                Some(newest) => schedule.count_between(newest, slot),
                // Slots at the creation second count; the scan starts just before it.
                None => schedule.count_between(created - jiff::SignedDuration::from_secs(1), slot),
            };
            let take = Take {
                slot,
                name: backup_name(database, slot),
                skipped,
            };
            (Some(take), None)
        }
        (None, _) => (None, None),
    };
    Plan {
        take,
        waiting_for,
        prune: keep_last
            .map(|n| retention(existing, n))
            .unwrap_or_default(),
        next: schedule.next_after(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::{COMPLETED, RUNNING, at, every_minute, scheduled};

    #[test]
    fn names_come_from_the_slot() {
        assert_eq!(
            backup_name("orders", at("2026-11-22T03:07:00Z")),
            "orders-202611220307"
        );
    }

    #[test]
    fn the_first_slot_is_not_before_the_database_existed() {
        let created = at("2026-11-22T16:00:30Z");
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:00:50Z"),
            &[],
            None,
        );
        assert_eq!(p.take, None, "no backfill before the Database existed");
        assert_eq!(p.next, Some(at("2026-11-22T16:01:00Z")));
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:01:00.2Z"),
            &[],
            None,
        );
        let take = p.take.unwrap();
        assert_eq!(
            (take.name.as_str(), take.skipped),
            ("orders-202611221601", 0)
        );
        // A Database created exactly on a slot gets that slot.
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:00Z"),
            at("2026-11-22T16:00:10Z"),
            &[],
            None,
        );
        assert_eq!(p.take.unwrap().name, "orders-202611221600");
    }

    #[test]
    fn after_downtime_only_the_latest_slot_is_taken_and_the_others_are_counted() {
        let existing = [scheduled(
            "orders-202611221601",
            "2026-11-22T16:01:00Z",
            COMPLETED,
        )];
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:30Z"),
            at("2026-11-22T16:03:05Z"),
            &existing,
            None,
        );
        let take = p.take.unwrap();
        assert_eq!(take.name, "orders-202611221603");
        assert_eq!(take.slot, at("2026-11-22T16:03:00Z"));
        assert_eq!(take.skipped, 1, "16:02 was skipped");
        assert_eq!(p.next, Some(at("2026-11-22T16:04:00Z")));
    }

    #[test]
    fn a_slot_with_a_backup_or_older_than_the_newest_one_is_not_taken_again() {
        let created = at("2026-11-22T16:00:30Z");
        let existing = [scheduled(
            "orders-202611221603",
            "2026-11-22T16:03:00Z",
            COMPLETED,
        )];
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:03:40Z"),
            &existing,
            None,
        );
        assert_eq!(p.take, None);
        // A replica whose clock lags one minute behind.
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:02:59Z"),
            &existing,
            None,
        );
        assert_eq!(p.take, None);
        // A pruned (deleting) newer Backup still counts.
        let mut deleting = scheduled("orders-202611221604", "2026-11-22T16:04:00Z", COMPLETED);
        deleting.deleting = true;
        let p = plan(
            &every_minute(),
            "orders",
            created,
            at("2026-11-22T16:04:30Z"),
            &[deleting],
            None,
        );
        assert_eq!(p.take, None);
    }

    #[test]
    fn an_unfinished_scheduled_backup_holds_the_next_slot_back() {
        let existing = [scheduled(
            "orders-202611221601",
            "2026-11-22T16:01:00Z",
            RUNNING,
        )];
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:30Z"),
            at("2026-11-22T16:02:05Z"),
            &existing,
            Some(1),
        );
        assert_eq!(p.take, None);
        assert_eq!(p.waiting_for.as_deref(), Some("orders-202611221601"));
        let mut no_status = existing[0].clone();
        no_status.phase = None;
        let p = plan(
            &every_minute(),
            "orders",
            at("2026-11-22T16:00:30Z"),
            at("2026-11-22T16:02:05Z"),
            &[no_status],
            None,
        );
        assert_eq!(p.take, None);
    }
}
