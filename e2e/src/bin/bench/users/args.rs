//! `dbops-bench users`' command line, and the names of its objects.

use std::time::Duration;

use super::wait::Bound;

/// The controller's user in the test control plane (its kubeconfig's certificate).
pub(crate) const USER: &str = "dbops-database-controller";

#[derive(clap::Args, Debug)]
pub struct UsersArgs {
    /// Databases on the server.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) databases: u32,
    /// DatabaseUsers per Database: ReadOnly, ReadWrite, ReadOnly, ... in turn.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub(crate) users_per_database: u32,
    /// `passwordRotation.keepPrevious` of every Database and user (set at creation): how
    /// long a previous login keeps working after the rotation.
    #[arg(long, default_value = "10s")]
    pub(crate) keep_previous: String,
    /// Rotations of all of them, one after the other (`bench-1`, `bench-2`, ...); the
    /// first one is each credential's first (its second login is created), later ones
    /// alternate between two existing logins.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub(crate) rotations: u32,
    /// SQL sessions the controller keeps on the server (`--max-sessions-per-server`).
    #[arg(long, default_value_t = 8)]
    pub(crate) sessions: usize,
    /// The controller's reconcile concurrency.
    #[arg(long, default_value_t = 16)]
    pub(crate) concurrency: usize,
    /// The controller's client-side API rate limit (requests/s).
    #[arg(long, default_value_t = 1000)]
    pub(crate) api_rate_limit: u32,
    /// The controller's resync interval: longer than the run, so that no periodic resync
    /// falls into a measured window.
    #[arg(long, default_value = "3600s")]
    pub(crate) resync: String,
    /// The bound of each wait (all Ready, all rotated, all retired), seconds.
    #[arg(long, default_value_t = 1800)]
    pub(crate) timeout_secs: u64,
    /// A wait fails sooner when no object got done for this long, seconds (naming some
    /// that are not done).
    #[arg(long, default_value_t = 300)]
    pub(crate) stall_secs: u64,
    /// The controller's `--log-filter`.
    #[arg(long, default_value = "warn")]
    pub(crate) controller_log_filter: String,
    /// Copy the PostgreSQL server's log, the apiserver's audit log and the controller's
    /// log into this directory at the end (they are removed with the run's temporary
    /// directory otherwise). The server's log holds SCRAM verifiers, no passwords.
    #[arg(long)]
    pub(crate) keep_logs: Option<std::path::PathBuf>,
}

impl UsersArgs {
    pub(crate) fn users(&self) -> usize {
        (self.databases * self.users_per_database) as usize
    }
    pub(crate) fn objects(&self) -> usize {
        self.databases as usize + self.users()
    }
    pub(crate) fn limit(&self) -> Bound {
        Bound {
            total: Duration::from_secs(self.timeout_secs),
            stall: Duration::from_secs(self.stall_secs),
        }
    }
}

pub(crate) fn db_name(i: u32) -> String {
    format!("db-{i:05}")
}

/// The `j`-th user of Database `i`, and its access.
pub(crate) fn user_of(i: u32, j: u32) -> (String, &'static str) {
    if j.is_multiple_of(2) {
        (format!("{}-ro{}", db_name(i), j / 2), "ReadOnly")
    } else {
        (format!("{}-rw{}", db_name(i), j / 2), "ReadWrite")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_alternate_access() {
        assert_eq!(user_of(3, 0), ("db-00003-ro0".to_string(), "ReadOnly"));
        assert_eq!(user_of(3, 1), ("db-00003-rw0".to_string(), "ReadWrite"));
        assert_eq!(user_of(3, 2), ("db-00003-ro1".to_string(), "ReadOnly"));
    }
}
