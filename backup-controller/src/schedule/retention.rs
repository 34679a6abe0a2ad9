//! Retention (`keepLast: N`): which scheduled Backups go. Pure.

use dbops_api::BackupPhase;

use crate::schedule::scheduled::Scheduled;

/// A Backup that retention deletes, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prune {
    pub name: String,
    pub uid: String,
    pub why: String,
}

/// The scheduled Backups that `keepLast: keep` deletes: Completed ones beyond the
/// `keep` newest, and Failed ones older than the newest Completed one. Pure.
pub fn retention(existing: &[Scheduled], keep: usize) -> Vec<Prune> {
    let mut live: Vec<&Scheduled> = existing.iter().filter(|b| !b.deleting).collect();
    // Newest first; the name breaks ties so that the order is total.
    live.sort_by(|a, b| b.slot.cmp(&a.slot).then_with(|| b.name.cmp(&a.name)));
    let completed: Vec<&Scheduled> = live
        .iter()
        .copied()
        .filter(|b| b.phase == Some(BackupPhase::Completed))
        .collect();
    let newest_completed = completed.first().map(|b| b.slot);
    let mut prune: Vec<Prune> = completed
        .iter()
        .skip(keep)
        .map(|b| Prune {
            name: b.name.clone(),
            uid: b.uid.clone(),
            why: format!("Completed and older than the {keep} newest completed scheduled Backups"),
        })
        .collect();
    if let Some(newest_completed) = newest_completed {
        prune.extend(
            live.iter()
                .filter(|b| b.phase == Some(BackupPhase::Failed) && b.slot < newest_completed)
                .map(|b| Prune {
                    name: b.name.clone(),
                    uid: b.uid.clone(),
                    why: "Failed and older than the newest completed scheduled Backup".to_string(),
                }),
        );
    }
    prune
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::plan::plan;
    use crate::schedule::testing::{COMPLETED, FAILED, RUNNING, at, every_minute, scheduled};

    #[test]
    fn retention_keeps_the_newest_completed_and_never_touches_unfinished_ones() {
        let existing = [
            scheduled("b1", "2026-11-22T16:01:00Z", COMPLETED),
            scheduled("b2", "2026-11-22T16:02:00Z", FAILED),
            scheduled("b3", "2026-11-22T16:03:00Z", COMPLETED),
            scheduled("b4", "2026-11-22T16:04:00Z", COMPLETED),
            scheduled("b5", "2026-11-22T16:05:00Z", FAILED),
            scheduled("b6", "2026-11-22T16:06:00Z", RUNNING),
            scheduled("b0", "2026-11-22T16:00:00Z", None),
        ];
        let names = |keep| {
            retention(&existing, keep)
                .into_iter()
                .map(|p| p.name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(1), ["b3", "b1", "b2"]);
        assert_eq!(names(2), ["b1", "b2"]);
        assert_eq!(
            names(3),
            ["b2"],
            "a Failed one older than the newest Completed goes"
        );
        assert_eq!(names(10), ["b2"]);
        let pruned = retention(&existing, 1);
        assert_eq!(pruned[0].uid, "uid-b3");
        // Already being deleted: not deleted again (no write on converged state).
        let mut deleting = existing.to_vec();
        for b in &mut deleting {
            b.deleting = b.name != "b4";
        }
        assert!(retention(&deleting, 1).is_empty());
        // Only Failed ones and no Completed one: nothing to compare with, all stay.
        let failed = [scheduled("f1", "2026-11-22T16:01:00Z", FAILED)];
        assert!(retention(&failed, 1).is_empty());
        // Without retention nothing is pruned.
        let p = plan(
            &every_minute(),
            "x",
            at("2026-11-22T15:00:00Z"),
            at("2026-11-22T16:06:30Z"),
            &existing,
            None,
        );
        assert!(p.prune.is_empty());
    }
}
