//! Across PostgreSQL major versions (issue 13), against a real control plane, the three
//! controllers and real servers of the oldest and newest supported majors and two between
//! (`PgServer::start_major`: Debian's 15, the others pinned in `e2e/postgres.versions`):
//! Migrations 13 → 18 and 15 → 17, each in Dump and in Logical mode, every row and every
//! sequence's value on the target afterwards and nothing of the replication left on either
//! server; Database, Backup and restore (`spec.restoreFrom`) on 13 and on 18, and a 13
//! Backup restored on 18.
//!
//! Every controller runs the newest major's client programs (`--pg-dump`, `--pg-restore`:
//! pg_dump refuses a server newer than itself, so only the newest dumps every supported
//! server) and those of every other major this machine has (`--pg-bin-dir`: Debian's 15),
//! as the images run 13 to 18: pg_restore 17 and newer cannot restore into a server older
//! than 17 (`SET transaction_timeout`), and pg_restore reads no archive of a newer
//! pg_dump, so each operation takes the major that suits its servers. A backup-controller
//! given only an older pg_dump refuses a newer server with `PgDumpTooOld`.
//!
//! One test per pair of servers; within a test the Migrations, Backups and restores run
//! side by side, each on a Database of its own, and so does the feature round of issue 34
//! on each server (`harness::managed`: extensions, limits and settings, drift repair, a
//! DatabaseUser, both rotations, every deletion policy).
//!
//! The servers' admin is the suite's (`AdminKind::for_tests`): a managed service's admin
//! with replication rights, not a superuser. From a source older than 16 it may not make a
//! replication role, so the Logical Migration's subscription logs in as the admin itself.

use std::time::Instant;

use dbops_api::{BackupPhase, ChosenMode};
use dbops_e2e::harness::majors::Majors;
use dbops_e2e::postgres::client_bin_dir;
use dbops_e2e::wait::condition;
use serde_json::json;

/// 13 → 18, the oldest supported major to the newest, in Dump and in Logical mode, side by
/// side with a Database, a Backup and a restore on each of the two (and the 13 Backup
/// restored on 18). Nothing of the replication is left on either server.
#[tokio::test]
async fn the_oldest_major_moves_to_the_newest_and_both_back_up_and_restore() {
    let started = Instant::now();
    let m = Majors::start("majors-13-18", &[13, 18]).await;
    tokio::join!(
        m.fill_and_migrate("dumped", (13, 18), ChosenMode::Dump, 18),
        m.fill_and_migrate("replicated", (13, 18), ChosenMode::Logical, 18),
        async {
            m.create_filled_database("old", 13).await;
            let original = m.contents(13, "old").await;
            // The oldest pg_dump that dumps 13: Debian's 15, whose pg_restore restores it
            // into 13 again (18's would set transaction_timeout there).
            m.backup("old-1", "old", 13, 15).await;
            tokio::join!(
                m.restore("oldcopy", "old-1", 13, &original),
                m.restore("oldon18", "old-1", 18, &original),
                // A live clone across servers and majors, and one of the Backup.
                m.clone_as(
                    "oldclone",
                    json!({"databaseRef": {"name": "old"}}),
                    18,
                    &original
                ),
                m.clone_as(
                    "oldbackup",
                    json!({"backupRef": {"name": "old-1"}}),
                    13,
                    &original
                ),
            );
        },
        async {
            m.create_filled_database("new", 18).await;
            let original = m.contents(18, "new").await;
            m.backup("new-1", "new", 18, 18).await;
            tokio::join!(
                m.restore("newcopy", "new-1", 18, &original),
                m.clone_refused("newon13", "new", 13),
            );
        },
        m.features(13),
        m.features(18),
    );
    assert_eq!(m.leftovers().await, Vec::<String>::new());
    println!(
        "majors: 13 and 18 in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// 15 → 17 in Dump and in Logical mode, side by side; then a backup-controller given
/// Debian's pg_dump 15 refuses the Database now on 17 (`PgDumpTooOld`, naming both
/// versions) instead of running it.
#[tokio::test]
async fn a_database_moves_from_15_to_17_in_both_modes() {
    let started = Instant::now();
    let mut m = Majors::start("majors-15-17", &[15, 17]).await;
    tokio::join!(
        // No client of 17 here: 15's, the newest older than the target.
        m.fill_and_migrate("dumped", (15, 17), ChosenMode::Dump, 15),
        // The schema copy picks its programs as the Dump mode does (15's here, not
        // --pg-dump's 18): pg_restore 17+ could not restore into a 13-16 target.
        m.fill_and_migrate("replicated", (15, 17), ChosenMode::Logical, 15),
        m.features(15),
        m.features(17),
    );
    assert_eq!(m.leftovers().await, Vec::<String>::new());

    let old_pg_dump = client_bin_dir(15).unwrap().join("pg_dump");
    m.restart_backup_controller(&[format!("--pg-dump={}", old_pg_dump.display())]);
    m.create_backup("too-old", "replicated").await;
    let backup = m.wait_backup("too-old", BackupPhase::Failed).await;
    let failed = condition(&backup, "Failed").cloned().unwrap();
    assert_eq!(failed.reason, "PgDumpTooOld", "{failed:?}");
    assert!(
        failed.message.contains("pg_dump 15.") && failed.message.contains("PostgreSQL 17."),
        "names both versions: {failed:?}"
    );
    assert_eq!(
        backup.status.as_ref().and_then(|s| s.attempts),
        Some(1),
        "refused without retries"
    );
    println!(
        "majors: 15 and 17 in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}
