//! One DatabaseUser set up, as the Database's provisioning reads: observe (its Database,
//! the server, the guardrails, the Secret, the roles), plan (the turn of its two logins,
//! `rotation::turn`, pure), apply (the group, the logins, the privileges, the Secret, then
//! the roles left on a former server).

use std::sync::Arc;
use std::time::Duration;

use dbops_api::reasons::DatabaseUserReason;
use dbops_api::{Database, DatabaseUser, DatabaseUserStatus};
use dbops_shared::controller::Context;
use dbops_shared::server::Resolved;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::Api;

use super::grants;
use super::lookup::{admin_session, connection_secret, database_of, server_of_database};
use super::state::State;
use super::teardown::drop_on;
use crate::error::template_error;
use crate::error::{Error, Result};
use crate::live::confirm_live;
use crate::role_sql::{self as sql, RoleState};
use crate::rotation::turn::{self, Inputs, Kept, Shape};
use crate::secret::{self, Owner};
use crate::{limits, rotation};
use dbops_shared::postgres::ddl::Capability;

/// What a reconcile found and did: the status fields it sets.
#[derive(Debug, Clone, Default)]
pub struct Done {
    pub server: String,
    pub group: String,
    pub role: String,
    pub previous: Option<(String, f64)>,
    pub last_rotation: Option<Time>,
    pub rotate_request: Option<String>,
    pub message: String,
    /// The next moment something is due (an expiry, a rotation).
    pub next: Option<Duration>,
    /// Schemas the spec names that do not exist: the rest is granted.
    pub missing_schemas: Vec<String>,
    /// A former server whose roles could not be dropped yet.
    pub former_server: Option<String>,
}

/// What is known before anything changes on a server.
struct Observed {
    db: Arc<Database>,
    target: Resolved,
    connection_limit: i32,
    settings: Vec<(&'static str, String)>,
    /// The latest status (`State::latest`).
    status: DatabaseUserStatus,
    /// The connection Secret, checked to be this user's.
    existing: Option<Arc<Secret>>,
}

/// The Database (not being deleted, provisioned on a server), the guardrails (refused
/// before anything is written) and the connection Secret.
async fn observe(user: &DatabaseUser, ctx: &Context<State>) -> Result<Observed> {
    let db = database_of(ctx, user).await?;
    if db.metadata.deletion_timestamp.is_some() {
        return Err(Error::Reported {
            reason: DatabaseUserReason::DatabaseDeleting.into(),
            message: format!("Database {} is being deleted", db.name_any()),
        });
    }
    let target = server_of_database(ctx, &db)?;
    let (connection_limit, settings) =
        limits::login_requests(&user.spec.login, user.spec.connection_limit, &target.server)?;
    let status = ctx.state.latest(user);
    let existing = connection_secret(ctx, &db, user, status.role.as_deref()).await?;
    if let Some(found) = &existing {
        secret::check_owned(found, &Owner::user(user)).map_err(secret_conflict)?;
    }
    Ok(Observed {
        db,
        target,
        connection_limit,
        settings,
        status,
        existing,
    })
}

pub async fn provision(user: &DatabaseUser, ctx: &Context<State>) -> Result<Done> {
    let found = observe(user, ctx).await?;
    let (db, target, status) = (&found.db, &found.target, &found.status);
    let mark = crate::sql::mark(&user.uid().unwrap_or_default());
    let database = db.database_name();
    let group = sql::group_role(&database, &user.name_any());
    let shape = Shape {
        group: &group,
        mark: &mark,
        connection_limit: found.connection_limit,
        settings: &found.settings,
    };

    let existing = found.existing.as_deref();
    let mut session = admin_session(ctx, target, "postgres").await?;
    let roles = observe_roles(&session, user, target, &group).await?;
    let plan = plan_logins(user, status, existing, &roles, shape);
    if !roles.iter().any(|r| r.name == group) {
        crate::admit::admin_may(target, &[Capability::CreateRole], "a DatabaseUser")?;
        confirm_live(&ctx.client, user).await?;
        sql::create_group(&mut session, &group, &mark).await?;
    }
    turn::apply(&mut session, &plan, &roles, shape, || {
        confirm_live(&ctx.client, user)
    })
    .await?;
    for login in plan.retired() {
        let note = format!("login {login} can no longer log in; its sessions were ended");
        ctx.state
            .event(user, true, "PreviousLoginRetired", &note)
            .await;
    }
    drop(session);

    let missing_schemas = grant(ctx, user, target, db, &group).await?;
    let logins = plan.logins;
    let desired = secret::desired_for(
        &Owner::user(user).carrying(logins.carried.as_ref()),
        &database,
        &logins.login,
        target,
        &logins.password,
    )
    .map_err(template_error)?;
    write_secret(ctx, user, existing, &desired).await?;
    let former_server = leave_former_server(ctx, user, status, target, &group).await;

    let scope = if user.spec.schemas.is_empty() {
        "every schema".to_string()
    } else {
        format!("schemas {}", user.spec.schemas.join(", "))
    };
    Ok(Done {
        server: target.name.clone(),
        group,
        message: format!(
            "login {} ({}, {scope}) on DatabaseServer {}, database {database}",
            logins.login,
            user.spec.access.as_str(),
            target.name
        ),
        role: logins.login,
        previous: logins.previous,
        last_rotation: logins.last_rotation,
        rotate_request: logins.rotate_request,
        next: logins.next,
        missing_schemas,
        former_server,
    })
}

/// The group and the logins as the server shows them; a role of theirs not created by
/// this DatabaseUser stops everything.
async fn observe_roles(
    session: &dbops_shared::postgres::Session,
    user: &DatabaseUser,
    target: &Resolved,
    group: &str,
) -> Result<Vec<RoleState>> {
    let mut names = vec![group.to_string()];
    names.extend(sql::logins(group));
    let roles = sql::observe_roles(session, group, &names).await?;
    let uid = user.uid().unwrap_or_default();
    if let Some(theirs) = roles
        .iter()
        .find(|r| !crate::sql::is_ours(r.comment.as_deref(), &uid))
    {
        return Err(Error::Reported {
            reason: DatabaseUserReason::NameConflict.into(),
            message: format!(
                "role {:?} already exists on {} and was not created by this DatabaseUser; nothing was changed",
                theirs.name, target.endpoint.key
            ),
        });
    }
    Ok(roles)
}

/// The turn of the user's two logins (pure; see `rotation::turn`).
fn plan_logins(
    user: &DatabaseUser,
    status: &DatabaseUserStatus,
    existing: Option<&Secret>,
    roles: &[RoleState],
    shape: Shape<'_>,
) -> turn::Plan {
    let pair = sql::logins(shape.group);
    let kept = existing.and_then(|s| {
        Some(Kept {
            login: secret::username(s)?,
            password: secret::kept_password(s)?,
        })
    });
    let carried = existing.and_then(secret::carried);
    turn::plan(
        &Inputs {
            pair: &pair,
            outside: None,
            kept: kept.as_ref(),
            status_login: status.role.as_deref(),
            annotations: user.annotations(),
            rotation: user.spec.login.password_rotation.as_ref(),
            last_rotation: status.rotation.last_rotation.as_ref(),
            rotate_request: status.rotation.rotate_request.as_ref(),
            every_new_password_counts: true,
            carried: carried.as_ref(),
            roles,
            now: rotation::secs_now(),
        },
        shape,
        dbops_shared::postgres::generate_password,
    )
}

/// The group's privileges in the Database's own database, granted where they differ;
/// the schemas the spec names that do not exist.
async fn grant(
    ctx: &Context<State>,
    user: &DatabaseUser,
    target: &Resolved,
    db: &Database,
    group: &str,
) -> Result<Vec<String>> {
    let (database, owner) = (db.database_name(), db.owner_role());
    let scope = grants::Scope {
        owner: &owner,
        group,
        database: &database,
        schemas: &user.spec.schemas,
        access: user.spec.access,
    };
    let mut in_db = admin_session(ctx, target, &database).await?;
    let grants = grants::observe_grants(&in_db, scope).await?;
    if !grants.converged {
        confirm_live(&ctx.client, user).await?;
        grants::grant(&mut in_db, scope, &grants).await?;
    }
    Ok(grants.missing_schemas)
}

/// The roles left on a former server (the Database moved) are dropped; the server, when
/// they could not be yet (retried at the next reconcile).
async fn leave_former_server(
    ctx: &Context<State>,
    user: &DatabaseUser,
    status: &DatabaseUserStatus,
    target: &Resolved,
    group: &str,
) -> Option<String> {
    let on_this_server = status.server.as_deref() == Some(target.name.as_str());
    let former = match &status.server {
        Some(old) if !on_this_server => Some(old.clone()),
        _ => status.former_server.clone(),
    }?;
    match drop_on(ctx, user, &former, group).await {
        Ok(()) => None,
        Err(e) => {
            tracing::warn!(server = %former, error = %e, "dropping the user's roles on its former server; retried");
            Some(former)
        }
    }
}

/// Creates the Secret, or applies it over the one this DatabaseUser owns.
async fn write_secret(
    ctx: &Context<State>,
    user: &DatabaseUser,
    existing: Option<&Secret>,
    desired: &Secret,
) -> Result<()> {
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &user.namespace().unwrap_or_default());
    crate::connection::write_owned_secret(
        &secrets,
        &user.connection_secret_name(),
        existing,
        desired,
        confirm_live(&ctx.client, user),
        |found| secret::check_owned(found, &Owner::user(user)).map_err(secret_conflict),
    )
    .await
}

/// A connection Secret of that name that is not this user's: refused, never taken over.
fn secret_conflict(message: String) -> Error {
    Error::Reported {
        reason: DatabaseUserReason::SecretConflict.into(),
        message,
    }
}
