//! Rotation of a Database owner's password without downtime. PostgreSQL has one password
//! per role, so the owner role `<owner>` keeps owning the database and every object, and
//! two logins `<owner>_1`/`<owner>_2` take turns: each is a member of the owner whose
//! sessions start as the owner (`ALTER ROLE ... SET role = '<owner>'`), so what they create
//! is the owner's, as before, and DatabaseUsers' default privileges (FOR ROLE the owner)
//! hold for it.
//!
//! A Database starts as it always did: the connection Secret names the owner itself.
//! The first rotation (every `passwordRotation.every`, or a new value of the annotation
//! `dbops.dev/rotate`) gives `<owner>_1` a password and the Secret; the owner's own login
//! expires after `keepPrevious` (`VALID UNTIL`, enforced by the server) and then loses
//! LOGIN, its sessions ended. Later rotations alternate between the two logins. A Database
//! never rotated has no login role: nothing changes for it (the upgrade is a no-op).
//!
//! Crash safety: the previous login's expiry is set before the new login is given out,
//! so a login the Secret no longer names and without expiry is one to retire.

use std::time::Duration;

use dbops_api::{Database, DatabaseStatus, ROTATE_ANNOTATION};
use dbops_shared::postgres::Session;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::error::{Error, Result};
use crate::rotation;
use crate::user::sql;

/// The owner's two logins.
pub fn logins(owner: &str) -> [String; 2] {
    let base = if owner.len() <= 61 {
        owner.to_string()
    } else {
        let hash = dbops_shared::checksum::sha256_hex(owner.as_bytes());
        format!("{}_{}", &owner[..54], &hash[..6])
    };
    sql::logins(&base)
}

/// What the Secret holds: its login and password (when ours and intact).
#[derive(Clone)]
pub struct Kept {
    pub login: String,
    pub password: String,
}

/// The logins after a reconcile.
#[derive(Clone, Default, PartialEq)]
pub struct Logins {
    /// The login the connection Secret names, and its password.
    pub login: String,
    pub password: String,
    /// The previous login while it still works, with its expiry (seconds since the epoch).
    pub previous: Option<(String, f64)>,
    pub last_rotation: Option<Time>,
    pub rotate_request: Option<String>,
    /// When something is due next (an expiry, a rotation).
    pub next: Option<Duration>,
}

/// Never the password.
impl std::fmt::Debug for Logins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Logins")
            .field("login", &self.login)
            .field("previous", &self.previous)
            .field("last_rotation", &self.last_rotation)
            .field("rotate_request", &self.rotate_request)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

/// Whether the owner's logins are in play: rotation asked for (now or before).
pub fn in_play(db: &Database, kept: Option<&Kept>) -> bool {
    db.spec.password_rotation.is_some()
        || db.annotations().contains_key(ROTATE_ANNOTATION)
        || kept.is_some_and(|k| k.login != db.owner_role())
}

/// Whether a rotation of the owner's password is due now, and why (`status`: the latest
/// written; see `rotation::due`).
pub fn rotation_due(db: &Database, status: &DatabaseStatus, now: f64) -> Option<String> {
    rotation::due(
        db.annotations(),
        db.spec.password_rotation.as_ref(),
        status.rotate_request.as_ref(),
        status.last_rotation.as_ref(),
        now,
    )
}

/// Whether a full check is due for rotation's sake: a rotation, or a previous login's end.
pub fn due(db: &Database, status: &DatabaseStatus, now: f64) -> bool {
    rotation_due(db, status, now).is_some()
        || status
            .previous_valid_until
            .as_ref()
            .is_some_and(|t| rotation::epoch(t) <= now)
}

/// Brings the owner's logins to what rotation asks (see the module's documentation), on
/// the admin's session. `kept` is what the Secret holds; `owner_password` the password
/// the owner role itself has when it is still the login in use (kept, or just set).
/// `confirm` runs before each change on the server.
#[allow(clippy::too_many_arguments)]
pub async fn converge<F, Fut>(
    db: &Database,
    status: &DatabaseStatus,
    session: &mut Session,
    kept: Option<&Kept>,
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
    let now = rotation::secs_now();
    let [first, second] = logins(&owner);
    let mut names = vec![owner.clone(), first.clone(), second.clone()];
    names.dedup();
    let roles = sql::observe_roles(session, &owner, &names).await?;
    let uid = db.uid().unwrap_or_default();
    if let Some(theirs) = roles
        .iter()
        .filter(|r| r.name != owner)
        .find(|r| !crate::sql::is_ours(r.comment.as_deref(), &uid))
    {
        return Err(Error::Blocked {
            reason: "NameConflict",
            message: format!(
                "role {:?} (a login of the owner for password rotation) already exists and was not created by this Database; nothing was changed",
                theirs.name
            ),
        });
    }
    let role = |name: &str| roles.iter().find(|r| r.name == name);

    // The login in use, its password, and a rotation if one is due.
    let in_use = kept
        .filter(|k| k.login == owner || k.login == first || k.login == second)
        .cloned();
    let mut last_rotation = status.last_rotation.clone();
    let mut rotate_request = status.rotate_request.clone();
    let (current, password, rotated) = match &in_use {
        Some(k) => match rotation_due(db, status, now) {
            Some(why) => {
                let next = if k.login == first { &second } else { &first };
                tracing::info!(login = %next, previous = %k.login, why, "rotating the owner's password");
                (
                    next.clone(),
                    dbops_shared::postgres::generate_password(),
                    Some(k.login.clone()),
                )
            }
            None => (k.login.clone(), k.password.clone(), None),
        },
        // The Secret lost or edited: the login the status names gets a new password (the
        // owner's was just set by the plan when it is the owner).
        None => match status.login.clone().filter(|l| *l == first || *l == second) {
            Some(login) => (login, dbops_shared::postgres::generate_password(), None),
            None => (owner.clone(), owner_password.to_string(), None),
        },
    };
    let fresh = in_use
        .as_ref()
        .is_none_or(|k| k.password != password || k.login != current);
    if rotated.is_some() || (fresh && last_rotation.is_none()) {
        last_rotation = Some(dbops_shared::conditions::now());
    }
    if rotated.is_some() || rotate_request.is_none() {
        rotate_request = db.annotations().get(ROTATE_ANNOTATION).cloned();
    }

    // The previous login's expiry first.
    let mut previous = None;
    if let Some(prev) = &rotated {
        let keep = rotation::keep_previous(db.spec.password_rotation.as_ref());
        let until = now + keep.as_secs_f64();
        confirm().await?;
        sql::keep_until(session, prev, &rotation::rfc3339(until)).await?;
        previous = Some((prev.clone(), until));
    }
    // The login in use (the owner's own login is the plan's).
    let mut login_settings = settings.to_vec();
    login_settings.push(("role", owner.clone()));
    login_settings.sort();
    if current != owner {
        let want = sql::LoginSpec {
            name: &current,
            group: &owner,
            mark,
            connection_limit: -1,
            settings: &login_settings,
        };
        let have = role(&current);
        if fresh
            || rotated.is_some()
            || have.is_none_or(|h| !h.can_login || h.valid_until.is_some())
        {
            confirm().await?;
            sql::activate(session, &want, have, &password).await?;
        } else if let Some(h) = have
            && sql::login_drifted(&want, h)
        {
            confirm().await?;
            sql::repair(session, &want, h).await?;
        }
    }
    // The others: working until their expiry, then retired.
    for other in [&owner, &first, &second] {
        if *other == current || previous.as_ref().is_some_and(|(p, _)| p == other) {
            continue;
        }
        let Some(o) = role(other) else { continue };
        if !o.can_login {
            continue;
        }
        match o.valid_until {
            Some(until) if until > now => previous = Some((other.clone(), until)),
            _ => {
                confirm().await?;
                sql::retire(session, other).await?;
                tracing::info!(login = %other, "the owner's previous login retired");
            }
        }
    }
    let next = rotation::next_due(
        previous.as_ref().map(|(_, until)| *until),
        db.spec.password_rotation.as_ref(),
        last_rotation.as_ref(),
        now,
    );
    Ok(Logins {
        login: current,
        password,
        previous,
        last_rotation,
        rotate_request,
        next,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owners_logins_fit_postgres() {
        assert_eq!(logins("orders"), ["orders_1", "orders_2"]);
        let long = "o".repeat(63);
        assert!(logins(&long).iter().all(|l| l.len() <= 63));
    }
}
