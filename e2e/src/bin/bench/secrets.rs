//! `dbops-bench secrets`: the database-controller's memory with and without many Secrets
//! it has no business with. Watching all namespaces, it caches only its connection
//! Secrets (label `app.kubernetes.io/managed-by=dbops`) and the Secrets of its own
//! namespace; 5,000 unrelated Secrets of 32 KiB elsewhere in the cluster (160 MB) should
//! not show in its RSS.
//!
//! Runs, each a fresh controller process on the same control plane, with the same number
//! of Databases in a namespace of its own (the previous run's namespaces deleted first):
//! a warm-up without the noise (reported, not counted), one without, then the noise is
//! created, one with. Reported: each run's RSS once every Database is Ready and the
//! controller has idled through two resyncs, and the difference with and without.

use std::time::Duration;

use anyhow::{Context, Result};
use dbops_e2e::{ControlPlane, PgServer};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, PostParams};

use crate::bed::{BenchServer, namespace};

#[derive(clap::Args, Debug)]
pub struct SecretsArgs {
    /// Unrelated Secrets created in the cluster.
    #[arg(long, default_value_t = 5000)]
    noise: usize,
    /// Size of each unrelated Secret's value, KiB.
    #[arg(long, default_value_t = 32)]
    noise_kib: usize,
    /// Databases (and so connection Secrets) the controller serves in each run.
    #[arg(long, default_value_t = 50)]
    databases: usize,
}

/// The controller's RSS (VmRSS) and peak (VmHWM), KiB.
fn rss(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

pub async fn run(args: SecretsArgs) -> Result<()> {
    let (tmp, cp, client) = crate::bed::start_control_plane("dbops-bench-secrets-").await?;
    let pg = PgServer::start("bench-secrets").await?;
    println!(
        "# secrets benchmark: the database-controller (all namespaces, {} Databases) with and without {} unrelated Secrets of {} KiB\n",
        args.databases, args.noise, args.noise_kib
    );

    let warmup = one_run(&cp, &client, &pg, &args, "warmup", tmp.path()).await?;
    let without = one_run(&cp, &client, &pg, &args, "without", tmp.path()).await?;
    let noise_ns = namespace(&client, "bench-noise").await?;
    create_noise(&client, &noise_ns, &args).await?;
    let with = one_run(&cp, &client, &pg, &args, "with", tmp.path()).await?;

    let mib = |kib: u64| kib as f64 / 1024.0;
    println!("| run | RSS | peak RSS |");
    println!("|---|---|---|");
    for (name, (now, peak)) in [
        ("warm-up, no unrelated Secrets (not counted)", warmup),
        ("no unrelated Secrets", without),
        (
            &*format!("{} unrelated Secrets of {} KiB", args.noise, args.noise_kib),
            with,
        ),
    ] {
        println!("| {name} | {:.1} MiB | {:.1} MiB |", mib(now), mib(peak));
    }
    println!(
        "\nRSS with minus without: {:+.1} MiB (peak {:+.1} MiB); the unrelated Secrets hold {:.0} MiB",
        mib(with.0) - mib(without.0),
        mib(with.1) - mib(without.1),
        (args.noise * args.noise_kib) as f64 / 1024.0
    );
    Ok(())
}

/// One fresh controller serving `args.databases` Databases of its own namespace; returns
/// its RSS and peak once all are Ready and two resyncs have passed.
async fn one_run(
    cp: &ControlPlane,
    client: &kube::Client,
    pg: &PgServer,
    args: &SecretsArgs,
    label: &str,
    dir: &std::path::Path,
) -> Result<(u64, u64)> {
    let ns = namespace(client, &format!("bench-secrets-{label}")).await?;
    let server = BenchServer::create(client, &ns, pg).await?;
    let kubeconfig = cp.kubeconfig_for("dbops-database-controller", &["system:masters"])?;
    let mut extra = vec![
        "--resync-interval=5s".to_string(),
        "--log-filter=warn".to_string(),
    ];
    extra.extend(server.controller_args());
    let log_dir = dir.join(format!("controller-{label}"));
    let controller = crate::bed::start_database_controller(&kubeconfig, &log_dir, &extra)?;
    crate::bed::create_all_ready(client, &ns, &server.name, args.databases, |i| {
        format!("{label}-{i:04}")
    })
    .await?;
    // Two resyncs: every Database reconciled again, the caches settled.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let usage = rss(controller.process.pid())?;
    drop(controller);
    // The next run's controller must not find this run's Databases.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for gone in [ns.clone(), server.controller_namespace.clone()] {
        namespaces.delete(&gone, &DeleteParams::default()).await?;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while namespaces.get_opt(&ns).await?.is_some() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "namespace {ns} not gone in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(usage)
}

/// `args.noise` Opaque Secrets of `args.noise_kib` KiB each in `ns`.
async fn create_noise(client: &kube::Client, ns: &str, args: &SecretsArgs) -> Result<()> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let value = "x".repeat(args.noise_kib * 1024);
    stream::iter(0..args.noise)
        .map(|i| {
            let secrets = secrets.clone();
            let value = value.clone();
            async move {
                let secret: Secret = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("noise-{i:05}")},
                    "stringData": {"blob": value},
                }))?;
                secrets
                    .create(&PostParams::default(), &secret)
                    .await
                    .with_context(|| format!("creating Secret noise-{i:05}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}
