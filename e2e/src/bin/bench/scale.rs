//! The scale parts of `dbops-bench databases`: tenant namespaces, the controller's memory
//! from /proc, its health and metrics endpoints, and the restart measurement (a fresh
//! controller over N converged Databases: time to ready and to every Database reconciled,
//! then API writes, DDL and SQL round trips over two resyncs).

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_e2e::controllers::http_get;
use dbops_e2e::{ControlPlane, ControllerProcess, PgServer};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams};

use crate::bed::namespace;
use crate::measure::api_writes;

/// The controller's metrics label, as in `dbops_reconciles_total{controller=...}`.
const CONTROLLER: &str = "database-controller";

/// The `application_name` of every PostgreSQL session the controllers open
/// (`dbops_shared::postgres`); the servers' log line prefix shows it as `app=dbops`.
pub(crate) const CONTROLLER_APP: &str = " app=dbops ";

/// The tenant namespaces of one run: `prefix` itself for one (the names the bench always
/// used), `prefix-000`, `prefix-001`, ... for more.
pub(crate) fn tenant_namespaces(prefix: &str, n: usize) -> Vec<String> {
    if n == 1 {
        vec![prefix.to_string()]
    } else {
        (0..n).map(|j| format!("{prefix}-{j:03}")).collect()
    }
}

/// Creates each namespace (as [`namespace`] does).
pub(crate) async fn create_namespaces(client: &kube::Client, names: &[String]) -> Result<()> {
    for name in names {
        namespace(client, name)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
    }
    Ok(())
}

/// Deletes the namespaces and waits (a watch on each) until they are gone, within `limit`
/// for all of them.
pub(crate) async fn delete_namespaces(
    client: &kube::Client,
    names: &[String],
    limit: Duration,
) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    for name in names {
        api.delete(name, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting namespace {name}"))?;
    }
    let deadline = tokio::time::Instant::now() + limit;
    for name in names {
        let gone =
            kube::runtime::wait::await_condition(api.clone(), name, |ns: Option<&Namespace>| {
                ns.is_none()
            });
        tokio::time::timeout_at(deadline, gone)
            .await
            .with_context(|| format!("namespace {name} not gone within {limit:?}"))?
            .with_context(|| format!("watching namespace {name}"))?;
    }
    Ok(())
}

/// A `kB` field of /proc/<pid>/status (`VmRSS:`, `VmHWM:`), in KiB.
pub(crate) fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in {path}"))
}

/// GET on the controller's health and metrics server, off the async threads.
async fn get(port: u16, path: &'static str) -> Result<(u16, String)> {
    tokio::task::spawn_blocking(move || http_get(port, path))
        .await
        .context("the HTTP GET task failed")?
}

/// Polls `/readyz` every 100 ms until it answers 200, for at most `limit`.
pub(crate) async fn wait_readyz(controller: &ControllerProcess, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let answer = get(controller.metrics_port, "/readyz").await;
        if answer.as_ref().is_ok_and(|(code, _)| *code == 200) {
            return Ok(());
        }
        if Instant::now() > deadline {
            let last = match answer {
                Ok((code, body)) => format!("{code} {}", body.trim()),
                Err(e) => format!("{e:#}"),
            };
            bail!("/readyz not 200 within {limit:?} (last answer: {last})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The sum of a metric's series whose labels contain every one of `labels`.
pub(crate) use dbops_e2e::controllers::series_sum as metric_sum;

/// The controller's /metrics, as text.
pub(crate) async fn metrics(controller: &ControllerProcess) -> Result<String> {
    let (code, body) = get(controller.metrics_port, "/metrics").await?;
    if code != 200 {
        bail!("/metrics answered {code}");
    }
    Ok(body)
}

/// (successful, failed) reconciles of the database-controller so far, from /metrics.
async fn reconciles(controller: &ControllerProcess) -> Result<(f64, f64)> {
    let body = metrics(controller).await?;
    let who = format!("controller=\"{CONTROLLER}\"");
    let count = |outcome: &str| {
        metric_sum(
            &body,
            "dbops_reconciles_total",
            &[&who, &format!("outcome=\"{outcome}\"")],
        )
    };
    Ok((count("success"), count("error")))
}

/// What a fresh controller did over N converged Databases.
pub(crate) struct Restart {
    /// From the start of the process until /readyz answered 200.
    pub ready_secs: f64,
    /// From the start until the reconcile counter reached N.
    pub reconciled_secs: f64,
    /// Failed reconciles in the window.
    pub errors: f64,
    /// Reconciles (successful and failed) in the whole window.
    pub reconciles: f64,
    /// The whole window: start, all reconciled, two resyncs.
    pub window_secs: f64,
    /// API writes (databases, databaseservers, secrets, events) in the window.
    pub writes: f64,
    /// The controller's writes by kind in the window (audit log).
    pub breakdown: String,
    /// Statements of the controller's sessions in the server's log, and the DDL among them.
    pub statements: usize,
    pub ddl: usize,
    /// The controller's own count of PostgreSQL requests (connections and statements).
    pub pg_requests: f64,
    /// The fresh process's RSS at the end of the window, KiB.
    pub rss_settled: u64,
}

/// How the controller of the last run was started, to start it again the same way.
pub(crate) struct Launch<'a> {
    pub cp: &'a ControlPlane,
    pub client: &'a kube::Client,
    pub pg: &'a PgServer,
    pub kubeconfig: &'a Path,
    pub log_dir: &'a Path,
    pub args: &'a [String],
    pub count: usize,
    pub resync_secs: f64,
}

/// Stops `controller` (SIGTERM, waits for its exit), starts a fresh one with the same
/// arguments and log directory (the same pod, restarted) and measures, from its start
/// until two resyncs after every Database was reconciled once: time to /readyz, time to
/// N reconciles, API writes, and the statements (DDL among them) its sessions ran.
///
/// For the statements, `log_statement` is `all` for the window. The server runs with
/// `-c log_statement=ddl` on its command line, which outranks `ALTER SYSTEM`
/// (`postgresql.auto.conf` is a configuration file, below the command line), so the setting
/// is made with `ALTER ROLE ALL SET`, which new sessions of every role apply over the
/// command line; the fresh controller's sessions are all new. The statements counted are
/// the log lines of sessions whose `application_name` is `dbops` (the log line prefix
/// shows `app=%a`): the bench's own sessions have none, so its `ALTER ROLE` and `SHOW`
/// are not counted.
pub(crate) async fn restart(
    launch: Launch<'_>,
    mut controller: ControllerProcess,
) -> Result<Restart> {
    let admin = launch.pg.connect_as_superuser().await?;
    admin
        .batch_execute("ALTER ROLE ALL SET log_statement = 'all'")
        .await
        .context("turning on statement logging")?;
    let check = launch.pg.connect_as_superuser().await?;
    let level: String = check
        .query_one("SHOW log_statement", &[])
        .await
        .context("SHOW log_statement")?
        .get(0);
    drop(check);
    if level != "all" {
        bail!("log_statement is {level:?} in a new session, not \"all\"");
    }
    let measured = measure(&launch, &mut controller).await;
    let reset = admin
        .batch_execute("ALTER ROLE ALL RESET log_statement")
        .await
        .context("turning statement logging off again");
    let measured = measured?;
    reset?;
    Ok(measured)
}

async fn measure(launch: &Launch<'_>, controller: &mut ControllerProcess) -> Result<Restart> {
    controller.process.signal("TERM")?;
    let exited =
        tokio::task::block_in_place(|| controller.process.wait_exit(Duration::from_secs(30)))?;
    if !exited.success() {
        tracing::warn!(%exited, "the controller did not exit cleanly on SIGTERM");
    }

    let log_path = launch.pg.log_path();
    let offset = std::fs::metadata(&log_path)
        .with_context(|| format!("reading the size of {}", log_path.display()))?
        .len();
    let user = "dbops-database-controller";
    let audit0 = launch.cp.audit_writes(user, None)?.len();
    let w0 = api_writes(launch.client).await?;

    let t0 = Instant::now();
    let fresh =
        ControllerProcess::start(CONTROLLER, launch.kubeconfig, launch.log_dir, launch.args)?;
    wait_readyz(&fresh, Duration::from_secs(120)).await?;
    let ready_secs = t0.elapsed().as_secs_f64();

    // The counter counts reconciles, not distinct Databases: one reconciled twice before
    // another's first would bring it to N a little early. With nothing changing, each
    // Database is reconciled once on the initial list and again only at its resync.
    let n = launch.count as f64;
    let limit = Duration::from_secs(300) + Duration::from_millis(100) * launch.count as u32;
    let deadline = Instant::now() + limit;
    let (mut ok, mut errors) = reconciles(&fresh).await?;
    while ok < n {
        if Instant::now() > deadline {
            bail!("{ok} of {n} reconciled ({errors} failed) within {limit:?} after the restart");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        (ok, errors) = reconciles(&fresh).await?;
    }
    let reconciled_secs = t0.elapsed().as_secs_f64();

    // The observation window itself: every Database's resync falls in it.
    tokio::time::sleep(Duration::from_secs_f64(launch.resync_secs * 2.0 + 2.0)).await;
    let writes = api_writes(launch.client).await? - w0;
    let window_secs = t0.elapsed().as_secs_f64();
    let (ok_end, errors_end) = reconciles(&fresh).await?;
    errors = errors.max(errors_end);
    let body = metrics(&fresh).await?;
    let pg_requests = metric_sum(
        &body,
        "dbops_external_requests_total",
        &["target=\"postgres\""],
    );
    let rss_settled = status_kib(fresh.process.pid(), "VmRSS:")?;
    let (statements, ddl) = controller_statements(&log_path, offset)?;

    let breakdown = crate::measure::writes_by_kind(
        launch.cp.audit_writes(user, None)?.into_iter().skip(audit0),
    );
    drop(fresh);
    Ok(Restart {
        ready_secs,
        reconciled_secs,
        errors,
        reconciles: ok_end + errors,
        window_secs,
        writes,
        breakdown,
        statements,
        ddl,
        pg_requests,
        rss_settled,
    })
}

/// (statements, DDL statements) the controller's sessions ran, from the server's log
/// after byte `offset`.
fn controller_statements(log_path: &Path, offset: u64) -> Result<(usize, usize)> {
    let bytes = bytes_since(log_path, offset)?;
    let text = String::from_utf8_lossy(&bytes);
    let statements: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(CONTROLLER_APP))
        .filter_map(statement_of)
        .collect();
    let ddl = statements.iter().filter(|s| is_ddl(s)).count();
    Ok((statements.len(), ddl))
}

/// The bytes of the file at `path` after byte `offset` (a log read since a mark).
pub(crate) fn bytes_since(path: &Path, offset: u64) -> Result<Vec<u8>> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    file.seek(SeekFrom::Start(offset))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(bytes)
}

/// The SQL of a `log_statement` line: `LOG:  statement: <sql>` (simple query protocol) or
/// `LOG:  execute <name>: <sql>` (extended protocol); `None` for any other line (DETAIL
/// lines with a statement's parameters included).
pub(crate) fn statement_of(line: &str) -> Option<&str> {
    if let Some((_, sql)) = line.split_once("LOG:  statement: ") {
        return Some(sql);
    }
    let (_, rest) = line.split_once("LOG:  execute ")?;
    rest.split_once(": ").map(|(_, sql)| sql)
}

/// Whether a logged statement (a simple query may hold several, `;`-separated) has one
/// starting with CREATE, ALTER, DROP, GRANT, REVOKE or COMMENT.
pub(crate) fn is_ddl(sql: &str) -> bool {
    const DDL: [&str; 6] = ["CREATE", "ALTER", "DROP", "GRANT", "REVOKE", "COMMENT"];
    sql.split(';').any(|part| {
        let word = part
            .trim_start()
            .split(|c: char| !c.is_ascii_alphabetic())
            .next()
            .unwrap_or_default();
        DDL.iter().any(|d| d.eq_ignore_ascii_case(word))
    })
}

/// The controller's API requests so far per Database, by verb and resource, most first
/// (from `dbops_kubernetes_requests_total`), with their total: where the requests go.
pub(crate) async fn requests_per_database(
    controller: &ControllerProcess,
    count: usize,
) -> Result<String> {
    let body = metrics(controller).await?;
    let mut rows: Vec<(f64, String)> = body
        .lines()
        .filter_map(|l| l.strip_prefix("dbops_kubernetes_requests_total{"))
        .filter_map(|rest| {
            let (labels, value) = rest.split_once("} ")?;
            let label = |k: &str| {
                labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
            };
            let value: f64 = value.trim().parse().ok()?;
            Some((value, format!("{} {}", label("verb")?, label("resource")?)))
        })
        .collect();
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    let n = count.max(1) as f64;
    let total: f64 = rows.iter().map(|r| r.0).fold(0.0, |a, b| a + b);
    let parts: Vec<String> = rows
        .iter()
        .filter(|(v, _)| *v / n >= 0.005)
        .map(|(v, what)| format!("{what} {:.2}", v / n))
        .collect();
    Ok(format!("{:.2} ({})", total / n, parts.join(", ")))
}

/// Where the controller's reconciles spent their time so far, from its /metrics: their
/// count and total, PostgreSQL statements and connections, Kubernetes API requests, the
/// waits for a session slot, the slots held, the routine checks put off for a busy server,
/// and the waits for the API rate limit (each a count and a total but the put-off ones).
pub(crate) async fn phases(controller: &ControllerProcess) -> Result<String> {
    let body = metrics(controller).await?;
    let pair = |name: &str, labels: &[&str]| {
        let count = metric_sum(&body, &format!("{name}_count"), labels);
        let sum = metric_sum(&body, &format!("{name}_sum"), labels);
        format!("{count:.0} in {sum:.1} s")
    };
    Ok(format!(
        "reconciles {}; SQL {}; API requests {}; waits for a session {}, sessions held {}, routine checks put off {:.0}, waits for the API rate limit {}",
        pair(
            "dbops_reconcile_duration_seconds",
            &["controller=\"database-controller\""]
        ),
        pair(
            "dbops_external_request_duration_seconds",
            &["target=\"postgres\""]
        ),
        pair(
            "dbops_external_request_duration_seconds",
            &["target=\"kubernetes\""]
        ),
        pair("dbops_queue_wait_seconds", &["queue=\"postgres_session\""]),
        pair("dbops_postgres_session_held_seconds", &[]),
        metric_sum(&body, "dbops_routine_checks_deferred_total", &[]),
        pair("dbops_queue_wait_seconds", &["queue=\"api_rate_limit\""]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_and_ddl_are_told_apart() {
        let line = |rest: &str| {
            format!("2026-11-23 10:00:00.000 UTC [42] postgres@postgres app=dbops {rest}")
        };
        assert_eq!(
            statement_of(&line("LOG:  statement: BEGIN; CREATE ROLE \"a\"; COMMIT")),
            Some("BEGIN; CREATE ROLE \"a\"; COMMIT")
        );
        assert_eq!(
            statement_of(&line(
                "LOG:  execute s12: SELECT 1 FROM pg_roles WHERE rolname = $1"
            )),
            Some("SELECT 1 FROM pg_roles WHERE rolname = $1")
        );
        assert_eq!(statement_of(&line("DETAIL:  parameters: $1 = 'a'")), None);
        assert_eq!(statement_of(&line("LOG:  checkpoint starting: time")), None);
        assert!(is_ddl("BEGIN; CREATE ROLE \"a\"; COMMIT"));
        assert!(is_ddl("revoke all on database x from public"));
        assert!(is_ddl("COMMENT ON DATABASE \"x\" IS 'm'"));
        assert!(!is_ddl("SELECT r.rolname, d.datname FROM pg_roles r"));
        assert!(!is_ddl("SET statement_timeout = 0"));
    }

    #[test]
    fn metric_series_are_summed_by_label() {
        let body = "dbops_reconciles_total{controller=\"database-controller\",outcome=\"success\"} 7\n\
                    dbops_reconciles_total{controller=\"server-controller\",outcome=\"success\"} 3\n\
                    dbops_reconciles_total{controller=\"database-controller\",outcome=\"error\"} 1\n";
        assert_eq!(
            metric_sum(
                body,
                "dbops_reconciles_total",
                &["controller=\"database-controller\"", "outcome=\"success\""]
            ),
            7.0
        );
        assert_eq!(
            metric_sum(
                body,
                "dbops_reconciles_total",
                &["controller=\"database-controller\""]
            ),
            8.0
        );
    }

    #[test]
    fn one_namespace_keeps_its_name() {
        assert_eq!(
            tenant_namespaces("bench-controller-1", 1),
            ["bench-controller-1"]
        );
        assert_eq!(tenant_namespaces("b", 3), ["b-000", "b-001", "b-002"]);
    }
}
