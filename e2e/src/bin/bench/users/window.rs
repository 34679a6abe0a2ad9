//! What the controller did in one window of a phase (audited writes, its SQL from the
//! server's log, its metrics, Events, CPU), and what each phase measured.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dbops_e2e::{AuditWrite, ControlPlane, ControllerProcess, PgServer};
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams};

use super::args::USER;
use crate::measure::proc_usage;
use crate::scale;

/// What the controller did in one window.
pub(crate) struct Window {
    pub(crate) writes: Vec<AuditWrite>,
    /// Statements of the controller's sessions, as logged.
    pub(crate) statements: Vec<String>,
    /// The `ALTER ROLE` statements among them that change a login, with their time.
    pub(crate) logins: Vec<LoginChange>,
    /// New connections of the controller's sessions, as logged.
    pub(crate) connections: usize,
    pub(crate) pg_requests: f64,
    pub(crate) kube_requests: f64,
    /// New Event objects in the namespace, by "<involved kind> <reason>".
    pub(crate) events: BTreeMap<String, usize>,
    /// (database-controller, user-controller) reconciles, failed ones included, and
    /// failed ones alone.
    pub(crate) reconciles: (f64, f64),
    pub(crate) failed: (f64, f64),
    pub(crate) cpu: f64,
    /// From the start of the window until the controller settled.
    pub(crate) secs: f64,
}

/// Counters at the start of a window.
pub(crate) struct Mark {
    pub(crate) audit: usize,
    pub(crate) events: HashSet<String>,
    pub(crate) log_offset: u64,
    pub(crate) metrics: Metrics,
    pub(crate) cpu: f64,
    pub(crate) t0: Instant,
}

#[derive(Clone, Copy, Default)]
pub(crate) struct Metrics {
    pub(crate) pg: f64,
    pub(crate) kube: f64,
    pub(crate) reconciles: (f64, f64),
    pub(crate) failed: (f64, f64),
}

pub(crate) struct Bed<'a> {
    pub(crate) cp: &'a ControlPlane,
    pub(crate) pg: &'a PgServer,
    pub(crate) controller: &'a ControllerProcess,
    pub(crate) ns: &'a str,
    pub(crate) ours: HashSet<String>,
    pub(crate) events: Api<Event>,
}

impl Bed<'_> {
    /// The controller's audited writes so far, in this run's namespaces and to its
    /// DatabaseServer.
    pub(crate) fn writes(&self) -> Result<Vec<AuditWrite>> {
        Ok(self
            .cp
            .audit_writes(USER, None)?
            .into_iter()
            .filter(|w| {
                self.ours.contains(&w.namespace) || (w.namespace.is_empty() && w.name == self.ns)
            })
            .collect())
    }

    pub(crate) async fn metrics(&self) -> Result<Metrics> {
        let port = self.controller.metrics_port;
        let (code, body) =
            tokio::task::spawn_blocking(move || dbops_e2e::controllers::http_get(port, "/metrics"))
                .await
                .context("the /metrics GET task failed")??;
        ensure!(code == 200, "/metrics answered {code}");
        let sum = |name: &str, labels: &[&str]| scale::metric_sum(&body, name, labels);
        let rec = |who: &str, outcome: Option<&str>| {
            let who = format!("controller=\"{who}\"");
            match outcome {
                Some(o) => sum(
                    "dbops_reconciles_total",
                    &[&who, &format!("outcome=\"{o}\"")],
                ),
                None => sum("dbops_reconciles_total", &[&who]),
            }
        };
        Ok(Metrics {
            pg: sum("dbops_external_requests_total", &["target=\"postgres\""]),
            kube: sum("dbops_external_requests_total", &["target=\"kubernetes\""]),
            reconciles: (
                rec("database-controller", None),
                rec("user-controller", None),
            ),
            failed: (
                rec("database-controller", Some("error")),
                rec("user-controller", Some("error")),
            ),
        })
    }

    pub(crate) async fn mark(&self) -> Result<Mark> {
        let log = self.pg.log_path();
        Ok(Mark {
            audit: self.writes()?.len(),
            events: self
                .events
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .map(|e| e.name_any())
                .collect(),
            log_offset: std::fs::metadata(&log)
                .with_context(|| format!("reading the size of {}", log.display()))?
                .len(),
            metrics: self.metrics().await?,
            cpu: proc_usage(self.controller.process.pid())?.0,
            t0: Instant::now(),
        })
    }

    /// Waits until the controller has settled (no new audited write, no new reconcile
    /// for 3 s, polled every 500 ms; at most 120 s), then what it did since `mark`.
    pub(crate) async fn window(&self, mark: &Mark) -> Result<Window> {
        let limit = Duration::from_secs(120);
        let deadline = Instant::now() + limit;
        let mut audit = AuditTail::new(self.cp.audit_log_path());
        let mut last = (usize::MAX, f64::NAN);
        let mut since = Instant::now();
        loop {
            let m = self.metrics().await?;
            let now = (audit.count()?, m.reconciles.0 + m.reconciles.1);
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() >= Duration::from_secs(3) {
                break;
            }
            if Instant::now() > deadline {
                bail!("the controller did not settle within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let writes = self.writes()?;
        let metrics = self.metrics().await?;
        // The settling itself (3 s of nothing) is not the work's.
        let secs = (mark.t0.elapsed() - since.elapsed()).as_secs_f64();
        let (statements, logins, connections) =
            controller_sql(&self.pg.log_path(), mark.log_offset)?;
        let mut events = BTreeMap::new();
        for e in self.events.list(&ListParams::default()).await?.items {
            if !mark.events.contains(&e.name_any()) {
                let kind = e.involved_object.kind.clone().unwrap_or_default();
                let reason = e.reason.clone().unwrap_or_default();
                *events.entry(format!("{kind} {reason}")).or_default() += 1;
            }
        }
        Ok(Window {
            writes: writes.into_iter().skip(mark.audit).collect(),
            statements,
            logins,
            connections,
            pg_requests: metrics.pg - mark.metrics.pg,
            kube_requests: metrics.kube - mark.metrics.kube,
            events,
            reconciles: (
                metrics.reconciles.0 - mark.metrics.reconciles.0,
                metrics.reconciles.1 - mark.metrics.reconciles.1,
            ),
            failed: (
                metrics.failed.0 - mark.metrics.failed.0,
                metrics.failed.1 - mark.metrics.failed.1,
            ),
            cpu: proc_usage(self.controller.process.pid())?.0 - mark.cpu,
            secs,
        })
    }
}

/// The number of audit log lines of the controller's writes, read on from where the last
/// call stopped (the whole log is parsed only once per window, by `Bed::writes`).
pub(crate) struct AuditTail {
    pub(crate) path: std::path::PathBuf,
    pub(crate) offset: u64,
    pub(crate) count: usize,
}

impl AuditTail {
    pub(crate) fn new(path: std::path::PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            count: 0,
        }
    }

    pub(crate) fn count(&mut self) -> Result<usize> {
        let bytes = scale::bytes_since(&self.path, self.offset)?;
        // Whole lines only: the apiserver may be writing the last one.
        let end = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let user = format!("\"username\":\"{USER}\"");
        self.count += String::from_utf8_lossy(&bytes[..end])
            .lines()
            .filter(|l| l.contains(&user))
            .count();
        self.offset += end as u64;
        Ok(self.count)
    }
}

/// What an `ALTER ROLE` of the controller did to a login, and when (the server's log
/// line time).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LoginChange {
    pub(crate) at: Timestamp,
    pub(crate) role: String,
    pub(crate) change: Change,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Change {
    /// `LOGIN VALID UNTIL 'infinity'`: the login is given out (a new password with it).
    Activated,
    /// `VALID UNTIL '<time>'`: the previous login's expiry, set at a rotation.
    Expires(Timestamp),
    /// `NOLOGIN`: retired.
    Retired,
}

/// The login changes in one logged statement (a simple query may hold several).
pub(crate) fn login_changes(at: Timestamp, sql: &str) -> Vec<LoginChange> {
    sql.split(';')
        .filter_map(|part| {
            let rest = part.trim().strip_prefix("ALTER ROLE \"")?;
            let (role, rest) = rest.split_once('"')?;
            let change = match rest.trim() {
                "NOLOGIN" => Change::Retired,
                "LOGIN VALID UNTIL 'infinity'" => Change::Activated,
                other => {
                    let until = other.strip_prefix("VALID UNTIL '")?.strip_suffix('\'')?;
                    Change::Expires(until.parse().ok()?)
                }
            };
            Some(LoginChange {
                at,
                role: role.to_string(),
                change,
            })
        })
        .collect()
}

/// The time of a server log line (`%m`: `2026-11-25 02:04:51.164 UTC ...`).
pub(crate) fn log_time(line: &str) -> Option<Timestamp> {
    let mut words = line.split_whitespace();
    let (date, time, zone) = (words.next()?, words.next()?, words.next()?);
    if zone != "UTC" {
        return None;
    }
    format!("{date}T{time}Z").parse().ok()
}

/// The controller's statements (each `statement:`/`execute` line of a session whose
/// `application_name` is `dbops`), the login changes among them, and new connections
/// (`connection authorized` lines naming that application) in the server's log after
/// byte `offset`.
pub(crate) fn controller_sql(
    log_path: &Path,
    offset: u64,
) -> Result<(Vec<String>, Vec<LoginChange>, usize)> {
    let bytes = scale::bytes_since(log_path, offset)?;
    let text = String::from_utf8_lossy(&bytes);
    let mut statements = Vec::new();
    let mut logins = Vec::new();
    let mut connections = 0;
    for line in text.lines() {
        if line.contains("connection authorized:") && line.contains("application_name=dbops") {
            connections += 1;
        } else if line.contains(scale::CONTROLLER_APP)
            && let Some(sql) = scale::statement_of(line)
        {
            if let Some(at) = log_time(line) {
                logins.extend(login_changes(at, sql));
            }
            statements.push(sql.to_string());
        }
    }
    Ok((statements, logins, connections))
}

/// The first keyword of each `;`-separated statement of a logged one (`ALTER ROLE`,
/// `GRANT`, `SELECT`, ...): two words for CREATE/ALTER/DROP/COMMENT ON, else one.
pub(crate) fn keywords(sql: &str) -> Vec<String> {
    sql.split(';')
        .filter_map(|part| {
            let mut words = part
                .split_whitespace()
                .map(|w| w.trim_matches(|c: char| !c.is_ascii_alphabetic()))
                .filter(|w| !w.is_empty());
            let first = words.next()?.to_ascii_uppercase();
            Some(match first.as_str() {
                "CREATE" | "ALTER" | "DROP" | "COMMENT" => {
                    let mut second = words.next().unwrap_or_default().to_ascii_uppercase();
                    if second == "ON" {
                        second = words.next().unwrap_or_default().to_ascii_uppercase();
                    }
                    format!("{first} {second}")
                }
                _ => first,
            })
        })
        .collect()
}

/// The kind of an audited write, for the report.
pub(crate) fn kind_of(w: &AuditWrite) -> String {
    match (w.resource.as_str(), w.subresource.as_str()) {
        ("databases", "status") => "Database status".into(),
        ("databaseusers", "status") => "DatabaseUser status".into(),
        ("secrets", _) => "Secret".into(),
        // The controllers write only `metadata.finalizers` on the objects themselves.
        ("databases", "") => "Database finalizer".into(),
        ("databaseusers", "") => "DatabaseUser finalizer".into(),
        ("events", _) => "Event".into(),
        ("databaseservers", "status") => "DatabaseServer status".into(),
        ("databaseservers", "") => "DatabaseServer finalizer".into(),
        (r, "") => format!("{} {r}", w.verb),
        (r, s) => format!("{} {r}/{s}", w.verb),
    }
}

pub(crate) struct Creation {
    pub(crate) dbs_ready: f64,
    pub(crate) all_ready: f64,
    pub(crate) window: Window,
}

pub(crate) struct Rotation {
    pub(crate) round: u32,
    pub(crate) annotated: f64,
    /// (every Secret, every Database status, every DatabaseUser status) shows the new
    /// login; the last of the three.
    pub(crate) secrets: f64,
    pub(crate) db_status: f64,
    pub(crate) user_status: f64,
    pub(crate) rotated: f64,
    pub(crate) retired: f64,
    pub(crate) previous_checked: usize,
    /// `ALTER ROLE ... VALID UNTIL <time>` statements in the window: one per rotation.
    pub(crate) expiries: usize,
    /// What the checks after the rotation found wrong: more or fewer rotations than
    /// credentials, a status and its Secret on different logins, a previous login that
    /// still logs in. The run fails when there is any, after the report.
    pub(crate) anomalies: Vec<String>,
    pub(crate) window: Window,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_counted_by_keyword() {
        assert_eq!(
            keywords("BEGIN; CREATE ROLE \"a\" NOLOGIN; COMMENT ON ROLE \"a\" IS 'm'; COMMIT"),
            ["BEGIN", "CREATE ROLE", "COMMENT ROLE", "COMMIT"]
        );
        assert_eq!(keywords("select 1"), ["SELECT"]);
        assert_eq!(keywords("ALTER ROLE x VALID UNTIL 'y'"), ["ALTER ROLE"]);
        assert!(keywords("  ").is_empty());
    }
}
