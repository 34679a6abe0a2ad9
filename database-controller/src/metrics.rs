//! The database-controller's own metrics, registered on the process's registry at its
//! start (`dbops_shared::metrics::Metrics::register`):
//!
//! - `dbops_database_size_bytes{namespace, database}`: each Database's database on disk
//!   (`pg_database_size`) at its last reading (the Database's metadata.name);
//! - `dbops_routine_checks_deferred_total`: routine full checks of converged Databases
//!   put off because every session slot of their server was busy.
//!
//! Process-wide, like the shared request counters: the reconciles record through the free
//! functions below.

use std::sync::LazyLock;

use dbops_shared::metrics::Registry;
use dbops_shared::register_metrics as register;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SizeLabels {
    namespace: String,
    database: String,
}

static DATABASE_SIZE: LazyLock<Family<SizeLabels, Gauge>> = LazyLock::new(Family::default);

static ROUTINE_CHECKS_DEFERRED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Registers this controller's families on the process's registry.
pub fn register(registry: &mut Registry) {
    register! { registry;
        "database_size_bytes" => DATABASE_SIZE,
            "Size on disk of each Database's database (pg_database_size) at its last reading";
        "routine_checks_deferred" => ROUTINE_CHECKS_DEFERRED,
            "Routine full checks of converged Databases put off because every session slot of their server was busy";
    }
}

/// Sets the size of Database `namespace/database`.
pub fn set_database_size(namespace: &str, database: &str, bytes: i64) {
    DATABASE_SIZE
        .get_or_create(&SizeLabels {
            namespace: namespace.to_owned(),
            database: database.to_owned(),
        })
        .set(bytes);
}

/// Drops the series of a Database that is gone.
pub fn forget_database_size(namespace: &str, database: &str) {
    DATABASE_SIZE.remove(&SizeLabels {
        namespace: namespace.to_owned(),
        database: database.to_owned(),
    });
}

/// Counts one routine check put off for a busy server.
pub fn record_routine_check_deferred() {
    ROUTINE_CHECKS_DEFERRED.inc();
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_shared::metrics::Metrics;

    #[test]
    fn the_database_controllers_families_are_its_own() {
        let metrics = Metrics::new("database-controller");
        metrics.register(register);
        set_database_size("ns", "orders", 8192);
        record_routine_check_deferred();
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(r#"dbops_database_size_bytes{namespace="ns",database="orders"} 8192"#),
            "{text}"
        );
        assert!(
            text.contains("dbops_routine_checks_deferred_total"),
            "{text}"
        );
        let other = Metrics::new("backup-controller").encode().unwrap();
        assert!(!other.contains("database_size_bytes"), "{other}");
        forget_database_size("ns", "orders");
        assert!(!metrics.encode().unwrap().contains(r#"database="orders""#));
    }
}
