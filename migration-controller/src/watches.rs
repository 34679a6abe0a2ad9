//! What brings a Migration back to the reconcile, besides its own new generations: the
//! snapshot Backups it owns, the Databases it moves (mapped through the index on
//! `spec.databaseRef`, and kept in the store Preflight reads) and the DatabaseServers it
//! moves them between.

use std::sync::Arc;

use dbops_api::names::label;
use dbops_api::{Backup, Database, DatabaseServer, Migration};
use dbops_shared::controller::{self, Context};
use kube::ResourceExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::context::State;
use crate::progress;

/// The snapshot Backups the Migrations own, the Databases they move (into the store of
/// `databases`) and the DatabaseServers they move them between.
pub fn watches(
    c: kube::runtime::Controller<Migration>,
    ctx: &Arc<Context<State>>,
    namespace: Option<&str>,
    databases: reflector::store::Writer<Database>,
) -> kube::runtime::Controller<Migration> {
    let client = ctx.client.clone();
    let index = ctx.clone();
    let migrations = c.store();
    let database_watch = watcher(
        controller::scoped_api::<Database>(client.clone(), namespace),
        watcher::Config::default(),
    )
    .default_backoff()
    // The store keeps what Preflight reads; managedFields is most of an object.
    .modify(|d| controller::slim(&mut d.metadata));
    let database_events = reflector::reflector(databases, database_watch).touched_objects();
    c.owns_stream(controller::trigger(
        controller::scoped_api::<Backup>(client, namespace),
        watcher::Config::default().labels(label::MIGRATION),
    ))
    // The process's one watch of DatabaseServers: its Directory's.
    .watches_shared_stream(
        ctx.state.directory.servers_watch().touched(),
        move |server: Arc<DatabaseServer>| migrations_using(&migrations, &server.name_any()),
    )
    .watches_stream(database_events, move |db: Database| {
        let ns = db.metadata.namespace.clone().unwrap_or_default();
        let name = db.metadata.name.clone().unwrap_or_default();
        index
            .state
            .index
            .referrers_of(&ns, &name)
            .into_iter()
            .map(move |m| ObjectRef::new(&m).within(&ns))
    })
}

/// The unfinished Migrations of `migrations` that move a Database to or from `server`.
fn migrations_using(migrations: &Store<Migration>, server: &str) -> Vec<ObjectRef<Migration>> {
    migrations
        .state()
        .iter()
        .filter(|m| uses_server(m, server))
        .map(|m| ObjectRef::from_obj(m.as_ref()))
        .collect()
}

/// Whether `m` has not ended and `server` is its target or its recorded source.
fn uses_server(m: &Migration, server: &str) -> bool {
    let status = m.status.as_ref();
    let source = status.and_then(|s| s.source_server.as_ref());
    !status.is_some_and(progress::is_terminal)
        && (m.spec.target.server_ref.name == server || source.is_some_and(|s| s.name == server))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn migration(target: &str, source: Option<&str>, phase: Option<&str>) -> Migration {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1",
            "kind": "Migration",
            "metadata": {"name": "m", "namespace": "shop"},
            "spec": {"databaseRef": {"name": "orders"}, "target": {"serverRef": {"name": target}}},
            "status": {
                "phase": phase,
                "sourceServer": source.map(|s| serde_json::json!({"name": s})),
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_server_maps_to_the_unfinished_migrations_to_or_from_it() {
        let running = migration("pg-17", Some("pg-16"), Some("Running"));
        assert!(uses_server(&running, "pg-17"), "its target");
        assert!(uses_server(&running, "pg-16"), "its recorded source");
        assert!(!uses_server(&running, "pg-15"));
        let pending = migration("pg-17", None, None);
        assert!(uses_server(&pending, "pg-17"));
        assert!(!uses_server(&pending, "pg-16"));
        for done in ["Succeeded", "Failed", "RolledBack"] {
            let m = migration("pg-17", Some("pg-16"), Some(done));
            assert!(!uses_server(&m, "pg-17"), "{done}");
            assert!(!uses_server(&m, "pg-16"), "{done}");
        }
    }
}
