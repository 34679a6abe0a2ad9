//! The names the scheduler gives: its controller name, and the label and annotations of
//! the scheduled Backups.

/// Metrics label and Event reporter (`dbops-backup-scheduler`) of this controller.
pub const CONTROLLER: &str = "backup-scheduler";
/// The label naming the Database whose schedule created a Backup.
pub const SCHEDULE_OF: &str = "dbops.dev/schedule-of";
/// The annotation holding a scheduled Backup's slot, RFC 3339 in UTC.
pub const SCHEDULED_AT: &str = "dbops.dev/scheduled-at";
/// Scheduled Backups are labelled as dbops's.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "dbops");
