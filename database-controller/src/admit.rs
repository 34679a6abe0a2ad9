//! Admission: whether a Database may be (or stay) on its DatabaseServer, by the server's
//! namespace selector and its `limits.databasesPerNamespace` quota, and whether the
//! server's admin may create what a new Database or DatabaseUser needs ([`admin_may`]).

use dbops_api::reasons::DatabaseReason;
use std::sync::Arc;

use dbops_api::Database;
use dbops_shared::server::{Resolved, ServerError};
use kube::ResourceExt;

use crate::error::{Error, Result};
use crate::server_access::server_error;
use crate::state::State;
use dbops_shared::postgres::ddl::{Capability, Has};

/// Refuses, before anything is created, what the server's admin may not do, as its last
/// probe found (`status.capabilities`; not probed yet: let PostgreSQL say). `what` names
/// what needs them.
pub(crate) fn admin_may(server: &Resolved, needs: &[Capability], what: &str) -> Result<()> {
    let Some(known) = server
        .server
        .status
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
    else {
        return Ok(());
    };
    match known.lacking(needs) {
        None => Ok(()),
        Some(lacks) => Err(Error::Reported {
            reason: DatabaseReason::AdminLacksPrivilege.into(),
            message: format!(
                "the admin of DatabaseServer {:?} lacks {} (status.capabilities.{} is false), which {what} needs; nothing was created on the server",
                server.name,
                lacks.grant(),
                lacks.field()
            ),
        }),
    }
}

/// Whether the Database may be (or stay) on its server: one already provisioned there
/// stays admitted whatever the server's namespace selector and quota say now; a new one
/// needs a server that is not being deleted, allows its namespace and has room under
/// `limits.databasesPerNamespace` (the oldest Databases by creation time come first).
pub(crate) fn admit(state: &State, db: &Database, server: &Resolved) -> Result<()> {
    if already_on(db, &server.name) {
        return Ok(());
    }
    admin_may(
        server,
        &[Capability::CreateRole, Capability::CreateDatabase],
        "a Database",
    )?;
    if server.server.metadata.deletion_timestamp.is_some() {
        return Err(server_error(ServerError::Deleting(server.name.clone())));
    }
    let namespace = db.namespace().unwrap_or_default();
    state
        .directory
        .admits(&server.server, &namespace)
        .map_err(server_error)?;
    let limit = server
        .server
        .spec
        .limits
        .as_ref()
        .and_then(|l| l.databases_per_namespace);
    if let (Some(limit), Some(store)) = (limit, state.databases.get()) {
        let peers: Vec<Arc<Database>> = store
            .state()
            .into_iter()
            .filter(|d| {
                d.metadata.namespace.as_deref() == Some(namespace.as_str())
                    && d.spec.server_ref.name == server.name
            })
            .collect();
        let (place, total) = quota_place(db, &peers, &server.name);
        if place >= usize::try_from(limit).unwrap_or(0) {
            return Err(Error::Reported {
                reason: DatabaseReason::QuotaExceeded.into(),
                message: format!(
                    "DatabaseServer {:?} allows {limit} Databases per namespace and namespace {namespace:?} asks for {total}; this one is not among the {limit} oldest: nothing was created on the server",
                    server.name
                ),
            });
        }
    }
    Ok(())
}

/// Whether the Database was provisioned on DatabaseServer `server` (its status says so).
pub fn already_on(db: &Database, server: &str) -> bool {
    db.status
        .as_ref()
        .is_some_and(|s| s.server.as_deref() == Some(server) && s.provider_id.is_some())
}

/// The Database's place in its namespace's queue for `server` (0 = first) and the queue's
/// length: Databases already on the server first, then by creation time, then by name.
pub fn quota_place(db: &Database, peers: &[Arc<Database>], server: &str) -> (usize, usize) {
    let key = |d: &Database| {
        (
            !already_on(d, server),
            d.metadata.creation_timestamp.as_ref().map(|t| t.0),
            d.name_any(),
        )
    };
    let mine = key(db);
    let mut keys: Vec<_> = peers.iter().map(|d| key(d)).collect();
    if !peers.iter().any(|d| d.uid() == db.uid()) {
        keys.push(mine.clone());
    }
    keys.sort();
    let place = keys.iter().position(|k| *k == mine).unwrap_or(keys.len());
    (place, keys.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dbops_api::DatabaseStatus;

    fn on_server(name: &str, created: &str, provisioned_on: Option<&str>) -> Arc<Database> {
        let mut db: Database = serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
                         "creationTimestamp": created},
            "spec": {"serverRef": {"name": "pg-main"}}
        }))
        .unwrap();
        if let Some(server) = provisioned_on {
            db.status = Some(DatabaseStatus {
                server: Some(server.into()),
                provider_id: Some("h:5432/1".into()),
                ..DatabaseStatus::default()
            });
        }
        Arc::new(db)
    }

    #[test]
    fn the_quota_serves_databases_already_there_then_the_oldest() {
        let old = on_server("old", "2026-11-23T10:00:00Z", None);
        let new = on_server("new", "2026-11-23T11:00:00Z", None);
        // Created last but already provisioned there (before a quota was set): first.
        let there = on_server("there", "2026-11-23T12:00:00Z", Some("pg-main"));
        let peers = vec![old.clone(), new.clone(), there.clone()];
        assert_eq!(quota_place(&there, &peers, "pg-main"), (0, 3));
        assert_eq!(quota_place(&old, &peers, "pg-main"), (1, 3));
        assert_eq!(quota_place(&new, &peers, "pg-main"), (2, 3));
        // Same creation time: by name, so every replica decides alike.
        let twin = on_server("a-twin", "2026-11-23T10:00:00Z", None);
        let peers = vec![old.clone(), twin.clone()];
        assert_eq!(quota_place(&twin, &peers, "pg-main"), (0, 2));
        // A Database the cache does not hold yet still gets its place.
        assert_eq!(
            quota_place(&new, std::slice::from_ref(&old), "pg-main"),
            (1, 2)
        );
        assert!(already_on(&there, "pg-main") && !already_on(&there, "pg-other"));
    }
}
