//! `chartgen`: writes the Helm chart `charts/dbops` from `deploy/` (see
//! `dbops_e2e::chart`), or with `--check` fails, with a diff, when the committed chart
//! differs from what `deploy/` generates (the drift check).
//!
//!     cargo run -p dbops-e2e --bin chartgen             # regenerate charts/dbops
//!     cargo run -p dbops-e2e --bin chartgen -- --check  # the drift check

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use dbops_e2e::{chart, paths};

#[derive(Parser, Debug)]
#[command(
    name = "chartgen",
    about = "Generates charts/dbops from deploy/ (kustomize)"
)]
struct Cli {
    /// Generate into a temporary directory and fail when charts/dbops differs.
    #[arg(long)]
    check: bool,
    /// The kustomization the chart is generated from.
    #[arg(long, default_value_os_t = paths::repo_root().join("deploy"))]
    deploy: PathBuf,
    /// The chart's directory (replaced as a whole).
    #[arg(long, default_value_os_t = paths::repo_root().join(chart::CHART_DIR))]
    out: PathBuf,
}

fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    if cli.check {
        return Ok(match chart::check(&cli.deploy, &cli.out)? {
            None => {
                eprintln!(
                    "{} is what {} generates",
                    cli.out.display(),
                    cli.deploy.display()
                );
                ExitCode::SUCCESS
            }
            Some(diff) => {
                eprintln!(
                    "{} is not what {} generates; run `{}`:\n{diff}",
                    cli.out.display(),
                    cli.deploy.display(),
                    chart::GENERATOR
                );
                ExitCode::FAILURE
            }
        });
    }
    // Generated beside the chart, then swapped in: a failure leaves the old one.
    let parent = cli
        .out
        .parent()
        .context("the chart's directory has no parent")?;
    std::fs::create_dir_all(parent)?;
    let staging = tempfile::Builder::new()
        .prefix(".chartgen-")
        .tempdir_in(parent)?;
    let fresh = staging.path().join("chart");
    chart::generate(&cli.deploy, &fresh)?;
    if cli.out.exists() {
        std::fs::remove_dir_all(&cli.out)
            .with_context(|| format!("removing the old {}", cli.out.display()))?;
    }
    std::fs::rename(&fresh, &cli.out)?;
    eprintln!("wrote {}", cli.out.display());
    Ok(ExitCode::SUCCESS)
}
