//! The DatabaseUser controller (`user-controller`, in the database-controller's process):
//! one more login to a Database, ReadOnly or ReadWrite, with a connection Secret of its
//! own, limits within the DatabaseServer's guardrails, and password rotation without
//! downtime.
//!
//! Roles (see [`sql`]): a NOLOGIN group `<database>_<name>` holds the privileges; two
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

pub mod sql;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use dbops_api::{Database, DatabaseUser, DatabaseUserStatus, ROTATE_ANNOTATION, condition};
use dbops_shared::conditions::{ConditionSpec, ConditionStatus, get, now, set_condition};
use dbops_shared::controller::{Context, ReconcileError};
use dbops_shared::events::Recorder;
use dbops_shared::postgres::{Servers, Session};
use dbops_shared::server::{Directory, Resolved};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::json;

use crate::error::{Error, Result};
use crate::{admit::already_on, error::template_error, server_access::server_error};
use crate::secret::{self, Owner};
use crate::{limits, rotation, tenant_secrets::TenantSecrets};

/// The controller name: metrics label, Event reporter `dbops-user-controller`.
pub const CONTROLLER: &str = "user-controller";
/// Held while the user's roles may exist on a server.
pub const FINALIZER: &str = "dbops.dev/user-cleanup";
/// How soon a user waiting for its Database looks again.
const DATABASE_WAIT_RECHECK: Duration = Duration::from_secs(10);
/// How long a reconcile waits for the Database cache's first list.
const STORE_SYNC_WAIT: Duration = Duration::from_secs(30);

/// The user controller's state.
pub struct State {
    pub servers: Arc<Servers>,
    pub directory: Directory,
    pub recorder: Recorder,
    /// The Database controller's cache.
    pub databases: Arc<OnceLock<Store<Database>>>,
    pub tenants: TenantSecrets,
    /// The status last written for each DatabaseUser (by UID), until the cache shows it:
    /// a reconcile on an older cached object must not act on an older status (it would
    /// rotate twice).
    pub written: dbops_shared::memo::Memo<DatabaseUserStatus>,
}

impl State {
    /// The latest status: the one last written unless the cache already shows it.
    fn latest(&self, user: &DatabaseUser) -> DatabaseUserStatus {
        let uid = user.uid().unwrap_or_default();
        let cached = user.status.clone().unwrap_or_default();
        if self
            .written
            .forget_if(&uid, |w| user.status.as_ref() == Some(w))
        {
            return cached;
        }
        self.written.get(&uid, Clone::clone).unwrap_or(cached)
    }
}

/// What a reconcile found and did: the status fields it sets.
#[derive(Debug, Clone, Default)]
struct Done {
    server: String,
    group: String,
    role: String,
    previous: Option<(String, f64)>,
    last_rotation: Option<Time>,
    rotate_request: Option<String>,
    message: String,
    /// The next moment something is due (an expiry, a rotation).
    next: Option<Duration>,
    /// Schemas the spec names that do not exist: the rest is granted.
    missing_schemas: Vec<String>,
    /// A former server whose roles could not be dropped yet.
    former_server: Option<String>,
}

pub async fn reconcile(user: Arc<DatabaseUser>, ctx: Arc<Context<State>>) -> Result<Action> {
    let api: Api<DatabaseUser> =
        Api::namespaced(ctx.client.clone(), &user.namespace().unwrap_or_default());
    if user.metadata.deletion_timestamp.is_some() {
        return cleanup(&user, &ctx, &api).await;
    }
    dbops_shared::finalizer::set(user.as_ref(), &api, FINALIZER, true).await?;
    let outcome = provision(&user, &ctx).await;
    if let Err(Error::Superseded(why)) = &outcome {
        tracing::info!(
            why,
            "reconcile abandoned: the DatabaseUser it read is no longer the live one"
        );
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    publish(&user, &ctx, &api, &outcome).await?;
    match outcome {
        Ok(done) => Ok(Action::requeue(
            done.next
                .map_or(ctx.resync_interval, |n| n.min(ctx.resync_interval)),
        )),
        // Waiting for the Database: its change wakes the user through a watch of its own,
        // which may run ahead of the Database cache the reconcile reads; a short requeue
        // (not the resync, minutes) bounds that race (the benchmark left 1 user of 2,000
        // not Ready behind a Ready Database).
        Err(Error::Blocked {
            reason: "DatabaseNotReady" | "DatabaseNotFound",
            ..
        }) => Ok(Action::requeue(
            DATABASE_WAIT_RECHECK.min(ctx.resync_interval),
        )),
        Err(Error::Blocked { .. }) => Ok(Action::requeue(ctx.resync_interval)),
        Err(e) => Err(e),
    }
}

/// The Database the user is for, from the Database controller's cache.
async fn database_of(ctx: &Context<State>, user: &DatabaseUser) -> Result<Arc<Database>> {
    let namespace = user.namespace().unwrap_or_default();
    let name = &user.spec.database_ref.name;
    let store = ctx.state.databases.get().ok_or_else(|| Error::Retry {
        reason: "CacheNotSynced",
        message: "the Database cache is not set up yet".into(),
    })?;
    match tokio::time::timeout(STORE_SYNC_WAIT, store.wait_until_ready()).await {
        Ok(Ok(())) => {}
        _ => {
            return Err(Error::Retry {
                reason: "CacheNotSynced",
                message: "the Database cache has not synced yet".into(),
            });
        }
    }
    store
        .get(&ObjectRef::new(name).within(&namespace))
        .ok_or_else(|| Error::Blocked {
            reason: "DatabaseNotFound",
            message: format!(
                "Database {name} does not exist in namespace {namespace}; the user is set up once it does"
            ),
        })
}

/// The server the Database is provisioned on.
fn server_of_database(ctx: &Context<State>, db: &Database) -> Result<Resolved> {
    let name = &db.spec.server_ref.name;
    let on = db.status.as_ref().and_then(|s| s.server.clone());
    let Some(on) = on.filter(|s| already_on(db, s)) else {
        return Err(Error::Blocked {
            reason: "DatabaseNotReady",
            message: format!(
                "Database {} is not provisioned on DatabaseServer {name} yet; the user is set up once it is",
                db.name_any()
            ),
        });
    };
    ctx.state.directory.resolve(&on).map_err(server_error)
}

async fn admin_session(ctx: &Context<State>, server: &Resolved, dbname: &str) -> Result<Session> {
    Ok(ctx
        .state
        .servers
        .connect(&server.endpoint, &server.credentials, dbname)
        .await?)
}

/// Confirms `user` is still the live object of its name (as `reconcile::confirm_live`
/// does for Databases), before each change on a server.
async fn confirm_live(ctx: &Context<State>, user: &DatabaseUser) -> Result<()> {
    let api: Api<DatabaseUser> =
        Api::namespaced(ctx.client.clone(), &user.namespace().unwrap_or_default());
    let by_name = ListParams::default().fields(&format!("metadata.name={}", user.name_any()));
    let live = api.list(&by_name).await?.items.into_iter().next();
    match crate::live::superseded(user, live.as_ref()) {
        Some(why) => Err(Error::Superseded(why)),
        None => Ok(()),
    }
}

/// The connection Secret, from its namespace's cache or the API.
async fn existing_secret(
    ctx: &Context<State>,
    db: &Database,
    user: &DatabaseUser,
) -> Result<Option<Arc<Secret>>> {
    let namespace = user.namespace().unwrap_or_default();
    let name = user.connection_secret_name();
    let store = ctx.state.tenants.secrets_for(db).await?;
    if let Some(found) = store.get(&ObjectRef::new(&name).within(&namespace)) {
        return Ok(Some(found));
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    Ok(secrets.get_opt(&name).await?.map(Arc::new))
}

async fn provision(user: &DatabaseUser, ctx: &Context<State>) -> Result<Done> {
    let db = database_of(ctx, user).await?;
    if db.metadata.deletion_timestamp.is_some() {
        return Err(Error::Blocked {
            reason: "DatabaseDeleting",
            message: format!("Database {} is being deleted", db.name_any()),
        });
    }
    let target = server_of_database(ctx, &db)?;
    // Refused before anything is written.
    crate::template::check(&user.spec.secret_template).map_err(template_error)?;
    let connection_limit = limits::connection_limit(
        user.spec.connection_limit,
        &target.server,
        "spec.connectionLimit",
    )?;
    let settings = limits::settings(user.spec.settings.as_ref(), &target.server, "spec.settings")?;

    let uid = user.uid().unwrap_or_default();
    let mark = crate::sql::mark(&uid);
    let database = db.database_name();
    let owner = db.owner_role();
    let group = sql::group_role(&database, &user.name_any());
    let logins = sql::logins(&group);
    let owner_ref = Owner::user(user);

    let existing = existing_secret(ctx, &db, user).await?;
    // The Secret cache may not show the Secret this controller wrote last yet (its watch
    // lags behind under load): when it names another login than the latest status, the
    // Secret is read from the API. Deciding on the stale one gave the previous login out
    // again and retired the new one at once (dbops-bench users, about 1 credential in 300
    // per rotation of all of them).
    let status = ctx.state.latest(user);
    let existing = match (existing, status.role.as_deref()) {
        (Some(found), Some(role)) if secret::username(&found).is_some_and(|u| u != role) => {
            let secrets: Api<Secret> =
                Api::namespaced(ctx.client.clone(), &user.namespace().unwrap_or_default());
            secrets
                .get_opt(&user.connection_secret_name())
                .await?
                .map(Arc::new)
        }
        (existing, _) => existing,
    };
    if let Some(found) = &existing {
        secret::check_owned(found, &owner_ref).map_err(|message| Error::Blocked {
            reason: "SecretConflict",
            message,
        })?;
    }

    let mut session = admin_session(ctx, &target, "postgres").await?;
    let mut names = vec![group.clone()];
    names.extend(logins.iter().cloned());
    let roles = sql::observe_roles(&session, &group, &names).await?;
    if let Some(theirs) = roles
        .iter()
        .find(|r| !crate::sql::is_ours(r.comment.as_deref(), &uid))
    {
        return Err(Error::Blocked {
            reason: "NameConflict",
            message: format!(
                "role {:?} already exists on {} and was not created by this DatabaseUser; nothing was changed",
                theirs.name, target.endpoint.key
            ),
        });
    }
    let role = |name: &str| roles.iter().find(|r| r.name == name);

    // The login in use and its password: the Secret's while it is ours and intact.
    let on_this_server = status.server.as_deref() == Some(target.name.as_str());
    let kept = existing.as_deref().and_then(|s| {
        let name = s
            .data
            .as_ref()?
            .get("username")
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())?;
        let password = secret::kept_password(s)?;
        logins.contains(&name).then_some((name, password))
    });
    let now = rotation::secs_now();
    let mut last_rotation = status.last_rotation.clone();
    let mut rotate_request = status.rotate_request.clone();
    let (current, password, rotated) = match kept {
        Some((name, password)) => match rotation::due(
            user.annotations(),
            user.spec.password_rotation.as_ref(),
            status.rotate_request.as_ref(),
            status.last_rotation.as_ref(),
            now,
        ) {
            Some(why) => {
                let next = if name == logins[0] {
                    &logins[1]
                } else {
                    &logins[0]
                };
                tracing::info!(login = %next, previous = %name, why, "rotating the password");
                (
                    next.clone(),
                    dbops_shared::postgres::generate_password(),
                    Some(name),
                )
            }
            None => (name, password, None),
        },
        None => {
            let name = status
                .role
                .clone()
                .filter(|r| logins.contains(r))
                .unwrap_or_else(|| logins[0].clone());
            (name, dbops_shared::postgres::generate_password(), None)
        }
    };
    let fresh_password = existing
        .as_deref()
        .and_then(secret::kept_password)
        .is_none_or(|p| p != password);
    if rotated.is_some() || fresh_password {
        last_rotation = Some(dbops_shared::conditions::now());
    }
    if rotated.is_some() || status.rotate_request.is_none() {
        rotate_request = user.annotations().get(ROTATE_ANNOTATION).cloned();
    }

    let want = sql::LoginSpec {
        name: &current,
        group: &group,
        mark: &mark,
        connection_limit,
        settings: &settings,
    };
    // The group.
    if role(&group).is_none() {
        confirm_live(ctx, user).await?;
        sql::create_group(&mut session, &group, &mark).await?;
    }
    // The previous login's expiry first (see the module's documentation).
    let mut previous = None;
    if let Some(prev) = &rotated {
        let until =
            now + rotation::keep_previous(user.spec.password_rotation.as_ref()).as_secs_f64();
        confirm_live(ctx, user).await?;
        sql::keep_until(&session, prev, &rotation::rfc3339(until)).await?;
        previous = Some((prev.clone(), until));
    }
    // The current login.
    let have = role(&current);
    let needs_activation = fresh_password
        || rotated.is_some()
        || have.is_none_or(|h| !h.can_login || h.valid_until.is_some());
    if needs_activation {
        confirm_live(ctx, user).await?;
        sql::activate(&mut session, &want, have, &password).await?;
    } else if let Some(h) = have
        && sql::login_drifted(&want, h)
    {
        confirm_live(ctx, user).await?;
        sql::repair(&mut session, &want, h).await?;
    }
    // The other login: working until its expiry, then retired.
    let other = if current == logins[0] {
        &logins[1]
    } else {
        &logins[0]
    };
    if previous.is_none()
        && let Some(o) = role(other)
        && o.can_login
    {
        match o.valid_until {
            Some(until) if until > now => {
                previous = Some((other.clone(), until));
            }
            _ => {
                confirm_live(ctx, user).await?;
                sql::retire(&session, other).await?;
                event(
                    ctx,
                    user,
                    true,
                    "PreviousLoginRetired",
                    &format!("login {other} can no longer log in; its sessions were ended"),
                )
                .await;
            }
        }
    }
    let next = rotation::next_due(
        previous.as_ref().map(|(_, until)| *until),
        user.spec.password_rotation.as_ref(),
        last_rotation.as_ref(),
        now,
    );
    drop(session);

    // Privileges, in the Database's own database.
    let mut in_db = admin_session(ctx, &target, &database).await?;
    let grants = sql::observe_grants(
        &in_db,
        &owner,
        &group,
        &database,
        &user.spec.schemas,
        user.spec.access,
    )
    .await?;
    if !grants.converged {
        confirm_live(ctx, user).await?;
        sql::grant(
            &mut in_db,
            &owner,
            &group,
            &database,
            user.spec.schemas.is_empty(),
            &grants,
            user.spec.access,
        )
        .await?;
    }
    drop(in_db);

    // The Secret.
    let desired = secret::desired_for(&owner_ref, &database, &current, &target, &password)
        .map_err(template_error)?;
    write_secret(ctx, user, existing.as_deref(), &desired).await?;

    // Roles left on a former server (the Database moved).
    let mut former_server = status.former_server.clone();
    if !on_this_server && let Some(old) = status.server.clone() {
        former_server = Some(old);
    }
    if let Some(old) = former_server.clone() {
        match drop_on(ctx, user, &old, &group).await {
            Ok(()) => former_server = None,
            Err(e) => {
                tracing::warn!(server = %old, error = %e, "dropping the user's roles on its former server; retried")
            }
        }
    }

    let scope = if user.spec.schemas.is_empty() {
        "every schema".to_string()
    } else {
        format!("schemas {}", user.spec.schemas.join(", "))
    };
    Ok(Done {
        server: target.name.clone(),
        group,
        role: current.clone(),
        previous,
        last_rotation,
        rotate_request,
        message: format!(
            "login {current} ({}, {scope}) on DatabaseServer {}, database {database}",
            user.spec.access.as_str(),
            target.name
        ),
        next,
        missing_schemas: grants.missing_schemas,
        former_server,
    })
}

/// Drops the user's roles (marked as this DatabaseUser's) on `server`: in each database
/// where they hold privileges or own something, what they own goes to that database's
/// owner and their privileges are revoked (`REASSIGN OWNED`, `DROP OWNED`); then their
/// sessions end and the roles go. Used on deletion, and on the server a Database left.
async fn drop_on(
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

/// Creates the Secret, or applies it over the one this DatabaseUser owns.
async fn write_secret(
    ctx: &Context<State>,
    user: &DatabaseUser,
    existing: Option<&Secret>,
    desired: &Secret,
) -> Result<()> {
    if existing.is_some_and(|s| secret::is_current(s, desired)) {
        return Ok(());
    }
    confirm_live(ctx, user).await?;
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &user.namespace().unwrap_or_default());
    let name = user.connection_secret_name();
    let found = match existing {
        None => match secrets.create(&PostParams::default(), desired).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = secrets.get(&name).await?;
                secret::check_owned(&found, &Owner::user(user)).map_err(|message| {
                    Error::Blocked {
                        reason: "SecretConflict",
                        message,
                    }
                })?;
                found
            }
            Err(e) => return Err(e.into()),
        },
        Some(found) => found.clone(),
    };
    let mut desired = desired.clone();
    desired.metadata.uid = found.metadata.uid.clone();
    secrets
        .patch(
            &name,
            &PatchParams::apply(crate::connection::FIELD_MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await?;
    Ok(())
}

/// Deletion: the roles go (their sessions ended, what they own handed to the owner),
/// then the finalizer. Never touches the data.
async fn cleanup(
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
        Err(e) if namespace_going || matches!(e, Error::Blocked { .. }) => {
            event(ctx, user, false, "RolesLeftOnServer", &format!(
                "the user's roles could not be dropped ({e}); the namespace is going or the server is gone, so they are left on the server"
            ))
            .await;
        }
        Err(e) => return Err(e),
    }
    dbops_shared::finalizer::set(user, api, FINALIZER, false).await?;
    ctx.state.written.forget(&user.uid().unwrap_or_default());
    event(
        ctx,
        user,
        true,
        "Deleted",
        "the user's logins were dropped and their sessions ended",
    )
    .await;
    Ok(Action::await_change())
}

async fn event(ctx: &Context<State>, user: &DatabaseUser, normal: bool, reason: &str, note: &str) {
    dbops_shared::events::publish(&ctx.state.recorder, user, normal, "Reconcile", reason, note)
        .await;
}

/// The status from the outcome, written only when it differs (a JSON patch whose test
/// makes the UID a precondition), with an Event when Ready changes.
async fn publish(
    user: &DatabaseUser,
    ctx: &Context<State>,
    api: &Api<DatabaseUser>,
    outcome: &Result<Done>,
) -> Result<()> {
    let old = ctx.state.latest(user);
    let mut new = old.clone();
    let generation = user.metadata.generation;
    new.observed_generation = generation;
    let (status, reason, message) = match outcome {
        Ok(done) => {
            new.server = Some(done.server.clone());
            new.group_role = Some(done.group.clone());
            new.role = Some(done.role.clone());
            new.previous_role = done.previous.as_ref().map(|(r, _)| r.clone());
            new.previous_valid_until = done
                .previous
                .as_ref()
                .and_then(|(_, until)| jiff::Timestamp::from_second(*until as i64).ok().map(Time));
            new.last_rotation = done.last_rotation.clone();
            new.rotate_request = done.rotate_request.clone();
            new.connection_secret = Some(user.connection_secret_name());
            new.former_server = done.former_server.clone();
            if !done.missing_schemas.is_empty() {
                (
                    ConditionStatus::False,
                    "SchemaNotFound",
                    format!(
                        "{}; schemas {} do not exist yet (granted once they do, at the next resync)",
                        done.message,
                        done.missing_schemas.join(", ")
                    ),
                )
            } else if let Some(former) = &done.former_server {
                (
                    ConditionStatus::True,
                    "UserReady",
                    format!(
                        "{}; its roles on former DatabaseServer {former} are not dropped yet",
                        done.message
                    ),
                )
            } else {
                (ConditionStatus::True, "UserReady", done.message.clone())
            }
        }
        Err(e) => (ConditionStatus::False, e.reason(), e.to_string()),
    };
    set_condition(
        &mut new.conditions,
        ConditionSpec {
            type_: condition::READY,
            status,
            reason,
            message: message.clone(),
            observed_generation: generation,
        },
        now(),
    );
    if new == old {
        return Ok(());
    }
    let patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": user.uid().unwrap_or_default()},
        {"op": "add", "path": "/status", "value": new},
    ]))
    .map_err(|e| Error::Internal(format!("building the status patch: {e}")))?;
    match api
        .patch_status(
            &user.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 422 => {
            confirm_live(ctx, user).await?;
            return Err(kube::Error::Api(e).into());
        }
        Err(e) => return Err(e.into()),
    }
    // Until the cache shows it (`State::latest`): a reconcile that starts before the watch
    // delivers this write must not decide on the status before it (it rotated a second
    // time for the same annotation value when the user watch lagged behind under load).
    ctx.state
        .written
        .insert(&user.uid().unwrap_or_default(), new.clone());
    let before =
        get(&old.conditions, condition::READY).map(|c| (c.status.clone(), c.reason.clone()));
    if before != Some((status.as_str().to_string(), reason.to_string())) {
        event(ctx, user, status == ConditionStatus::True, reason, &message).await;
    }
    if new.last_rotation != old.last_rotation && old.last_rotation.is_some() {
        event(
            ctx,
            user,
            true,
            "PasswordRotated",
            &format!(
                "the connection Secret now names login {}; {} keeps working until {}",
                new.role.clone().unwrap_or_default(),
                new.previous_role
                    .clone()
                    .unwrap_or_else(|| "no previous login".into()),
                new.previous_valid_until
                    .as_ref()
                    .map_or_else(String::new, |t| t.0.to_string())
            ),
        )
        .await;
    }
    Ok(())
}
