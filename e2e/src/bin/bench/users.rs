//! `dbops-bench users`: N Databases with `--users-per-database` DatabaseUsers each
//! (ReadOnly and ReadWrite in turn) on one PostgreSQL server, through the real
//! database-controller, then one password rotation of every one of them (or
//! `--rotations` in a row).
//!
//! Creation: every Database and, right after it, its users are created at once (32
//! requests at a time, as `kubectl apply` of them all would), each with
//! `passwordRotation: {keepPrevious: <--keep-previous>}`; the clock stops when every
//! Database and every user is Ready (watches). Rotation: every Database and every user
//! gets the annotation `dbops.dev/rotate: bench-<round>`; the clocks stop when every
//! connection Secret names a login other than before and every status shows the new
//! `rotateRequest` and that login (watches), then when every status shows no previous
//! login left (it is retired `keepPrevious` after its rotation); the bench then checks in
//! PostgreSQL that every previous login lost LOGIN and that a sample of old and new
//! Secrets is refused and accepted.
//!
//! Reported for each phase: wall time; the controller's API writes by kind (Database
//! status, DatabaseUser status, Secrets, finalizers, Events) from the control plane's
//! audit log, per object; SQL: the statements of the controller's sessions
//! (`application_name` `dbops`) from the server's log (the server runs with
//! `log_statement=all` and `log_connections=on` from its start), by first keyword, DDL
//! among them, and new connections; the controller's own count
//! `dbops_external_requests_total{target="postgres"}` (connections and statements) and
//! `{target="kubernetes"}` (API requests, reads included); reconciles; CPU and peak RSS.
//! Each phase's window ends when the controller has settled (no new audited write and no
//! new reconcile for 3 s), so Events sent off the reconcile's path are counted.
//!
//! The controller runs with a resync interval (`--resync`, default 1h) longer than the
//! run, so no periodic resync falls into a window: what is counted is what the change
//! itself caused. Everything (control plane, server, controller) lives in a temporary
//! directory removed at the end, also on failure.

mod args;
mod report;
mod rotate;
mod wait;
mod window;

pub use args::UsersArgs;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use dbops_api::{Database, DatabaseUser};
use dbops_e2e::PgServer;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::bed::{BenchServer, namespace};
use crate::measure::proc_usage;
use crate::scale;
use args::{USER, db_name, user_of};
use report::{print_window, report};
use rotate::rotate;
use wait::{ready, user_ready, wait_all};
use window::{Bed, Creation, Rotation};

pub async fn run(args: UsersArgs) -> Result<()> {
    ensure!(
        dbops_api::access::parse_duration(&args.keep_previous).is_some(),
        "--keep-previous must be a duration such as 10s or 1m, not {:?}",
        args.keep_previous
    );
    // Control plane, server, controller: each stopped (and its directory removed) when
    // dropped, in reverse order, whatever happens below.
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-users-").await?;
    let pg = PgServer::start_with_settings(
        "users",
        &[("log_statement", "all"), ("log_connections", "on")],
    )
    .await?;
    let ns = namespace(&client, "bench-users").await?;
    let server = BenchServer::create(&client, &ns, &pg).await?;
    let kubeconfig = cp.kubeconfig_for(USER, &["system:masters"])?;
    let mut extra = vec![
        format!("--watch-namespace={ns}"),
        format!("--concurrency={}", args.concurrency),
        format!("--max-sessions-per-server={}", args.sessions),
        format!("--api-rate-limit={}", args.api_rate_limit),
        format!("--resync-interval={}", args.resync),
        format!("--log-filter={}", args.controller_log_filter),
    ];
    extra.extend(server.controller_args());
    let log_dir = tmp.path().join("controller");
    let controller = crate::bed::start_database_controller(&kubeconfig, &log_dir, &extra)?;
    scale::wait_readyz(&controller, Duration::from_secs(120)).await?;
    let bed = Bed {
        cp: &cp,
        pg: &pg,
        controller: &controller,
        ns: &ns,
        ours: [ns.clone(), server.controller_namespace.clone()].into(),
        events: Api::namespaced(client.clone(), &ns),
    };
    let outcome = measure(&client, &bed, &args).await;
    if let Err(e) = &outcome {
        eprintln!(
            "{e:#}\n---- controller log tail ----\n{}",
            controller.process.log_tail(4000)
        );
    }
    if let Some(dir) = &args.keep_logs {
        let logs = [
            pg.log_path(),
            cp.audit_log_path(),
            controller.process.log_path().to_path_buf(),
        ];
        keep_logs(dir, &logs)?;
    }
    let (creation, rounds) = outcome?;
    let (_, peak) = proc_usage(controller.process.pid())?;
    drop(controller);
    report(&args, &creation, &rounds, peak, &pg).await;
    let anomalies: usize = rounds.iter().map(|r| r.anomalies.len()).sum();
    if anomalies > 0 {
        bail!("{anomalies} anomalies after the rotations (see the report)");
    }
    drop(pg);
    drop(cp);
    drop(tmp);
    Ok(())
}

/// Copies each file into `dir` (created if need be).
fn keep_logs(dir: &Path, files: &[std::path::PathBuf]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for file in files {
        let name = file.file_name().context("a log without a file name")?;
        std::fs::copy(file, dir.join(name))
            .with_context(|| format!("copying {} into {}", file.display(), dir.display()))?;
    }
    eprintln!("logs kept in {}", dir.display());
    Ok(())
}

async fn measure(
    client: &kube::Client,
    bed: &Bed<'_>,
    args: &UsersArgs,
) -> Result<(Creation, Vec<Rotation>)> {
    let dbs: Api<Database> = Api::namespaced(client.clone(), bed.ns);
    let users: Api<DatabaseUser> = Api::namespaced(client.clone(), bed.ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), bed.ns);
    let n = args.databases;
    let keep = json!({"keepPrevious": args.keep_previous});

    // Creation.
    println!(
        "# users benchmark: {n} Databases with {} DatabaseUsers each ({} objects), keepPrevious {}\n",
        args.users_per_database,
        args.objects(),
        args.keep_previous
    );
    let mark = bed.mark().await?;
    let t0 = mark.t0;
    let db_ready = wait_all(dbs.clone(), n as usize, t0, args.limit(), |d: &Database| {
        d.status
            .as_ref()
            .is_some_and(|s| s.observed_generation == d.metadata.generation && ready(&s.conditions))
    });
    let user_ready = wait_all(users.clone(), args.users(), t0, args.limit(), user_ready);
    let keep = &keep;
    let create = stream::iter(0..n)
        .flat_map(|i| {
            let db = json!({
                "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
                "metadata": {"name": db_name(i)},
                "spec": {"serverRef": {"name": bed.ns}, "passwordRotation": keep},
            });
            let users = (0..args.users_per_database).map(move |j| {
                let (name, access) = user_of(i, j);
                json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseUser",
                    "metadata": {"name": name},
                    "spec": {"databaseRef": {"name": db_name(i)}, "access": access,
                             "passwordRotation": keep},
                })
            });
            stream::iter(std::iter::once(db).chain(users))
        })
        .map(|object| {
            let (dbs, users) = (dbs.clone(), users.clone());
            async move {
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let pp = PostParams::default();
                if object["kind"] == "Database" {
                    let db: Database = serde_json::from_value(object)?;
                    dbs.create(&pp, &db).await.map(drop)
                } else {
                    let user: DatabaseUser = serde_json::from_value(object)?;
                    users.create(&pp, &user).await.map(drop)
                }
                .with_context(|| format!("creating {name}"))
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>();
    let (created, dbs_ready, users_ready) = tokio::join!(create, db_ready, user_ready);
    created?;
    let dbs_ready = dbs_ready?;
    let all_ready = dbs_ready.max(users_ready?);
    let window = bed.window(&mark).await?;
    let creation = Creation {
        dbs_ready,
        all_ready,
        window,
    };
    print_window(
        &format!(
            "creation: {n} Databases and {} users to Ready",
            args.users()
        ),
        args,
        &creation.window,
    );
    println!(
        "time: all Databases Ready {:.1} s, all Databases and users Ready {:.1} s\n",
        creation.dbs_ready, creation.all_ready
    );

    let mut rounds = Vec::new();
    for round in 1..=args.rotations {
        let r = rotate(bed, args, round, &dbs, &users, &secrets).await?;
        print_window(
            &format!(
                "rotation {round}: every Database and user annotated dbops.dev/rotate=bench-{round}"
            ),
            args,
            &r.window,
        );
        println!(
            "time: annotated {:.1} s; every Secret names the new login {:.1} s, every Database status {:.1} s, every DatabaseUser status {:.1} s; every previous login retired {:.1} s ({} checked in pg_roles); rotations on the server (VALID UNTIL <time>): {}\n",
            r.annotated,
            r.secrets,
            r.db_status,
            r.user_status,
            r.retired,
            r.previous_checked,
            r.expiries
        );
        for a in &r.anomalies {
            println!("**ANOMALY** (rotation {round}): {a}\n");
        }
        rounds.push(r);
    }
    Ok((creation, rounds))
}
