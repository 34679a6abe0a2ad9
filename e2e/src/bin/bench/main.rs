//! dbops-bench: benchmarks of the controllers on a real test bed (reports, not tests).
//! This file parses the command line and dispatches; each subcommand is a module:
//! `databases` (see `databases.rs`), `backup`, `secrets`, `outage`, `chaos`, `migration`,
//! `users`, `pooler-auth`, `pooler-load`. What they share: the bed (`bed.rs`: control plane, namespaces,
//! DatabaseServers, Databases and waits) and the measurements (`measure.rs`: API writes,
//! /proc usage, audited writes by kind).

use anyhow::Result;
use clap::{Parser, Subcommand};

mod backup;
mod backup_encryption;
mod bed;
mod chaos;
mod clone;
mod databases;
mod measure;
mod migration;
mod outage;
mod pooler;
mod pooler_load;
mod scale;
mod secrets;
mod users;

#[derive(Parser, Debug)]
#[command(name = "dbops-bench", about = "dbops benchmarks (reports, not tests)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Provision N Databases through the controller and by a direct baseline.
    Databases(databases::DatabasesArgs),
    /// Dump and restore a pgbench database through the controllers and by hand.
    Backup(backup::BackupArgs),
    /// A dump and a restore of random bytes through the controllers, plain against
    /// encrypted (age), side by side.
    BackupEncryption(backup_encryption::EncryptionArgs),
    /// Preview branches: a clone (`cloneFrom.databaseRef`) against `pg_dump | pg_restore`
    /// by hand, and many previews cloned at once.
    Clone(clone::CloneArgs),
    /// The database-controller's RSS with and without many unrelated Secrets.
    Secrets(secrets::SecretsArgs),
    /// What a PostgreSQL outage costs: connection attempts, status writes, recovery.
    Outage(outage::OutageArgs),
    /// Random SIGKILLs of leader-elected replicas and restarts of PostgreSQL and the
    /// apiserver under a random workload, then invariants (non-zero exit on a violation).
    Chaos(chaos::ChaosArgs),
    /// Write unavailability, duration and lost writes of a Migration in Dump and Logical
    /// mode, at a few database sizes, under a writer that follows the connection Secret.
    Migration(migration::MigrationArgs),
    /// N Databases with DatabaseUsers each to Ready, then one password rotation of all of
    /// them: time, API writes by kind, SQL.
    Users(users::UsersArgs),
    /// Client authentication through PgBouncer: dbops's userlist of SCRAM verifiers
    /// against auth_query, side by side (connections per second, queries on the server).
    PoolerAuth(pooler::PoolerAuthArgs),
    /// A shared server with max_connections=100: many clients over many databases
    /// through the pooler, and pgbench through the pooler against direct.
    PoolerLoad(pooler_load::PoolerLoadArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Command::Databases(args) = &cli.command {
        args.check_room()?;
        if let Some(dir) = args.data_dir()
            && std::env::var_os("TMPDIR").is_none_or(|t| t != dir)
        {
            // The temporary directories (control plane, servers) on the tmpfs: the same
            // program again with TMPDIR set, in place of this one.
            use std::os::unix::process::CommandExt;
            let exe = std::env::current_exe()?;
            let err = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env("TMPDIR", dir)
                .exec();
            return Err(err.into());
        }
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(cli))
}

async fn run(cli: Cli) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match cli.command {
        Command::Databases(args) => databases::run(args).await,
        Command::Backup(args) => backup::run(args).await,
        Command::Clone(args) => clone::run(args).await,
        Command::BackupEncryption(args) => backup_encryption::run(args).await,
        Command::Secrets(args) => secrets::run(args).await,
        Command::Outage(args) => outage::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Migration(args) => migration::run(args).await,
        Command::Users(args) => users::run(args).await,
        Command::PoolerAuth(args) => pooler::run(args).await,
        Command::PoolerLoad(args) => pooler_load::run(args).await,
    }
}
