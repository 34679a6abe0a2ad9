//! Which namespaces' connection Secrets are needed: a Database needs its namespace's while
//! neither it nor its namespace is being deleted and either its DatabaseServer (one this
//! installation serves, not being deleted) allows the namespace, or it is already
//! provisioned on a served server (such a Database stays admitted, see `admit`).

use std::collections::BTreeSet;
use std::sync::Arc;

use dbops_api::Database;
use dbops_shared::server::Directory;

/// What decides whether a Database needs its namespace's Secrets: the DatabaseServers
/// this installation serves and the namespaces (the [`Directory`]; a table in tests).
pub trait Tenancy {
    /// Whether this installation serves DatabaseServer `server`.
    fn serves(&self, server: &str) -> bool;
    /// Whether `server` is served, not being deleted, and allows `namespace`.
    fn allows(&self, server: &str, namespace: &str) -> bool;
    /// Whether `namespace` is being deleted, or gone.
    fn namespace_terminating(&self, namespace: &str) -> bool;
}

impl Tenancy for Directory {
    fn serves(&self, server: &str) -> bool {
        self.get(server).is_some()
    }

    fn allows(&self, server: &str, namespace: &str) -> bool {
        self.get(server).is_some_and(|s| {
            s.metadata.deletion_timestamp.is_none() && self.admits(&s, namespace).is_ok()
        })
    }

    fn namespace_terminating(&self, namespace: &str) -> bool {
        Directory::namespace_terminating(self, namespace)
    }
}

/// Whether `db` needs the connection Secrets of its namespace (see the module's
/// documentation).
pub fn needs_secrets(db: &Database, tenancy: &impl Tenancy) -> bool {
    let Some(namespace) = db.metadata.namespace.as_deref() else {
        return false;
    };
    if db.metadata.deletion_timestamp.is_some() || tenancy.namespace_terminating(namespace) {
        return false;
    }
    let provisioned_on = db
        .status
        .as_ref()
        .filter(|s| s.provider_id.is_some())
        .and_then(|s| s.server.as_deref());
    provisioned_on.is_some_and(|server| tenancy.serves(server))
        || tenancy.allows(&db.spec.server_ref.name, namespace)
}

/// The namespaces whose connection Secrets some of `databases` need.
pub fn needed(databases: &[Arc<Database>], tenancy: &impl Tenancy) -> BTreeSet<String> {
    databases
        .iter()
        .filter(|db| needs_secrets(db, tenancy))
        .filter_map(|db| db.metadata.namespace.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    /// Served servers with the namespaces each allows; namespaces being deleted.
    #[derive(Default)]
    struct Table {
        allows: HashMap<&'static str, HashSet<&'static str>>,
        terminating: HashSet<&'static str>,
    }

    impl Tenancy for Table {
        fn serves(&self, server: &str) -> bool {
            self.allows.contains_key(server)
        }
        fn allows(&self, server: &str, namespace: &str) -> bool {
            self.allows
                .get(server)
                .is_some_and(|namespaces| namespaces.contains(namespace))
        }
        fn namespace_terminating(&self, namespace: &str) -> bool {
            self.terminating.contains(namespace)
        }
    }

    fn database(namespace: &str, name: &str, server: &str, on: Option<&str>) -> Arc<Database> {
        let mut db: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"serverRef": {"name": server}}
        }))
        .unwrap();
        if let Some(on) = on {
            db.status = Some(dbops_api::DatabaseStatus {
                server: Some(on.into()),
                provider_id: Some("h:5432/1".into()),
                ..Default::default()
            });
        }
        Arc::new(db)
    }

    #[test]
    fn a_namespace_is_needed_where_a_served_server_allows_a_database_or_one_is_provisioned() {
        let table = Table {
            allows: HashMap::from([
                ("pg-main", HashSet::from(["shop", "billing", "leaving"])),
                ("pg-closed", HashSet::new()),
            ]),
            terminating: HashSet::from(["leaving"]),
        };
        let mut deleting = (*database("gone", "db", "pg-main", None)).clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let databases = vec![
            // Allowed: needed.
            database("shop", "orders", "pg-main", None),
            // No longer allowed, but provisioned on a served server: still needed.
            database("legacy", "kept", "pg-closed", Some("pg-closed")),
            // Not allowed, not provisioned: not needed.
            database("stranger", "refused", "pg-closed", None),
            // A server this installation does not serve.
            database("elsewhere", "theirs", "pg-other", None),
            database("elsewhere", "was-theirs", "pg-other", Some("pg-other")),
            // Allowed, but the namespace is being deleted.
            database("leaving", "db", "pg-main", None),
            // Allowed (by name), but the Database is being deleted.
            Arc::new(deleting),
        ];
        assert_eq!(
            needed(&databases, &table),
            BTreeSet::from(["legacy".to_string(), "shop".to_string()])
        );
        // A namespace a server allows but where no Database is: not needed.
        assert!(!needed(&databases, &table).contains("billing"));
    }
}
