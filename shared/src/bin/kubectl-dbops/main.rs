//! `kubectl dbops`: dbops from the command line, as a kubectl plugin (a binary named
//! `kubectl-dbops` on the PATH). It talks to the API server with the kubeconfig kubectl
//! uses (`KUBECONFIG`, its current context and namespace), and to Jaeger for `trace`.
//!
//! Exit codes: 0 done (or, for `status`, Ready); 1 on the way (`status`: not Ready yet);
//! 2 failed or degraded; 3 not found; 4 a usage or API error.

mod actions;
mod common;
mod status;
mod trace;

use common::{Kube, Outcome};

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "kubectl-dbops",
    bin_name = "kubectl dbops",
    version,
    about = "dbops from kubectl: the state of a Database and what hangs on it, psql with its Secret, backups, restores, migrations, rotations and traces"
)]
struct Cli {
    /// The namespace (default: the kubeconfig context's).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// A Database with its DatabaseUsers, Backups and Migrations, their conditions and
    /// the Database's recent Events, as a tree; the exit code says its health.
    Status(status::StatusArgs),
    /// psql connected with a Database's or DatabaseUser's connection Secret (its CA
    /// handled); arguments after `--` go to psql.
    Psql(actions::PsqlArgs),
    /// A Backup of a Database now.
    Backup(actions::BackupArgs),
    /// A new Database restored from a Backup.
    Restore(actions::RestoreArgs),
    /// A Migration of a Database to another DatabaseServer.
    Migrate(actions::MigrateArgs),
    /// Approves a Migration awaiting approval (its cutover).
    Approve(actions::ApproveArgs),
    /// One password rotation of a Database's owner or of a DatabaseUser.
    Rotate(actions::RotateArgs),
    /// An object's last trace in Jaeger: services, spans, the slowest spans.
    Trace(trace::TraceArgs),
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    let code = match run(cli).await {
        Ok(Outcome::Done) => 0,
        Ok(Outcome::OnTheWay) => 1,
        Ok(Outcome::Failed) => 2,
        Ok(Outcome::NotFound) => 3,
        Err(e) => {
            eprintln!("kubectl dbops: {e:#}");
            4
        }
    };
    std::process::exit(code);
}

async fn run(cli: Cli) -> anyhow::Result<Outcome> {
    let client = kube::Client::try_default().await?;
    let ns = cli
        .namespace
        .unwrap_or_else(|| client.default_namespace().to_string());
    let k = Kube { client, ns };
    match cli.command {
        Command::Status(a) => status::run(&k, a).await,
        Command::Psql(a) => actions::psql(&k, a).await,
        Command::Backup(a) => actions::backup(&k, a).await,
        Command::Restore(a) => actions::restore(&k, a).await,
        Command::Migrate(a) => actions::migrate(&k, a).await,
        Command::Approve(a) => actions::approve(&k, a).await,
        Command::Rotate(a) => actions::rotate(&k, a).await,
        Command::Trace(a) => trace::run(&k, a).await,
    }
}
