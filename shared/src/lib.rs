//! Plumbing every dbops controller uses: flags, telemetry, metrics, health, backoff,
//! conditions, the backup store, leader election, the API rate limit and the generic controller runner.

pub mod api_path;
pub mod artifact_copy;
pub mod backoff;
pub mod backup_store;
pub mod checksum;
pub mod cli;
pub mod client;
pub mod compact_store;
pub mod conditions;
pub mod controller;
pub mod events;
pub mod finalizer;
pub mod health;
pub mod leader;
pub mod memo;
pub mod metrics;
pub mod pg_tools;
pub mod poll;
pub mod pooler;
pub mod postgres;
pub mod rate_limit;
pub mod ref_index;
mod relisted;
pub mod sealing;
pub mod server;
pub mod shared_watch;
pub mod shutdown;
pub mod startup;
pub mod status;
pub mod store_ready;
pub mod telemetry;
pub mod watch_health;
