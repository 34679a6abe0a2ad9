//! `dbops-bench chaos`: faults nobody scripted, against the real test bed, then
//! invariants (issue 12, part 3).
//!
//! One control plane, two PostgreSQL servers (two DatabaseServers, `chaos-a` and
//! `chaos-b`, served by every controller through `--server-selector`), a `file://`
//! backup store shared by the database- and backup-controller, and `--replicas` (2)
//! leader-elected replicas of each of the three controllers, each with its own client
//! certificate (the audit log tells them apart), `POD_NAME` and log directory, run from
//! copies of the binaries taken at the start (a rebuild during the run changes nothing).
//! Then, until `--kills` SIGKILLs or `--duration` seconds:
//!
//! - a killer ([`faults`]) SIGKILLs a random running replica (never both of one
//!   controller at once) every `--min-gap`..`--max-gap` seconds and starts it again after
//!   0.2-5 s, half the time under its old name (a container restart: it takes its Lease
//!   back at once), half under a new one (a new pod: the Lease must expire first); less
//!   often it restarts a PostgreSQL server (fast shutdown, 1-8 s down) or kube-apiserver
//!   (SIGTERM or SIGKILL, same port and etcd), at least once each per run. A replica that
//!   exits by itself (a deposed leader does) is started again, as a kubelet would;
//! - a driver ([`driver`]) creates, edits (connection limit, deletion policy, schedule, a
//!   connection Secret's password) and deletes Databases (all three deletion policies,
//!   some restored from a Backup), Backups, scheduled Backups (every minute, `keepLast`)
//!   and Migrations (both directions, Automatic and Manual cutover, now and then deleted
//!   in flight), at most `--max-databases` Databases at once; like a user it deletes a
//!   failed final snapshot when a `Snapshot` deletion's condition asks for it;
//! - a writer ([`writer`]) per migrated Database inserts numbered rows through its
//!   connection Secret (whatever it says at the moment, reconnecting on failure) and
//!   records which inserts committed.
//!
//! Then the faults stop and the driver goes on for `--calm` seconds (a deletion seconds
//! after the last restart must be done by processes that are not restarted again);
//! schedules are removed and Manual Migrations approved; every object must settle
//! within `--settle-timeout` ([`check`]): no deletionTimestamp left, Backups Completed or
//! Failed, Migrations ended, Databases Ready at their generation (with their edited
//! password rotated) or in a permanent reported state. Then the invariants:
//!
//! 1. every marked PostgreSQL database and role belongs to a Database on that very
//!    server (or to a deleted one with policy `Retain`), none twice, nothing unmarked,
//!    and every Ready Database has its database and role;
//! 2. every Ready Database's connection Secret (`PG*` keys) logs in, to its server;
//! 3. every Completed Backup has exactly one artifact whose SHA-256 matches its status
//!    and its manifest; no partial or temporary file is left; no artifact of a deleted
//!    Backup with `deletionPolicy: Delete`;
//! 4. no finalizer stuck (nothing still deleting after the settle timeout);
//! 5. no committed write lost: every row a writer saw committed is on the server its
//!    Database ends on (or, deleted with `Retain`, was last on);
//! 6. no Database ends in a state nothing in the run should cause (`DatabaseMissing`,
//!    `NameConflict`, `SecretConflict`, `ChecksumMismatch`, `ArtifactNotFound`);
//! 7. liveness: no deletion and no Database spec change waited more than
//!    `--max-latency` seconds (measured from lists, not from a watch, which may lag).
//!
//! Every fault, action, observation and violation is printed as it happens (and to
//! `journal.log` in the run directory); a violation comes with the controllers' log
//! lines about the object and the faults around it (`evidence/` in the run directory,
//! which is kept when anything was found, with `--keep` or `--self-test`). An object
//! that did not settle is also given a diagnosis: its controller's leader is restarted
//! and the run says whether a fresh process settles it. The exit status is non-zero on
//! any violation. `--self-test` breaks one thing per invariant after settling and passes
//! only when each is caught. The harness's own client logging is off unless `RUST_LOG`
//! is set. `dbops-bench chaos --duration 60` is the short run (about two and a half
//! minutes in all); `dbops-bench chaos --kills 1000` is the long run.

mod args;
mod check;
mod driver;
mod evidence;
mod faults;
mod history;
mod inject;
mod settle;
mod watches;
mod world;
mod writer;

pub use args::ChaosArgs;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::DatabaseServer;
use dbops_e2e::controlplane::Options;
use dbops_e2e::{ControlPlane, PgServer};
use kube::api::Api;

use crate::bed::namespace;
use world::{Journal, NS, SERVER_LABEL, SYSTEM_NS, ServerInfo, World, spawn};

/// The CLI entry: [`run_chaos`], non-zero exit on any violation. Unless `RUST_LOG` is
/// set, the harness's own tracing is off: its clients' errors while the apiserver is
/// down would bury the journal (the controllers' logs are in the run directory).
pub async fn run(args: ChaosArgs) -> Result<()> {
    use tracing::instrument::WithSubscriber;
    let outcome = if std::env::var_os("RUST_LOG").is_some() {
        run_chaos(args).await?
    } else {
        run_chaos(args)
            .with_subscriber(tracing::Dispatch::none())
            .await?
    };
    if outcome.violations.is_empty() {
        Ok(())
    } else {
        bail!(
            "{} invariant violation(s); the run directory is {}",
            outcome.violations.len(),
            outcome.dir.display()
        )
    }
}

/// What a run found.
pub struct Outcome {
    pub violations: Vec<String>,
    /// The run directory (deleted unless violations were found or `--keep`).
    pub dir: PathBuf,
}

/// One chaos run: set up, faults and driver until the limit, settle, check.
pub async fn run_chaos(mut args: ChaosArgs) -> Result<Outcome> {
    if args.kills.is_none() && args.duration.is_none() {
        args.duration = Some(120);
    }
    if !(args.min_gap >= 0.0 && args.max_gap >= args.min_gap) {
        bail!("--min-gap must be >= 0 and <= --max-gap");
    }
    if !args.leader_elect && args.replicas > 1 {
        bail!("--leader-elect false needs --replicas 1");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let wall = Instant::now();
    let tmp = tempfile::Builder::new().prefix("dbops-chaos-").tempdir()?;
    let dir = tmp.path().to_path_buf();
    let journal = Journal::new(&dir.join("journal.log"));
    journal.line(
        "START",
        format!(
            "seed {seed}, kills {:?}, duration {:?} s, max {} Databases, run directory {}",
            args.kills,
            args.duration,
            args.max_databases,
            dir.display()
        ),
    );

    let cp = ControlPlane::start(Options {
        dir: dir.join("cp"),
        apiserver_port: None,
    })
    .await?;
    let client = cp.client().await?;
    namespace(&client, NS).await?;
    namespace(&client, SYSTEM_NS).await?;

    let mut pgs = Vec::new();
    let mut servers = Vec::new();
    for name in ["chaos-a", "chaos-b"] {
        let pg = PgServer::start(name).await?;
        crate::bed::create_plain_server(&client, SYSTEM_NS, name, &pg, (SERVER_LABEL, NS)).await?;
        servers.push(ServerInfo {
            name: name.to_string(),
            port: pg.port(),
            password: pg.superuser_password().to_string(),
        });
        pgs.push(Arc::new(tokio::sync::Mutex::new(pg)));
    }
    let store = dir.join("store");
    std::fs::create_dir_all(&store)?;

    let world = Arc::new(World {
        client: client.clone(),
        servers,
        store: store.clone(),
        dir: dir.clone(),
        journal,
        history: history::History::default(),
        waited_for_person: Mutex::new(std::collections::BTreeSet::new()),
        stop_faults: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    let cp = Arc::new(tokio::sync::Mutex::new(cp));
    let fleet = Arc::new(faults::Fleet::new(
        &*cp.lock().await,
        &dir,
        &store,
        usize::from(args.replicas),
        args.leader_elect,
    )?);
    fleet.start_all(&world).await?;
    wait_servers_ready(&client).await?;
    world.journal.line(
        "READY",
        format!(
            "{} controller replicas, 2 DatabaseServers Ready after {:.0} s",
            fleet.replicas.len(),
            world.journal.elapsed().as_secs_f64()
        ),
    );

    let watchers = watches::spawn(world.clone());
    let writers = Arc::new(writer::Writers::default());
    let supervisor = spawn(faults::supervise(world.clone(), fleet.clone()));
    let killer = spawn(faults::kill_loop(
        world.clone(),
        fleet.clone(),
        cp.clone(),
        pgs.clone(),
        args.clone(),
        seed,
    ));
    let driver = spawn(driver::run(
        world.clone(),
        writers.clone(),
        args.max_databases,
        seed ^ 0x9e37_79b9_7f4a_7c15,
    ));

    // Until the duration passes or the killer has done its kills (it sets `stop_faults`).
    let chaos_started = Instant::now();
    let limit = args.duration.map(Duration::from_secs);
    while !world.faults_stopping() {
        if limit.is_some_and(|l| chaos_started.elapsed() >= l) {
            world.stop_faults.store(true, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let chaos_secs = chaos_started.elapsed().as_secs_f64();
    world.journal.line(
        "STOP",
        format!(
            "faults stop after {chaos_secs:.0} s; the driver goes on for {} s (calm)",
            args.calm
        ),
    );
    killer.await.context("the killer panicked")??;
    fleet
        .wait_all_running(&world, Duration::from_secs(180))
        .await?;
    for pg in &pgs {
        pg.lock().await.start_again().await?;
    }
    // Calm: what is asked now (a deletion seconds after the last restart) must be done
    // by processes that are not restarted any more.
    tokio::time::sleep(Duration::from_secs(args.calm)).await;
    world.stop.store(true, Ordering::SeqCst);
    driver.await.context("the driver panicked")?;
    world.journal.line("STOP", "the driver stops");

    // Settle: what a user would do to let things end, then wait.
    driver::quiesce(&world).await;
    let settle_started = Instant::now();
    let unsettled = settle::settle(&world, Duration::from_secs(args.settle_timeout)).await;
    let settle_secs = settle_started.elapsed().as_secs_f64();
    world.journal.line(
        "SETTLED",
        if unsettled.is_empty() {
            format!("everything settled in {settle_secs:.0} s")
        } else {
            format!(
                "{} object(s) still unsettled after {settle_secs:.0} s",
                unsettled.len()
            )
        },
    );
    writers.stop_all(&world).await;
    let (expected, unsettled) = if args.self_test {
        let expected = inject::inject(&world, &writers).await?;
        (
            expected,
            settle::settle(&world, Duration::from_secs(15)).await,
        )
    } else {
        (Vec::new(), unsettled)
    };
    let stats = check::check_all(&world, &unsettled, &writers, &fleet).await;
    // (7) Liveness: what the user asked is acted on in bounded time.
    if args.max_latency > 0 {
        let person = world
            .waited_for_person
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default();
        for l in world.history.waits() {
            if l.secs <= args.max_latency as f64 {
                break;
            }
            if l.pending || (l.kind == "Database" && person.contains(&l.name)) {
                continue;
            }
            world.journal.violation(format!(
                "(7) {} took {:.0} s (from {:.3}; bound {} s)",
                l.what, l.secs, l.since, args.max_latency
            ));
            let to = l.since + k8s_openapi::jiff::SignedDuration::from_secs_f64(l.secs);
            let text = evidence::evidence(&world, &fleet, l.kind, &l.name, Some((l.since, to)));
            evidence::keep_evidence(&world, &format!("slow-{}-{}.txt", l.kind, l.name), &text);
        }
    }
    supervisor.abort();
    for w in watchers {
        w.abort();
    }

    let mut violations = world.journal.violations();
    if args.self_test {
        // Each injected fault must be among the violations; only those may be.
        let mut missed = Vec::new();
        for e in &expected {
            let before = violations.len();
            violations.retain(|v| !v.contains(e.as_str()));
            let caught = before - violations.len();
            world.journal.line(
                "SELF-TEST",
                format!("{}: {e}", if caught > 0 { "caught" } else { "NOT CAUGHT" }),
            );
            if caught == 0 {
                missed.push(format!("self-test: not caught: {e}"));
            }
        }
        violations.extend(missed);
    }
    for l in world.history.slowest(5) {
        world.journal.line(
            "SLOWEST",
            format!("{:.1} s: {} (from {:.3})", l.secs, l.what, l.since),
        );
    }
    let j = &world.journal;
    let summary = format!(
        "seed {seed}; chaos {chaos_secs:.0} s: {} kills ({} of a leader), {} PostgreSQL restarts, {} kube-apiserver restarts, {} replica self-exits; {} actions ({} refused or failed), {} failed final snapshots retried by hand; {}; settle {settle_secs:.0} s; {} violation(s); wall {:.0} s",
        j.kills.load(Ordering::Relaxed),
        j.leader_kills.load(Ordering::Relaxed),
        j.pg_restarts.load(Ordering::Relaxed),
        j.apiserver_restarts.load(Ordering::Relaxed),
        j.self_exits.load(Ordering::Relaxed),
        j.actions.load(Ordering::Relaxed),
        j.action_errors.load(Ordering::Relaxed),
        j.final_retries.load(Ordering::Relaxed),
        stats,
        violations.len(),
        wall.elapsed().as_secs_f64()
    );
    j.line("SUMMARY", &summary);
    for (i, v) in violations.iter().enumerate() {
        println!("  violation {}: {v}", i + 1);
    }

    // Keep the evidence: PostgreSQL logs live in the servers' own temporary directories.
    let keep = args.keep || args.self_test || !violations.is_empty();
    if keep {
        for pg in &pgs {
            let pg = pg.lock().await;
            let path = pg.log_path();
            if let Some(name) = path.file_name() {
                let _ = std::fs::copy(&path, dir.join(name));
            }
        }
    }
    drop(fleet);
    drop(cp);
    let dir = if keep { tmp.keep() } else { dir };
    if keep {
        println!("run directory kept: {}", dir.display());
    }
    Ok(Outcome { violations, dir })
}

async fn wait_servers_ready(client: &kube::Client) -> Result<()> {
    let api: Api<DatabaseServer> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let mut ready = 0;
        for name in ["chaos-a", "chaos-b"] {
            if let Some(s) = api.get_opt(name).await?
                && s.status.as_ref().is_some_and(|st| {
                    st.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                })
            {
                ready += 1;
            }
        }
        if ready == 2 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the DatabaseServers are not Ready after 180 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
