//! The Database's DatabaseServer, reached: resolved from the caches of the [`Directory`]
//! (endpoint, admin credentials), a session as its admin role, and a server problem as a
//! Database reports it. Depends on nothing of the controller but its errors.

use dbops_api::Database;
use dbops_shared::postgres::{Servers, Session};
use dbops_shared::server::{Directory, Resolved, ServerError};

use crate::error::{Error, Result, Why};

/// A server problem as this Database reports it: waiting for the platform team (or the
/// caches, which a retry cures: `CacheNotSynced` is the one `Retried` reason of them).
pub(crate) fn server_error(e: ServerError) -> Error {
    Error::reported(Why::shared(e.reason()), e.to_string())
}

/// The Database's DatabaseServer with its endpoint and admin credentials (from caches).
pub(crate) async fn server_of(directory: &Directory, db: &Database) -> Result<Resolved> {
    directory.synced().await.map_err(server_error)?;
    directory
        .resolve(&db.spec.server_ref.name)
        .map_err(server_error)
}

/// A session as the server's admin role.
pub(crate) async fn admin_session(
    servers: &Servers,
    server: &Resolved,
    dbname: &str,
) -> Result<Session> {
    Ok(servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}
