//! The DatabaseUser controller (`user-controller`, in the database-controller's process):
//! one more login to a Database, ReadOnly or ReadWrite, with a connection Secret of its
//! own, limits within the DatabaseServer's guardrails, and password rotation without
//! downtime.
//!
//! Roles (see `crate::role_sql`): a NOLOGIN group `<database>_<name>` holds the privileges; two
//! logins `<group>_1`/`<group>_2`, its members, take turns. The connection Secret names
//! the current one. A rotation (every `passwordRotation.every`, or a new value of the
//! annotation `dbops.dev/rotate`) gives the other login a new password and the Secret,
//! and the previous one a `VALID UNTIL` of now + `keepPrevious`: the server itself refuses
//! its logins after that, and the next reconcile takes its LOGIN away and ends its
//! sessions. The steps run in an order that a crash between any two leaves safe: the
//! previous login's expiry is set before the new login is given out, so a login the
//! Secret no longer names and without expiry is one to retire.
//!
//! The user is where its Database is provisioned (`status.server`): after a Migration's
//! switch it is set up on the new server, its Secret follows, and its roles on the former
//! server are dropped.
//!
//! A reconcile: [`reconcile`] here; [`status`] writes what came of [`provision`], which
//! observes (through [`lookup`]), plans (the turn of the logins, `crate::rotation::turn`),
//! applies (the role SQL of `crate::role_sql` and the privileges of [`grants`]) and drops
//! the roles left on a former server ([`teardown`]). Each module imports only those after
//! it in the list status, provision, teardown, lookup, grants, state (`e2e/house`
//! checks that no two modules or folders import each other; the folder `user/` is above
//! every other module but `main`).

pub mod grants;
pub mod lookup;
pub mod provision;
pub mod state;
pub mod status;
pub mod teardown;

use std::sync::Arc;
use std::time::Duration;

use dbops_api::DatabaseUser;
use dbops_api::reasons::DatabaseUserReason;
use dbops_shared::controller::{Context, ErrorKind, ReconcileError};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

use crate::error::{Error, Result, Why};
pub use state::State;
use teardown::FINALIZER;

/// The controller name: metrics label, Event reporter `dbops-user-controller`.
pub const CONTROLLER: &str = "user-controller";
/// How soon a user waiting for its Database looks again.
const DATABASE_WAIT_RECHECK: Duration = Duration::from_secs(10);

pub async fn reconcile(user: Arc<DatabaseUser>, ctx: Arc<Context<State>>) -> Result<Action> {
    let api: Api<DatabaseUser> =
        Api::namespaced(ctx.client.clone(), &user.namespace().unwrap_or_default());
    if user.metadata.deletion_timestamp.is_some() {
        return teardown::cleanup(&user, &ctx, &api).await;
    }
    dbops_shared::finalizer::set(user.as_ref(), &api, FINALIZER, true).await?;
    let outcome = provision::provision(&user, &ctx).await;
    if let Err(Error::Superseded(why)) = &outcome {
        tracing::info!(
            why,
            "reconcile abandoned: the DatabaseUser it read is no longer the live one"
        );
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    status::publish(&user, &ctx, &api, &outcome).await?;
    match outcome {
        Ok(done) => Ok(Action::requeue(
            done.next
                .map_or(ctx.resync_interval, |n| n.min(ctx.resync_interval)),
        )),
        // Waiting for the Database: its change wakes the user through a watch of its own,
        // which may run ahead of the Database cache the reconcile reads; a short requeue
        // (not the resync, minutes) bounds that race (the benchmark left 1 user of 2,000
        // not Ready behind a Ready Database).
        Err(Error::Reported {
            reason:
                Why::User(DatabaseUserReason::DatabaseNotReady | DatabaseUserReason::DatabaseNotFound),
            ..
        }) => Ok(Action::requeue(
            DATABASE_WAIT_RECHECK.min(ctx.resync_interval),
        )),
        // Nothing to retry until something changes (the reason's class says so).
        Err(e) if e.kind() == ErrorKind::Permanent => Ok(Action::requeue(ctx.resync_interval)),
        Err(e) => Err(e),
    }
}
