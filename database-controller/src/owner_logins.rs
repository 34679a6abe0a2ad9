//! Rotation of a Database owner's password without downtime. PostgreSQL has one password
//! per role, so the owner role `<owner>` keeps owning the database and every object, and
//! two logins `<owner>-1`/`<owner>-2` take turns (names no tenant can give a role:
//! `dbops_shared::postgres::derived`): each is a member of the owner whose
//! sessions start as the owner (`ALTER ROLE ... SET role = '<owner>'`), so what they create
//! is the owner's, as before, and DatabaseUsers' default privileges (FOR ROLE the owner)
//! hold for it.
//!
//! A Database starts as it always did: the connection Secret names the owner itself.
//! The first rotation (every `passwordRotation.every`, or a new value of the annotation
//! `dbops.dev/rotate`) gives `<owner>-1` a password and the Secret; the owner's own login
//! expires after `keepPrevious` (`VALID UNTIL`, enforced by the server) and then loses
//! LOGIN, its sessions ended. Later rotations alternate between the two logins. A Database
//! never rotated has no login role: nothing changes for it (the upgrade is a no-op).
//!
//! Crash safety: the previous login's expiry is set before the new login is given out,
//! so a login the Secret no longer names and without expiry is one to retire.

use dbops_api::names::annotation::ROTATE;
use dbops_api::reasons::DatabaseReason;
use dbops_api::{Database, DatabaseStatus};
use dbops_shared::postgres::Session;
use kube::ResourceExt;

use crate::error::{Error, Result};
use crate::role_sql as sql;
use crate::rotation;
use crate::rotation::turn::{self, Inputs, Shape};
pub use crate::rotation::turn::{Carried, Kept, Logins};

/// The owner's two logins (`dbops_shared::postgres::derived`: no tenant can take them).
pub fn logins(owner: &str) -> [String; 2] {
    dbops_shared::postgres::derived::owner_logins(owner)
}

/// Whether the owner's logins are in play: rotation asked for (now or before).
pub fn in_play(db: &Database, kept: Option<&Kept>) -> bool {
    db.spec.login.password_rotation.is_some()
        || db.annotations().contains_key(ROTATE)
        || kept.is_some_and(|k| k.login != db.owner_role())
}

/// Whether a rotation of the owner's password is due now, and why (`status`: the latest
/// written; see `rotation::due`).
pub fn rotation_due(db: &Database, status: &DatabaseStatus, now: f64) -> Option<String> {
    rotation::due(
        db.annotations(),
        db.spec.login.password_rotation.as_ref(),
        status.rotation.rotate_request.as_ref(),
        status.rotation.last_rotation.as_ref(),
        now,
    )
}

/// Whether a full check is due for rotation's sake: a rotation, or a previous login's end.
pub fn due(db: &Database, status: &DatabaseStatus, now: f64) -> bool {
    rotation_due(db, status, now).is_some()
        || status
            .rotation
            .previous_valid_until
            .as_ref()
            .is_some_and(|t| rotation::epoch(t) <= now)
}

/// Brings the owner's logins to what rotation asks (see the module's documentation), on
/// the admin's session. `kept` is what the Secret holds; `owner_password` the password
/// the owner role itself has when it is still the login in use (kept, or just set);
/// `carried` the previous login the Secret carries. `confirm` runs before each change on
/// the server.
#[allow(clippy::too_many_arguments)]
pub async fn converge<F, Fut>(
    db: &Database,
    status: &DatabaseStatus,
    session: &mut Session,
    kept: Option<&Kept>,
    carried: Option<&Carried>,
    owner_password: &str,
    settings: &[(&'static str, String)],
    mark: &str,
    confirm: F,
) -> Result<Logins>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let owner = db.owner_role();
    let pair = logins(&owner);
    let mut names = vec![owner.clone(), pair[0].clone(), pair[1].clone()];
    names.dedup();
    let roles = sql::observe_roles(session, &owner, &names).await?;
    let uid = db.uid().unwrap_or_default();
    if let Some(theirs) = roles
        .iter()
        .filter(|r| r.name != owner)
        .find(|r| !crate::sql::is_ours(r.comment.as_deref(), &uid))
    {
        return Err(Error::Reported {
            reason: DatabaseReason::NameConflict.into(),
            message: format!(
                "role {:?} (a login of the owner for password rotation) already exists and was not created by this Database; nothing was changed",
                theirs.name
            ),
        });
    }
    // The rotation logins start as the owner (`SET role`); the owner's own login is the
    // plan's.
    let mut login_settings = settings.to_vec();
    login_settings.push(("role", owner.clone()));
    login_settings.sort();
    let shape = Shape {
        group: &owner,
        mark,
        connection_limit: -1,
        settings: &login_settings,
    };
    let plan = turn::plan(
        &Inputs {
            pair: &pair,
            outside: Some((&owner, owner_password)),
            kept,
            status_login: status.login.as_deref(),
            annotations: db.annotations(),
            rotation: db.spec.login.password_rotation.as_ref(),
            last_rotation: status.rotation.last_rotation.as_ref(),
            rotate_request: status.rotation.rotate_request.as_ref(),
            every_new_password_counts: false,
            carried,
            roles: &roles,
            now: rotation::secs_now(),
        },
        shape,
        dbops_shared::postgres::generate_password,
    );
    turn::apply(session, &plan, &roles, shape, confirm).await?;
    Ok(plan.logins)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owners_logins_fit_postgres() {
        assert_eq!(logins("orders"), ["orders-1", "orders-2"]);
        let long = "o".repeat(63);
        assert!(logins(&long).iter().all(|l| l.len() <= 63));
    }
}
