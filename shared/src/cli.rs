//! Flags every dbops controller takes, flattened into each binary's clap parser.
//!
//! Every flag also reads an environment variable (shown in `--help`), so a Deployment can
//! set either.

use std::{net::SocketAddr, num::NonZeroU32, time::Duration};

use clap::{ArgAction, Args, ValueEnum};

use crate::backup_store::BackupStore;
use crate::postgres::Servers;

/// Flags shared by the three controllers.
#[derive(Args, Clone, Debug)]
pub struct CommonArgs {
    /// How many objects of a kind are reconciled at the same time (at least 1). One object
    /// is never reconciled twice at once. Default: 16 Databases and 16 DatabaseUsers
    /// (a few SQL statements and API requests each), 4 Backups and 4 Migrations (each
    /// may stream a dump).
    #[arg(long, env = "DBOPS_CONCURRENCY",
          value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: Option<u16>,

    /// First retry delay after a transient reconcile error; doubles per attempt, with jitter.
    #[arg(long, env = "DBOPS_BACKOFF_BASE", default_value = "5s", value_parser = parse_duration)]
    pub backoff_base: Duration,

    /// Upper bound of the retry delay after transient reconcile errors.
    #[arg(long, env = "DBOPS_BACKOFF_MAX", default_value = "300s", value_parser = parse_duration)]
    pub backoff_max: Duration,

    /// How often a converged object is reconciled again without any watch event.
    #[arg(long, env = "DBOPS_RESYNC_INTERVAL", default_value = "300s", value_parser = parse_duration)]
    pub resync_interval: Duration,

    /// Only watch this namespace; all namespaces when absent.
    #[arg(long, env = "DBOPS_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,

    /// The controllers' own namespace: where their Leases and the backup store's
    /// registration live (and the DatabaseServers' admin and CA Secrets). In a Pod, set
    /// from the downward API as POD_NAMESPACE.
    #[arg(long, env = "POD_NAMESPACE", default_value = "dbops-system")]
    pub controller_namespace: String,

    /// Serve only the DatabaseServers with these labels (a label selector such as
    /// `dbops.dev/installation=blue`); all of them when absent. Lets several installations
    /// share a cluster, each with its own servers.
    #[arg(long, env = "DBOPS_SERVER_SELECTOR")]
    pub server_selector: Option<String>,

    /// Address of the health (/healthz, /readyz) and Prometheus (/metrics) endpoints.
    #[arg(long, env = "DBOPS_METRICS_ADDR", default_value = "127.0.0.1:8080")]
    pub metrics_addr: SocketAddr,

    /// Run only while holding the Lease `dbops-<controller>` in $POD_NAMESPACE, so that
    /// several replicas can run with one active.
    /// `--leader-elect`, `--leader-elect=true` and `--leader-elect=false` are all accepted.
    #[arg(long, env = "DBOPS_LEADER_ELECT", default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub leader_elect: bool,

    /// Requests per second this process sends to the Kubernetes API server (bursts up to
    /// twice as many). The apiserver protects itself (API Priority and Fairness): a
    /// request it refuses with 429 waits its `Retry-After` and is sent again.
    #[arg(long, env = "DBOPS_API_RATE_LIMIT", default_value = "300")]
    pub api_rate_limit: NonZeroU32,

    /// Longest wait for the response to one Kubernetes API request (for a watch: until
    /// the stream starts); a request that takes longer fails and is retried.
    #[arg(long, env = "DBOPS_API_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub api_timeout: Duration,

    /// Longest a single reconcile may run (a dump or restore included); one that takes
    /// longer is abandoned, reported (`ReconcileTimeout`) and retried with backoff.
    #[arg(long, env = "DBOPS_RECONCILE_TIMEOUT", default_value = "3600s", value_parser = parse_duration)]
    pub reconcile_timeout: Duration,

    /// How long one of the process's watches may fail without a break (each failure
    /// retried with backoff) before the process exits, so that a fresh one lists everything
    /// anew instead of reconciling from a cache that no longer follows the cluster.
    #[arg(long, env = "DBOPS_WATCH_STALL_TIMEOUT", default_value = "90s", value_parser = parse_duration)]
    pub watch_stall_timeout: Duration,

    /// OTLP gRPC endpoint for traces, for example http://jaeger-collector:4317; no traces
    /// are exported when absent.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Log line format.
    #[arg(long, env = "DBOPS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter in tracing-subscriber `EnvFilter` syntax, for example `info,kube=debug`.
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    pub log_filter: String,
}

impl CommonArgs {
    /// Refuses combinations a single flag parser cannot see.
    pub fn validate(&self) -> Result<(), CliError> {
        if self.backoff_base > self.backoff_max {
            return Err(CliError::BackoffBaseAboveMax {
                base: self.backoff_base,
                max: self.backoff_max,
            });
        }
        Ok(())
    }
}

/// Flags of the controllers that hold PostgreSQL sessions of their own (the
/// database-controller and the migration-controller): the per-server session limit and
/// circuit breaker of [`Servers`].
#[derive(Args, Clone, Debug)]
pub struct PostgresArgs {
    /// Concurrent SQL sessions per PostgreSQL server, across all reconciles.
    #[arg(long, env = "DBOPS_MAX_SESSIONS_PER_SERVER", default_value_t = 8)]
    pub max_sessions_per_server: usize,

    /// Consecutive connection failures after which a server is left alone for a while.
    #[arg(long, env = "DBOPS_BREAKER_THRESHOLD", default_value_t = 5)]
    pub breaker_threshold: u32,

    /// How long a failing server is left alone (what depends on it shows
    /// ServerUnreachable).
    #[arg(long, env = "DBOPS_BREAKER_OPEN_FOR", default_value = "30s", value_parser = parse_duration)]
    pub breaker_open_for: Duration,

    /// Longest a lock is waited for by any statement of the controller (and by pg_dump for
    /// its table locks): an application's transaction holding a lock then shows as
    /// `LockTimeout` instead of a reconcile that never ends. `0s`: no bound.
    #[arg(long, env = "DBOPS_LOCK_TIMEOUT", default_value = "10s", value_parser = parse_duration_or_zero)]
    pub lock_timeout: Duration,

    /// Longest any single SQL statement of the controller may run (`StatementTimeout`);
    /// `0s`: no bound.
    #[arg(long, env = "DBOPS_STATEMENT_TIMEOUT", default_value = "300s", value_parser = parse_duration_or_zero)]
    pub statement_timeout: Duration,
}

impl PostgresArgs {
    /// The sessions to PostgreSQL servers these flags describe.
    pub fn servers(&self) -> Servers {
        Servers::new(
            self.max_sessions_per_server,
            self.breaker_threshold,
            self.breaker_open_for,
        )
        .with_timeouts(self.statement_timeout, self.lock_timeout)
    }
}

/// The backup store's flag, taken by the backup-controller (which writes the artifacts)
/// and the database-controller (which reads them for `spec.restoreFrom`).
#[derive(Args, Clone, Debug)]
pub struct BackupStoreArgs {
    /// Where Backups' artifacts are kept: file:///absolute/path or s3://bucket/prefix. The
    /// backup-controller writes them and the database-controller reads them for
    /// `spec.restoreFrom`, so both take the same URL.
    #[arg(
        long,
        env = "DBOPS_BACKUP_STORE",
        default_value = "file:///var/lib/dbops/backups"
    )]
    pub backup_store: BackupStore,
    /// A Secret in the controllers' namespace whose key `recipients` holds age public
    /// keys (`age1…`, one per line): the backup-controller encrypts every artifact to all
    /// of them while it streams, so the store never holds plaintext; a Backup whose keys
    /// cannot be read fails rather than being written in the clear. Unset: artifacts are
    /// not encrypted. The database-controller does not use it.
    #[arg(long, env = "DBOPS_BACKUP_RECIPIENTS_SECRET")]
    pub backup_recipients_secret: Option<String>,
    /// A Secret in the controllers' namespace whose key `identities` holds age secret
    /// keys (`AGE-SECRET-KEY-1…`, one per line): the database-controller opens an
    /// encrypted artifact with whichever it was encrypted to (keep a retired key here
    /// while its artifacts may still be restored). The backup-controller does not use it.
    #[arg(long, env = "DBOPS_BACKUP_IDENTITIES_SECRET")]
    pub backup_identities_secret: Option<String>,
}

/// How log lines are written to stderr.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Flag combinations that are refused.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("--backoff-base ({base:?}) must not be greater than --backoff-max ({max:?})")]
    BackoffBaseAboveMax { base: Duration, max: Duration },
}

/// Why a duration flag was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DurationError {
    #[error("empty duration; expected for example 5s, 300ms, 2m or 1h")]
    Empty,
    #[error("`{0}` has no unit; expected ms, s, m or h (for example 5s)")]
    MissingUnit(String),
    #[error("unknown unit `{0}`; expected ms, s, m or h")]
    UnknownUnit(String),
    #[error("`{0}` does not start with a number")]
    MissingNumber(String),
    #[error("duration is too large")]
    Overflow,
    #[error("duration must be greater than zero")]
    Zero,
}

/// Parses a positive duration written as one or more `<integer><unit>` parts, units `ms`,
/// `s`, `m`, `h`: `5s`, `300ms`, `2m`, `1h30m`.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let input = input.trim();
    if input.is_empty() {
        return Err(DurationError::Empty);
    }
    let mut total = Duration::ZERO;
    let mut rest = input;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return Err(DurationError::MissingNumber(rest.to_owned()));
        }
        let (number, after) = rest.split_at(digits);
        let unit_len = after.len()
            - after
                .trim_start_matches(|c: char| c.is_ascii_alphabetic())
                .len();
        let (unit, after) = after.split_at(unit_len);
        let number: u64 = number.parse().map_err(|_| DurationError::Overflow)?;
        let part = match unit {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.checked_mul(60).ok_or(DurationError::Overflow)?),
            "h" => Duration::from_secs(number.checked_mul(3600).ok_or(DurationError::Overflow)?),
            "" => return Err(DurationError::MissingUnit(input.to_owned())),
            other => return Err(DurationError::UnknownUnit(other.to_owned())),
        };
        total = total.checked_add(part).ok_or(DurationError::Overflow)?;
        rest = after;
    }
    if total.is_zero() {
        return Err(DurationError::Zero);
    }
    Ok(total)
}

/// [`parse_duration`], where `0s` (or `0ms`) means "no bound".
pub fn parse_duration_or_zero(input: &str) -> Result<Duration, DurationError> {
    match parse_duration(input) {
        Err(DurationError::Zero) => Ok(Duration::ZERO),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct TestCli {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[test]
    fn durations_with_each_unit_parse() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration(" 1h30m "), Ok(Duration::from_secs(5400)));
    }

    #[test]
    fn malformed_durations_are_refused() {
        for (input, error) in [
            ("", DurationError::Empty),
            ("5", DurationError::MissingUnit("5".into())),
            ("5d", DurationError::UnknownUnit("d".into())),
            ("s", DurationError::MissingNumber("s".into())),
            ("-5s", DurationError::MissingNumber("-5s".into())),
            ("0s", DurationError::Zero),
            ("99999999999999999999s", DurationError::Overflow),
        ] {
            assert_eq!(parse_duration(input), Err(error), "{input:?}");
        }
    }

    #[test]
    fn defaults_match_the_spec() {
        let cli = TestCli::try_parse_from(["test"]).unwrap();
        let args = cli.common;
        assert_eq!(args.concurrency, None);
        assert_eq!(args.backoff_base, Duration::from_secs(5));
        assert_eq!(args.backoff_max, Duration::from_secs(300));
        assert_eq!(args.resync_interval, Duration::from_secs(300));
        assert_eq!(args.metrics_addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(args.api_rate_limit.get(), 300);
        assert!(!args.leader_elect);
        assert_eq!(args.log_format, LogFormat::Text);
        assert!(args.validate().is_ok());
    }

    #[test]
    fn leader_election_takes_an_optional_value() {
        let parse = |args: &[&str]| TestCli::try_parse_from(args).unwrap().common.leader_elect;
        assert!(parse(&["test", "--leader-elect"]));
        assert!(parse(&["test", "--leader-elect=true"]));
        assert!(!parse(&["test", "--leader-elect=false"]));
    }

    #[test]
    fn postgres_flags_default_to_eight_sessions_and_a_30s_breaker() {
        #[derive(Parser, Debug)]
        struct PgCli {
            #[command(flatten)]
            postgres: PostgresArgs,
        }
        let args = PgCli::try_parse_from(["test"]).unwrap().postgres;
        assert_eq!(args.max_sessions_per_server, 8);
        assert_eq!(args.breaker_threshold, 5);
        assert_eq!(args.breaker_open_for, Duration::from_secs(30));
        let args = PgCli::try_parse_from(["test", "--breaker-open-for=2m"])
            .unwrap()
            .postgres;
        assert_eq!(args.breaker_open_for, Duration::from_secs(120));
    }

    #[test]
    fn zero_concurrency_is_refused() {
        assert!(TestCli::try_parse_from(["test", "--concurrency", "0"]).is_err());
    }

    #[test]
    fn backoff_base_above_max_is_refused() {
        let cli = TestCli::try_parse_from(["test", "--backoff-base", "10m", "--backoff-max", "1m"])
            .unwrap();
        assert!(cli.common.validate().is_err());
    }
}
