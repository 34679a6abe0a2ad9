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
/// yet, as this process last wrote it (`TenantSecrets::lookup`; issue 35: it was a GET,
/// one API request per new Database that answered 404). A cached copy may be a little
/// old; every change to it is a watch event that reconciles the Database again.
pub(crate) async fn cached_secret(
    ctx: &Context<State>,
    db: &Database,
) -> Result<Option<Arc<Secret>>> {
    let namespace = db.namespace().unwrap_or_default();
    let name = db.connection_secret_name();
    let store = ctx.state.tenants.secrets_for(db).await?;
    Ok(ctx.state.tenants.lookup(&store, &namespace, &name))
}

/// The connection Secret to decide on: [`cached_secret`], read again from the API when the
/// cache names another login than the latest status (its watch lags under load; deciding
/// on the stale copy would undo a rotation: the previous login given out again, the new
/// one retired), and checked to be this Database's own (a Secret of that name that this
/// Database did not create is never written, and nothing happens on the server either).
pub(crate) async fn existing_secret(
    ctx: &Context<State>,
    db: &Database,
) -> Result<Option<Arc<Secret>>> {
    let existing = cached_secret(ctx, db).await?;
    let latest_login = ctx.state.statuses.latest(db).login;
    let existing = match (existing, latest_login.as_deref()) {
        (Some(found), Some(login)) if secret::username(&found).is_some_and(|u| u != login) => {
            let secrets: Api<Secret> =
                Api::namespaced(ctx.client.clone(), &db.namespace().unwrap_or_default());
            secrets
                .get_opt(&db.connection_secret_name())
                .await?
                .map(Arc::new)
        }
        (existing, _) => existing,
    };
    if let Some(found) = &existing {
        secret::check_ours(found, db).map_err(secret_conflict)?;
    }
    Ok(existing)
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
    let written = write_owned_secret(
        secrets,
        &db.connection_secret_name(),
        existing,
        desired,
        confirm_live(&ctx.client, db),
        |found| secret::check_ours(found, db).map_err(secret_conflict),
    )
    .await?;
    if let Some(written) = written {
        ctx.state.tenants.wrote(written);
    }
    Ok(())
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
) -> Result<Option<Secret>> {
    if existing.is_some_and(|s| secret::is_current(s, desired)) {
        return Ok(None);
    }
    live.await?;
    let written = match existing {
        // A new Secret: a plain create costs the apiserver less than an apply.
        None => match secrets.create(&PostParams::default(), desired).await {
            Ok(created) => Ok(created),
            // Not in the cache, yet there: written only if it is the owner's own.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = secrets.get(name).await?;
                check(&found)?;
                apply_secret(secrets, name, &found, desired).await
            }
            Err(e) => Err(e.into()),
        },
        Some(found) => apply_secret(secrets, name, found, desired).await,
    }?;
    Ok(Some(written))
}

/// Server-side apply of the Secret: takes back every field this controller sets. Only
/// over `found`, the Secret checked to be the owner's: its UID is a precondition (a
/// Secret of that name made since by someone else is refused, never taken over).
async fn apply_secret(
    secrets: &Api<Secret>,
    name: &str,
    found: &Secret,
    desired: &Secret,
) -> Result<Secret> {
    let mut desired = desired.clone();
    desired.metadata.uid = found.metadata.uid.clone();
    Ok(secrets
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await?)
}

fn secret_conflict(message: String) -> Error {
    Error::Blocked {
        reason: DatabaseReason::SecretConflict.as_str(),
        message,
    }
}
