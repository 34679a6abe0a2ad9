//! Child processes that can never outlive the test or dev session that started them.
//!
//! Each program runs under a tiny `sh` wrapper holding a *lifeline*: a pipe whose write
//! end only this process holds. When this process exits for any reason (a panic, a
//! SIGKILL, a `static` that is never dropped), the pipe closes, the wrapper sees EOF and
//! sends the program its stop signal, then SIGKILL after a grace period. Dropping a
//! [`Supervised`] does the same at once and waits for the program to exit.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The wrapper: runs "$@" in the background with stdin from /dev/null, records its pid,
/// and stops it when its own stdin (the lifeline) reaches EOF.
const LIFELINE: &str = r#"
exec 3<&0
"$@" </dev/null 3<&- &
child=$!
echo "$child" > "$DBOPS_PIDFILE"
( cat >/dev/null; kill -"$DBOPS_STOP_SIGNAL" "$child" 2>/dev/null; sleep "$DBOPS_GRACE"; kill -KILL "$child" 2>/dev/null ) <&3 >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait "$child"
status=$?
kill "$watcher" 2>/dev/null
exit "$status"
"#;

/// How to start a supervised program.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Short name used in log file names and errors.
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Signal sent to stop it (TERM for most; INT is PostgreSQL's fast shutdown).
    pub stop_signal: &'static str,
    /// Seconds between the stop signal and SIGKILL.
    pub grace_seconds: u32,
    /// Run as this Unix user (through `setpriv`) when this process is root.
    pub run_as: Option<String>,
}

impl Spec {
    pub fn new(name: impl Into<String>, program: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            stop_signal: "TERM",
            grace_seconds: 10,
            run_as: None,
        }
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn stop_signal(mut self, signal: &'static str) -> Self {
        self.stop_signal = signal;
        self
    }

    pub fn run_as(mut self, user: Option<String>) -> Self {
        self.run_as = user;
        self
    }
}

/// A running program; stopped when dropped.
#[derive(Debug)]
pub struct Supervised {
    name: String,
    wrapper: Child,
    lifeline: Option<ChildStdin>,
    pid: u32,
    log_path: PathBuf,
    exit: Option<ExitStatus>,
}

impl Supervised {
    /// Starts the program with stdout and stderr appended to `<log_dir>/<name>.log`.
    pub fn start(spec: &Spec, log_dir: &Path) -> Result<Self> {
        let log_path = log_dir.join(format!("{}.log", spec.name));
        let pidfile = log_dir.join(format!("{}.pid", spec.name));
        let _ = std::fs::remove_file(&pidfile);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(LIFELINE).arg("dbops-lifeline");
        if let Some(user) = spec.run_as.as_deref().filter(|_| is_root()) {
            cmd.args([
                "setpriv",
                "--reuid",
                user,
                "--regid",
                user,
                "--init-groups",
                "--",
            ]);
        }
        cmd.arg(&spec.program)
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .env("DBOPS_PIDFILE", &pidfile)
            .env("DBOPS_STOP_SIGNAL", spec.stop_signal)
            .env("DBOPS_GRACE", spec.grace_seconds.to_string())
            .stdin(Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut wrapper = cmd
            .spawn()
            .with_context(|| format!("starting {}", spec.program.display()))?;
        let lifeline = wrapper.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(pid) = std::fs::read_to_string(&pidfile)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
            {
                break pid;
            }
            if Instant::now() > deadline {
                bail!("{}: the wrapper never reported a pid", spec.name);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Ok(Self {
            name: spec.name.clone(),
            wrapper,
            lifeline,
            pid,
            log_path,
            exit: None,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The program's own pid (not the wrapper's).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Sends a signal (`TERM`, `KILL`, `INT`, `STOP`, `CONT`, ...) to the program.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .stderr(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("{}: kill -{signal} {} failed", self.name, self.pid);
        }
        Ok(())
    }

    /// Sends `signal` and waits up to `timeout` for the program to end.
    pub fn signal_and_wait(&mut self, signal: &str, timeout: Duration) -> Result<ExitStatus> {
        self.signal(signal)?;
        self.wait_exit(timeout)
    }

    /// The exit status if the program has ended.
    pub fn try_exit(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self.wrapper.try_wait()?;
        }
        Ok(self.exit)
    }

    /// Waits up to `timeout` for the program to end by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("{} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the program with its stop signal (SIGKILL after the grace period) and waits.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.lifeline.take();
        if let Some(status) = self.exit {
            return Ok(status);
        }
        let status = self.wrapper.wait()?;
        self.exit = Some(status);
        Ok(status)
    }

    /// The last `max_bytes` of the program's log, for error messages.
    pub fn log_tail(&self, max_bytes: u64) -> String {
        log_tail(&self.log_path, max_bytes)
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The last `max_bytes` of a file, lossily decoded.
pub fn log_tail(path: &Path, max_bytes: u64) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max_bytes)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The standard output of a program that ran as `what` (`kubectl kustomize <dir>`, ...),
/// as text; when it failed, an error with `what` and its standard error.
pub fn stdout_text(out: std::process::Output, what: &str) -> Result<String> {
    anyhow::ensure!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).with_context(|| format!("the output of {what}"))
}

/// Whether this process runs as root (PostgreSQL refuses to; it is run as `postgres`).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A TCP port on 127.0.0.1 that was free a moment ago, and never handed out before by
/// this process. It is taken below the kernel's ephemeral range (`ip_local_port_range`,
/// 32768-60999 by default), where the kernel's own choice (`bind` to port 0) would put
/// it: there an outgoing connection of any process may take the port between this check
/// and the server's bind (it happened: a CI run's kube-apiserver exited with "bind:
/// address already in use"). Below that range only listeners compete, and ours come from
/// here, each port once.
pub fn free_port() -> Result<u16> {
    use rand::RngExt;
    static GIVEN: std::sync::Mutex<Option<std::collections::HashSet<u16>>> =
        std::sync::Mutex::new(None);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (ephemeral_low.saturating_sub(12768).max(1024), ephemeral_low);
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let given = given.get_or_insert_with(Default::default);
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let port = rng.random_range(low..high);
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return Ok(port);
        }
    }
    anyhow::bail!("no free port in {low}..{high} after 1000 tries")
}
