//! What a DatabaseUser's reconcile reads before it acts: its Database (from the Database
//! controller's cache), the server that Database is on, sessions there, and its
//! connection Secret. Whether the user read is still the live one is `crate::live`'s.

use std::sync::Arc;
use std::time::Duration;

use dbops_api::reasons::DatabaseUserReason;
use dbops_api::{Database, DatabaseUser};
use dbops_shared::controller::Context;
use dbops_shared::postgres::Session;
use dbops_shared::server::Resolved;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::state::State;
use crate::error::{Error, Result};
use crate::{admit::already_on, server_access::server_error};

/// How long a reconcile waits for the Database cache's first list.
const STORE_SYNC_WAIT: Duration = Duration::from_secs(30);

/// The Database the user is for, from the Database controller's cache.
pub async fn database_of(ctx: &Context<State>, user: &DatabaseUser) -> Result<Arc<Database>> {
    let namespace = user.namespace().unwrap_or_default();
    let name = &user.spec.database_ref.name;
    let store = ctx.state.databases.get().ok_or_else(|| Error::Reported {
        reason: DatabaseUserReason::CacheNotSynced.into(),
        message: "the Database cache is not set up yet".into(),
    })?;
    if !dbops_shared::store_ready::ready_within(store, STORE_SYNC_WAIT).await {
        return Err(Error::Reported {
            reason: DatabaseUserReason::CacheNotSynced.into(),
            message: "the Database cache has not synced yet".into(),
        });
    }
    store
        .get(&ObjectRef::new(name).within(&namespace))
        .ok_or_else(|| Error::Reported {
            reason: DatabaseUserReason::DatabaseNotFound.into(),
            message: format!(
                "Database {name} does not exist in namespace {namespace}; the user is set up once it does"
            ),
        })
}

/// The server the Database is provisioned on.
pub fn server_of_database(ctx: &Context<State>, db: &Database) -> Result<Resolved> {
    let name = &db.spec.server_ref.name;
    let on = db.status.as_ref().and_then(|s| s.server.clone());
    let Some(on) = on.filter(|s| already_on(db, s)) else {
        return Err(Error::Reported {
            reason: DatabaseUserReason::DatabaseNotReady.into(),
            message: format!(
                "Database {} is not provisioned on DatabaseServer {name} yet; the user is set up once it is",
                db.name_any()
            ),
        });
    };
    ctx.state.directory.resolve(&on).map_err(server_error)
}

/// A session of the server's admin on `dbname`.
pub async fn admin_session(
    ctx: &Context<State>,
    server: &Resolved,
    dbname: &str,
) -> Result<Session> {
    Ok(ctx
        .state
        .servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}

/// The user's connection Secret to decide on, by `TenantSecrets::current`'s one re-read
/// rule (read again when the cache names another login than `latest_role`, the latest
/// status's; deciding on a stale copy retired about 1 new credential in 300 per rotation of
/// every user in dbops-bench).
pub async fn connection_secret(
    ctx: &Context<State>,
    db: &Database,
    user: &DatabaseUser,
    latest_role: Option<&str>,
) -> Result<Option<Arc<Secret>>> {
    let name = user.connection_secret_name();
    ctx.state.tenants.current(db, &name, latest_role).await
}
