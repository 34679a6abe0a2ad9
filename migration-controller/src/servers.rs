//! The two servers of a Migration and the names on them, as every step reaches them:
//! DatabaseServers resolved from the caches of `dbops_shared::server` at each step
//! (address, TLS and the admin credentials of the controllers' namespace), the source as
//! Preflight recorded it, the target from `spec.target.serverRef`; admin sessions; the
//! database and role names Preflight recorded.

use dbops_api::{Database, MigrationReason, ServerReference};
use dbops_shared::postgres::Session;
use dbops_shared::server::Resolved;
use kube::ResourceExt;

use crate::context::Saga;
use crate::error::{Error, Result};

/// The DatabaseServer `server` from the caches (once they have synced): its address, TLS
/// and admin credentials (a Secret of the controllers' namespace, never the Migration's).
pub async fn resolve(saga: &Saga<'_>, server: &ServerReference) -> Result<Resolved> {
    let directory = &saga.ctx.state.directory;
    directory.synced().await?;
    Ok(directory.resolve(&server.name)?)
}

/// An admin session on `server`, connected to the database `dbname`.
pub async fn session(saga: &Saga<'_>, server: &Resolved, dbname: &str) -> Result<Session> {
    Ok(saga
        .ctx
        .state
        .servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}

/// The source DatabaseServer recorded by Preflight.
pub fn source_ref(saga: &Saga<'_>) -> Result<ServerReference> {
    saga.status().source_server.ok_or_else(|| {
        Error::step(
            MigrationReason::SourceNotRecorded,
            "Preflight has not recorded the source",
        )
    })
}

/// The source DatabaseServer recorded by Preflight, resolved.
pub async fn source_server(saga: &Saga<'_>) -> Result<Resolved> {
    resolve(saga, &source_ref(saga)?).await
}

/// The target DatabaseServer (`spec.target.serverRef`), resolved.
pub async fn target_server(saga: &Saga<'_>) -> Result<Resolved> {
    resolve(saga, &saga.m.spec.target.server_ref).await
}

/// The UID of the Database Preflight recorded.
pub fn database_uid(saga: &Saga<'_>) -> Result<String> {
    saga.status().database_uid.ok_or_else(|| {
        Error::step(
            MigrationReason::SourceNotRecorded,
            "Preflight has not recorded the Database",
        )
    })
}

/// The database and owner role names in PostgreSQL: as Preflight recorded them, or from
/// the Database (a Migration that recorded none yet).
pub fn names(saga: &Saga<'_>, db: Option<&Database>) -> Result<(String, String)> {
    let status = saga.status();
    match (status.database_name, status.owner_role, db) {
        (Some(database), Some(role), _) => Ok((database, role)),
        (_, _, Some(db)) => Ok((db.database_name(), db.owner_role())),
        _ => Err(Error::step(
            MigrationReason::DatabaseNotFound,
            "the Database is gone and Preflight recorded no names",
        )),
    }
}

pub fn migration_uid(saga: &Saga<'_>) -> String {
    saga.m.uid().unwrap_or_default()
}

/// A server in messages: `<DatabaseServer> (<host>:<port>)`.
pub fn at(server: &Resolved) -> String {
    format!("{} ({})", server.name, server.endpoint.key)
}

/// The major version of a `server_version_num`.
pub fn major(version_num: i32) -> i32 {
    version_num / 10000
}
