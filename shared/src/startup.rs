//! The start of a controller binary: the flag groups the controllers that reach
//! PostgreSQL servers and the backup store share, and the telemetry its `main` sets up
//! first.

use crate::cli::{BackupStoreArgs, CommonArgs, PostgresArgs};
use crate::telemetry::{self, TelemetryGuard};

/// The flags of a controller that reaches PostgreSQL servers and the backup store (the
/// database- and backup-controller): flattened into its own `Args`.
#[derive(clap::Args, Clone, Debug)]
pub struct StoreControllerArgs {
    #[command(flatten)]
    pub common: CommonArgs,

    #[command(flatten)]
    pub postgres: PostgresArgs,

    #[command(flatten)]
    pub store: BackupStoreArgs,
}

/// Telemetry for the binary `name` as `common` asks: the guard that flushes it at exit,
/// or `None` once the reason it cannot start is printed (`<name>: <error>`); `main` then
/// exits with failure.
pub fn telemetry(name: &'static str, common: &CommonArgs) -> Option<TelemetryGuard> {
    match telemetry::init(name, common) {
        Ok(guard) => Some(guard),
        Err(error) => {
            eprintln!("{name}: {error}");
            None
        }
    }
}
