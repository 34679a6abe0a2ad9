//! The user's roles going: on deletion (then the finalizer), and on the server its
//! Database left.

use dbops_api::DatabaseUser;
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use super::lookup::admin_session;
use super::state::State;
use crate::error::{Error, Result};
use crate::role_sql as sql;
use crate::server_access::server_error;

/// Held while the user's roles may exist on a server.
pub const FINALIZER: &str = dbops_api::names::finalizer::USER_CLEANUP;

/// Drops the user's roles (marked as this DatabaseUser's) on `server`: in each database
/// where they hold privileges or own something, what they own goes to that database's
/// owner and their privileges are revoked (`REASSIGN OWNED`, `DROP OWNED`); then their
/// sessions end and the roles go. Used on deletion, and on the server a Database left.
pub async fn drop_on(
    ctx: &Context<State>,
    user: &DatabaseUser,
    server: &str,
    group: &str,
) -> Result<()> {
    let old = ctx.state.directory.resolve(server).map_err(server_error)?;
    let mut names = sql::logins(group).to_vec();
    names.push(group.to_string());
    let mut session = admin_session(ctx, &old, "postgres").await?;
    let uid = user.uid().unwrap_or_default();
    let roles = sql::observe_roles(&session, group, &names).await?;
    let ours: Vec<String> = names
        .iter()
        .filter(|n| {
            roles
                .iter()
                .any(|r| &r.name == *n && crate::sql::is_ours(r.comment.as_deref(), &uid))
        })
        .cloned()
        .collect();
    if ours.is_empty() {
        return Ok(());
    }
    for (database, owner) in sql::databases_depending_on(&session, &ours).await? {
        let mut in_db = admin_session(ctx, &old, &database).await?;
        sql::disown(&mut in_db, &owner, &ours).await?;
    }
    sql::drop_roles(&mut session, &ours).await?;
    tracing::info!(server, roles = ?ours, "dropped the user's roles");
    Ok(())
}

/// Deletion: the roles go (their sessions ended, what they own handed to the owner),
/// then the finalizer. Never touches the data.
pub async fn cleanup(
    user: &DatabaseUser,
    ctx: &Context<State>,
    api: &Api<DatabaseUser>,
) -> Result<Action> {
    if !user.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let status = user.status.clone().unwrap_or_default();
    let outcome = match (&status.server, &status.group_role) {
        (Some(server), Some(group)) => drop_on(ctx, user, server, group).await,
        // Never set up anywhere.
        _ => Ok(()),
    };
    let namespace_going = ctx
        .state
        .directory
        .namespace_terminating(&user.namespace().unwrap_or_default());
    match outcome {
        Ok(()) => {}
        // A namespace being deleted never waits on an unreachable server: the roles are
        // left (they can no longer be handed out) and the platform team is told.
        Err(e)
            if namespace_going
                || (matches!(e, Error::Reported { .. }) && e.kind() == ErrorKind::Permanent) =>
        {
            ctx.state.event(user, false, "RolesLeftOnServer", &format!(
                "the user's roles could not be dropped ({e}); the namespace is going or the server is gone, so they are left on the server"
            ))
            .await;
        }
        Err(e) => return Err(e),
    }
    dbops_shared::finalizer::set(user, api, FINALIZER, false).await?;
    ctx.state.written.forget(&user.uid().unwrap_or_default());
    ctx.state
        .event(
            user,
            true,
            "Deleted",
            "the user's logins were dropped and their sessions ended",
        )
        .await;
    Ok(Action::await_change())
}
