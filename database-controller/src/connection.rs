//! The Database's connection Secret as the reconcile reads and writes it: from its
//! namespace's watch cache (`tenant_secrets`) or the API, checked to be this Database's
//! own, written (create, else server-side apply) only when it differs from what
//! `secret::desired_for` builds. What it holds is `secret`'s.

use dbops_api::reasons::DatabaseReason;
use std::sync::Arc;

use dbops_api::Database;
use dbops_shared::controller::Context;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};

use crate::error::{Error, Result};
use crate::live::confirm_live;
use crate::secret;
use crate::server_access::server_of;
use crate::state::State;

pub const FIELD_MANAGER: &str = "dbops-database-controller";

/// The Database's connection Secret from its namespace's watch cache (set up at once when
/// the namespace is not yet, see `tenant_secrets`) or, when the cache does not hold it
/// (newer than the cache), from the API. A cached copy may be a little old; every change
/// to it is a watch event that reconciles the Database again. The cache holds dbops'
/// Secrets only (its label), so a Secret of that name someone else made is found by the
/// GET, before anything happens on the server (`an_existing_secret_is_never_taken_over`);
/// the full check of a new Database claims the name instead ([`existing_or_unseen`]).
pub(crate) async fn cached_secret(
    ctx: &Context<State>,
    db: &Database,
) -> Result<Option<Arc<Secret>>> {
    let name = db.connection_secret_name();
    ctx.state.tenants.current(db, &name, None).await
}

/// The connection Secret to decide on (`TenantSecrets::current`, the one re-read rule: read
/// again from the API when the cache names another login than the latest status), checked
/// to be this Database's own (a Secret of that name that this Database did not create is
/// never written, and nothing happens on the server either).
pub(crate) async fn existing_secret(
    ctx: &Context<State>,
    db: &Database,
) -> Result<Option<Arc<Secret>>> {
    let latest_login = ctx.state.statuses.latest(db).login;
    let name = db.connection_secret_name();
    let existing = ctx
        .state
        .tenants
        .current(db, &name, latest_login.as_deref())
        .await?;
    if let Some(found) = &existing {
        secret::check_ours(found, db).map_err(secret_conflict)?;
    }
    Ok(existing)
}

/// [`existing_secret`] for a full check, except that a Secret the namespace's cache does
/// not hold is not looked for: `(None, true)`, and the check claims the name with
/// [`claim_secret`] right before anything changes on the server. A new Database thus
/// costs one API request for its Secret instead of three (a GET that answers 404, a
/// second [`confirm_live`] and the create), and what is written on the server is kept in
/// its Secret first. A Database restored from a Backup looks for its Secret as before
/// (its Secret appears once the restore is done).
pub(crate) async fn existing_or_unseen(
    ctx: &Context<State>,
    db: &Database,
) -> Result<(Option<Arc<Secret>>, bool)> {
    let name = db.connection_secret_name();
    let store = ctx.state.tenants.secrets_for(db).await?;
    let cached = store.contains(Some(&db.namespace().unwrap_or_default()), &name);
    if cached || db.filled_at_creation() {
        return Ok((existing_secret(ctx, db).await?, false));
    }
    Ok((None, true))
}

/// Creates the connection Secret that [`existing_or_unseen`] did not see, holding the
/// password the owner role is about to be created with, for the Database just confirmed
/// live, before the plan's changes on the server (a `CREATE ROLE` that fails leaves the
/// Secret's password to the next check's). A Secret of that name already there is
/// [`unseen_found`].
pub(crate) async fn claim_secret(
    ctx: &Context<State>,
    db: &Database,
    target: &dbops_shared::server::Resolved,
    password: &str,
) -> Result<Arc<Secret>> {
    let claim = secret::desired_for(
        &secret::Owner::database(db),
        &db.database_name(),
        &db.owner_role(),
        target,
        password,
    )
    .map_err(crate::error::template_error)?;
    let name = db.connection_secret_name();
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    match secrets.create(&PostParams::default(), &claim).await {
        Ok(created) => Ok(Arc::new(created)),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            Err(unseen_found(&secrets.get(&name).await?, db))
        }
        Err(e) => Err(e.into()),
    }
}

/// For a check that will not [`claim_secret`] (the owner role exists: a Secret claimed
/// with a new password before `ALTER ROLE` could outlive a failed one and be taken for
/// the password in force), that no Secret of the name is there, read before anything
/// changes on the server.
pub(crate) async fn confirm_unseen(ctx: &Context<State>, db: &Database) -> Result<()> {
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
    match secrets.get_opt(&db.connection_secret_name()).await? {
        None => Ok(()),
        Some(found) => Err(unseen_found(&found, db)),
    }
}

/// A Secret of the Database's connection Secret name that the cache did not hold: someone
/// else's is a `SecretConflict`; this Database's own (newer than the cache) abandons the
/// check (`Superseded`, nothing written), and the cache then decides on it.
fn unseen_found(found: &Secret, db: &Database) -> Error {
    match secret::check_ours(found, db) {
        Err(conflict) => secret_conflict(conflict),
        Ok(()) => Error::Superseded(format!(
            "connection Secret {} is newer than its namespace's cache; the Database is checked again on it",
            db.connection_secret_name()
        )),
    }
}

/// Whether the connection Secret holds the password written and everything else current.
pub(crate) async fn secret_is_current(db: &Database, ctx: &Context<State>) -> Result<bool> {
    // Not reachable (yet): the full check says why.
    let Ok(Some(existing)) = cached_secret(ctx, db).await else {
        return Ok(false);
    };
    let Ok(target) = server_of(&ctx.state.directory, db).await else {
        return Ok(false);
    };
    let login = secret::username(&existing).unwrap_or_else(|| db.owner_role());
    Ok(secret::kept_password(&existing).is_some_and(|password| {
        secret::desired_for(
            &secret::Owner::database(db),
            &db.database_name(),
            &login,
            &target,
            &password,
        )
        .is_ok_and(|desired| secret::is_current(&existing, &desired))
    }))
}

/// Writes the connection Secret unless `existing` already carries `desired`, for the
/// Database that is still the live one.
pub(crate) async fn write_secret(
    ctx: &Context<State>,
    secrets: &Api<Secret>,
    db: &Database,
    existing: Option<&Secret>,
    desired: &Secret,
) -> Result<()> {
    write_owned_secret(
        secrets,
        &db.connection_secret_name(),
        existing,
        desired,
        confirm_live(&ctx.client, db),
        |found| secret::check_ours(found, db).map_err(secret_conflict),
    )
    .await
}

/// Writes the connection Secret `name` as `desired` unless `existing` (from the cache,
/// checked by the caller) already carries it, once `live` has confirmed that its owner
/// (a Database, a user) is still the live one: created, or applied over the one there,
/// `existing` or the one a create runs into, written only once `check` says it is the
/// owner's own.
pub(crate) async fn write_owned_secret(
    secrets: &Api<Secret>,
    name: &str,
    existing: Option<&Secret>,
    desired: &Secret,
    live: impl Future<Output = Result<()>>,
    check: impl FnOnce(&Secret) -> Result<()>,
) -> Result<()> {
    if existing.is_some_and(|s| secret::is_current(s, desired)) {
        return Ok(());
    }
    live.await?;
    match existing {
        // A new Secret: a plain create costs the apiserver less than an apply.
        None => match secrets.create(&PostParams::default(), desired).await {
            Ok(_) => Ok(()),
            // Not in the cache, yet there: written only if it is the owner's own.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = secrets.get(name).await?;
                check(&found)?;
                apply_secret(secrets, name, &found, desired).await
            }
            Err(e) => Err(e.into()),
        },
        Some(found) => apply_secret(secrets, name, found, desired).await,
    }
}

/// Server-side apply of the Secret: takes back every field this controller sets. Only
/// over `found`, the Secret checked to be the owner's: its UID is a precondition (a
/// Secret of that name made since by someone else is refused, never taken over).
async fn apply_secret(
    secrets: &Api<Secret>,
    name: &str,
    found: &Secret,
    desired: &Secret,
) -> Result<()> {
    let mut desired = desired.clone();
    desired.metadata.uid = found.metadata.uid.clone();
    secrets
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await?;
    Ok(())
}

fn secret_conflict(message: String) -> Error {
    Error::Reported {
        reason: DatabaseReason::SecretConflict.into(),
        message,
    }
}
