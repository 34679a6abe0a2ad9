//! The controller binaries of this workspace run as real processes against a test bed.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::paths;
use crate::process::{Spec, Supervised, free_port};

/// One controller process and the address of its health and metrics server.
#[derive(Debug)]
pub struct ControllerProcess {
    pub process: Supervised,
    pub metrics_port: u16,
}

/// How [`ControllerProcess::launch`] starts a controller, beyond its name, kubeconfig,
/// log directory and flags.
#[derive(Default)]
struct Launch<'a> {
    /// The health and metrics port; a free one when none.
    metrics_port: Option<u16>,
    /// Added to the controller's environment.
    env: &'a [(String, String)],
    /// The process is told to exit by itself: an exit before `/healthz` answered is not
    /// an error.
    exit_expected: bool,
}

impl ControllerProcess {
    /// Starts `dbops-<name>` (for example `database-controller`) with the kubeconfig,
    /// a free metrics port and `extra_args`; returns once `/healthz` answers.
    pub fn start(
        name: &str,
        kubeconfig: &Path,
        log_dir: &Path,
        extra_args: &[String],
    ) -> Result<Self> {
        Self::launch(name, kubeconfig, log_dir, extra_args, Launch::default())
    }

    /// Like [`ControllerProcess::start`] with a chosen health and metrics port.
    pub fn start_on(
        name: &str,
        kubeconfig: &Path,
        log_dir: &Path,
        metrics_port: u16,
        extra_args: &[String],
    ) -> Result<Self> {
        let how = Launch {
            metrics_port: Some(metrics_port),
            ..Launch::default()
        };
        Self::launch(name, kubeconfig, log_dir, extra_args, how)
    }

    /// Like [`ControllerProcess::start`] with `env` added to the controller's environment
    /// (for example an S3 store's `AWS_*` settings).
    pub fn start_with_env(
        name: &str,
        kubeconfig: &Path,
        log_dir: &Path,
        extra_args: &[String],
        env: &[(String, String)],
    ) -> Result<Self> {
        let how = Launch {
            env,
            ..Launch::default()
        };
        Self::launch(name, kubeconfig, log_dir, extra_args, how)
    }

    /// Like [`ControllerProcess::start`] for a process told to exit by itself (a test's
    /// `--debug-exit-at`): one that exits before `/healthz` answered is returned, not an
    /// error, and its exit status is there for `process.wait_exit`.
    pub fn start_expecting_exit(
        name: &str,
        kubeconfig: &Path,
        log_dir: &Path,
        extra_args: &[String],
    ) -> Result<Self> {
        let how = Launch {
            exit_expected: true,
            ..Launch::default()
        };
        Self::launch(name, kubeconfig, log_dir, extra_args, how)
    }

    fn launch(
        name: &str,
        kubeconfig: &Path,
        log_dir: &Path,
        extra_args: &[String],
        how: Launch<'_>,
    ) -> Result<Self> {
        let metrics_port = match how.metrics_port {
            Some(port) => port,
            None => free_port()?,
        };
        let exit_expected = how.exit_expected;
        let env: Vec<(&str, &str)> = how
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let mut spec = controller_spec(name, name, kubeconfig, metrics_port, extra_args, &env)?;
        if !env.iter().any(|(k, _)| *k == "POD_NAME") {
            spec = spec.env("POD_NAME", pod_name(name, log_dir));
        }
        let mut process = Supervised::start(&spec, log_dir)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = process.try_exit()? {
                if exit_expected {
                    return Ok(Self {
                        process,
                        metrics_port,
                    });
                }
                bail!("{name} exited ({status}):\n{}", process.log_tail(4000));
            }
            if http_get(metrics_port, "/healthz").is_ok_and(|(code, _)| code == 200) {
                return Ok(Self {
                    process,
                    metrics_port,
                });
            }
            if Instant::now() > deadline {
                bail!(
                    "{name} /healthz not answering after 30s:\n{}",
                    process.log_tail(4000)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// GET a path of the controller's health/metrics server: (status code, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.metrics_port, path)
    }

    /// The sum of the series of `metric` (e.g. `dbops_reconciles_total`) whose labels
    /// contain every one of `labels` (e.g. `result="Passed"`), from its /metrics; panics
    /// when /metrics does not answer 200 (a test harness's check).
    pub fn metric_sum(&self, metric: &str, labels: &[&str]) -> f64 {
        let (code, text) = match self.get("/metrics") {
            Ok(answer) => answer,
            Err(e) => panic!("GET /metrics: {e:#}"),
        };
        assert_eq!(code, 200, "{text}");
        series_sum(&text, metric, labels)
    }
}

/// The sum of a metric's series (`name{...} value` or `name value` lines of a `/metrics`
/// text) whose labels contain every one of `labels` (such as `verb="get"`).
pub fn series_sum(body: &str, name: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter(|rest| labels.iter().all(|label| rest.contains(label)))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        // Not `sum()`: an empty f64 sum is -0.0, printed "-0".
        .fold(0.0, |a, b| a + b)
}

/// Ends `controller`, if one runs: `signal` (`TERM`, `KILL`), then waits up to `timeout`
/// for its exit; panics if it does not exit: for tests.
pub fn end(controller: Option<ControllerProcess>, signal: &str, timeout: Duration) {
    if let Some(mut c) = controller
        && let Err(e) = c.process.signal_and_wait(signal, timeout)
    {
        panic!("ending a controller with SIG{signal}: {e:#}");
    }
}

/// A flag that scopes a controller started with `--watch-namespace=<ns>` to that test's
/// namespace, unless the test names the flag or its environment variable itself.
pub struct Scope {
    flag: &'static str,
    env: &'static str,
    value: fn(&str) -> String,
}

/// `--controller-namespace=<ns>` for a controller started with `--watch-namespace=<ns>`
/// and no controller namespace of its own (neither the flag nor `POD_NAMESPACE` among
/// its environment's names): a test's namespace stands in for `dbops-system`, where the
/// Deployments' pods run, so one test's backup store registration (the ConfigMap
/// `dbops-backup-store`), Leases and DatabaseServers' admin and CA Secrets never meet
/// another test's. `TestNamespace::create` grants the controllers' ServiceAccounts there
/// what `deploy/` grants them in `dbops-system`.
pub const CONTROLLER_NAMESPACE: Scope = Scope {
    flag: "--controller-namespace",
    env: "POD_NAMESPACE",
    value: |ns| ns.to_string(),
};

/// `--server-selector=dbops.dev/test-namespace=<ns>` for a controller started with
/// `--watch-namespace=<ns>` and no server selector of its own (neither the flag nor
/// `DBOPS_SERVER_SELECTOR` among its environment's names): DatabaseServers are
/// cluster-scoped, so without it every test's controllers would serve every test's
/// servers. The fixtures label each test's DatabaseServers with its namespace
/// ([`crate::fixtures::create_server`]).
pub const SERVER_SELECTOR: Scope = Scope {
    flag: "--server-selector",
    env: "DBOPS_SERVER_SELECTOR",
    value: |ns| format!("{}={ns}", crate::fixtures::TEST_NAMESPACE_LABEL),
};

impl Scope {
    /// `<flag>=<value(ns)>` for a controller started with `--watch-namespace=<ns>` and
    /// neither the flag (`--flag=v` or `--flag v`) nor its variable (among `env_names`)
    /// of its own.
    pub fn arg<'a>(
        &self,
        args: &[String],
        mut env_names: impl Iterator<Item = &'a str>,
    ) -> Option<String> {
        let with_value = format!("{}=", self.flag);
        let named = args
            .iter()
            .any(|a| a == self.flag || a.starts_with(&with_value))
            || env_names.any(|name| name == self.env);
        if named {
            return None;
        }
        args.iter()
            .find_map(|a| a.strip_prefix("--watch-namespace="))
            .map(|ns| format!("{with_value}{}", (self.value)(ns)))
    }
}

/// The flags ([`CONTROLLER_NAMESPACE`], [`SERVER_SELECTOR`]) that scope a controller
/// started with `args` and an environment of `env_names` to its watched namespace.
pub fn scoped_args<'a, I: Iterator<Item = &'a str>>(
    args: &[String],
    env_names: impl Fn() -> I,
) -> Vec<String> {
    [CONTROLLER_NAMESPACE, SERVER_SELECTOR]
        .iter()
        .filter_map(|scope| scope.arg(args, env_names()))
        .collect()
}

/// The process of the controller binary `dbops-<controller>` run as `name`: its health
/// and metrics server on `metrics_port`, `args` and the [`scoped_args`] they call for,
/// `KUBECONFIG` and `RUST_LOG` (`$DBOPS_CONTROLLER_LOG`, else `info`), then `env`.
pub fn controller_spec(
    controller: &str,
    name: &str,
    kubeconfig: &Path,
    metrics_port: u16,
    args: &[String],
    env: &[(&str, &str)],
) -> Result<Spec> {
    let env_names = || env.iter().map(|(k, _)| *k);
    let mut spec = Spec::new(name, paths::workspace_bin(&format!("dbops-{controller}"))?)
        .args([format!("--metrics-addr=127.0.0.1:{metrics_port}")])
        .args(args.iter().cloned())
        .args(scoped_args(args, env_names))
        .env("KUBECONFIG", kubeconfig.display().to_string())
        .env(
            "RUST_LOG",
            std::env::var("DBOPS_CONTROLLER_LOG").unwrap_or_else(|_| "info".into()),
        );
    for (key, value) in env {
        spec = spec.env(*key, *value);
    }
    Ok(spec)
}

/// The test bed's `$POD_NAME` for a controller that was given none: one log directory is
/// one pod. A process started again into the same directory is that pod's container
/// restarted (the same identity, as in Kubernetes); two replicas log into two
/// directories, so they are two pods with identities of their own.
pub fn pod_name(name: &str, log_dir: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    log_dir.hash(&mut hasher);
    format!("{name}-{:08x}", hasher.finish() as u32)
}

/// A minimal HTTP/1.0 GET on loopback (the test bed talks plain HTTP to controllers).
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status code")?;
    Ok((code, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|a| a.to_string()).collect()
    }

    /// What both [`Scope`]s do: `expected` for a watched namespace; nothing when `flag`
    /// (with `own` as its value, in either form) or `env` is named, or nothing is watched.
    fn assert_watched_namespace_arg(
        arg: impl Fn(&[String], &[&str]) -> Option<String>,
        flag: &str,
        env: &str,
        own: &str,
        expected: &str,
    ) {
        let watched = args(&["--watch-namespace=t-1", "--resync-interval=3s"]);
        assert_eq!(arg(&watched, &[]).as_deref(), Some(expected));
        assert_eq!(arg(&watched, &[env]), None);
        let named = args(&["--watch-namespace=t-1", &format!("{flag}={own}")]);
        assert_eq!(arg(&named, &[]), None);
        let named = args(&["--watch-namespace=t-1", flag, own]);
        assert_eq!(arg(&named, &[]), None);
        assert_eq!(arg(&args(&["--resync-interval=3s"]), &[]), None);
    }

    #[test]
    fn a_watched_namespace_is_the_controller_namespace_unless_one_is_named() {
        assert_watched_namespace_arg(
            |a, env| CONTROLLER_NAMESPACE.arg(a, env.iter().copied()),
            "--controller-namespace",
            "POD_NAMESPACE",
            "other",
            "--controller-namespace=t-1",
        );
    }

    #[test]
    fn one_log_directory_is_one_pod() {
        let a = pod_name("backup-controller", Path::new("/tmp/logs/a"));
        assert_eq!(a, pod_name("backup-controller", Path::new("/tmp/logs/a")));
        assert_ne!(a, pod_name("backup-controller", Path::new("/tmp/logs/b")));
        assert!(a.starts_with("backup-controller-"), "{a}");
    }

    #[test]
    fn a_watched_namespace_selects_its_servers_unless_a_selector_is_named() {
        assert_watched_namespace_arg(
            |a, env| SERVER_SELECTOR.arg(a, env.iter().copied()),
            "--server-selector",
            "DBOPS_SERVER_SELECTOR",
            "tier=gold",
            "--server-selector=dbops.dev/test-namespace=t-1",
        );
    }
}
