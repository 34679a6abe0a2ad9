//! The dev environment keeps its controllers running as a kubelet keeps a Pod's
//! containers: one that exits (a crash, or a watch that kept failing) is started again
//! after a backoff, 2 s doubling up to 60 s, back to 2 s once it has run 5 minutes. Each
//! exit and restart is printed and appended to `<state>/restarts`, which `e2e/dev status`
//! shows: the README's first command never leaves a dead controller behind (issue 35).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use dbops_e2e::ControllerProcess;

/// The first wait before a restart; doubled after each restart that did not last.
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A controller that ran this long starts over from [`FIRST_BACKOFF`].
const STEADY: Duration = Duration::from_secs(300);
/// How often the controllers are looked at.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// How one controller is started, and how it fares.
pub struct Supervisee {
    pub name: &'static str,
    pub port: u16,
    pub args: Vec<String>,
    pub process: Option<ControllerProcess>,
    started: Instant,
    backoff: Duration,
    restart_at: Option<Instant>,
    pub restarts: u32,
}

impl Supervisee {
    pub fn new(
        name: &'static str,
        port: u16,
        args: Vec<String>,
        process: ControllerProcess,
    ) -> Self {
        Self {
            name,
            port,
            args,
            process: Some(process),
            started: Instant::now(),
            backoff: FIRST_BACKOFF,
            restart_at: None,
            restarts: 0,
        }
    }
}

/// What the controllers need to start: the kubeconfig, the log directory and the state
/// directory (for `restarts`).
pub struct Paths {
    pub kubeconfig: PathBuf,
    pub logs: PathBuf,
    pub state: PathBuf,
}

/// The next wait after one that was `backoff`, for a controller that ran `ran`.
fn next_backoff(backoff: Duration, ran: Duration) -> Duration {
    if ran >= STEADY {
        FIRST_BACKOFF
    } else {
        (backoff * 2).min(MAX_BACKOFF)
    }
}

/// Looks after `controllers` until `stop` resolves (SIGTERM or Ctrl-C).
pub async fn supervise(
    controllers: &mut [Supervisee],
    paths: &Paths,
    stop: impl std::future::Future<Output = Result<()>>,
) -> Result<()> {
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            r = &mut stop => return r,
            () = tokio::time::sleep(LOOK_EVERY) => {}
        }
        for c in controllers.iter_mut() {
            look_after(c, paths);
        }
    }
}

/// One look at a controller: an exit is noted and its restart scheduled; a restart due
/// is made.
fn look_after(c: &mut Supervisee, paths: &Paths) {
    let now = Instant::now();
    if let Some(process) = c.process.as_mut()
        && let Ok(Some(status)) = process.process.try_exit()
    {
        let ran = now.duration_since(c.started);
        if ran >= STEADY {
            c.backoff = FIRST_BACKOFF;
        }
        let wait = c.backoff;
        c.backoff = next_backoff(c.backoff, ran);
        c.process = None;
        c.restart_at = Some(now + wait);
        note(
            paths,
            &format!(
                "{} exited ({status}) after {:.0}s; restarting in {}s (log: {})",
                c.name,
                ran.as_secs_f64(),
                wait.as_secs(),
                paths.logs.join(format!("{}.log", c.name)).display()
            ),
        );
    }
    if c.process.is_none() && c.restart_at.is_some_and(|at| now >= at) {
        match ControllerProcess::start_on(c.name, &paths.kubeconfig, &paths.logs, c.port, &c.args) {
            Ok(process) => {
                c.restarts += 1;
                c.started = Instant::now();
                c.restart_at = None;
                c.process = Some(process);
                note(
                    paths,
                    &format!("{} restarted (restart {})", c.name, c.restarts),
                );
            }
            Err(e) => {
                let wait = c.backoff;
                c.backoff = next_backoff(c.backoff, Duration::ZERO);
                c.restart_at = Some(Instant::now() + wait);
                note(
                    paths,
                    &format!(
                        "{} did not start again: {e:#}; next try in {}s",
                        c.name,
                        wait.as_secs()
                    ),
                );
            }
        }
    }
}

/// Prints `line` and appends it, timestamped, to `<state>/restarts`.
fn note(paths: &Paths, line: &str) {
    use std::io::Write;
    let stamped = format!(
        "{} {line}",
        k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ")
    );
    println!("{stamped}");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(restarts_file(&paths.state));
    if let Ok(mut f) = file {
        let _ = writeln!(f, "{stamped}");
    }
}

/// Where the restarts are written.
pub fn restarts_file(state: &Path) -> PathBuf {
    state.join("restarts")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_to_a_ceiling_and_starts_over_after_a_steady_run() {
        let mut b = FIRST_BACKOFF;
        let mut seen = Vec::new();
        for _ in 0..7 {
            b = next_backoff(b, Duration::from_secs(1));
            seen.push(b.as_secs());
        }
        assert_eq!(seen, [4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(next_backoff(MAX_BACKOFF, STEADY), FIRST_BACKOFF);
    }
}
