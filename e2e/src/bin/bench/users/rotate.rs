//! One rotation of every Database and user: the annotation, the watches until every
//! Secret and status shows the new login and every previous login is retired, then the
//! checks on the server.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use dbops_api::{Database, DatabaseUser};
use dbops_e2e::PgServer;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use super::args::{UsersArgs, db_name, user_of};
use super::wait::{Bound, password, username, wait_all};
use super::window::{Bed, Change, LoginChange, Rotation};

/// One rotation of every Database and user: the annotation, then the watches, then the
/// checks (see [`Rotation::anomalies`]).
pub(crate) async fn rotate(
    bed: &Bed<'_>,
    args: &UsersArgs,
    round: u32,
    dbs: &Api<Database>,
    users: &Api<DatabaseUser>,
    secrets: &Api<Secret>,
) -> Result<Rotation> {
    let request = format!("bench-{round}");
    // The credentials before: each Secret's (login and password), each status's login.
    let by_secret: HashMap<String, (String, String)> = secrets
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|s| Some((s.name_any(), (username(s)?, password(s)?))))
        .collect();
    ensure!(
        by_secret.len() == args.objects(),
        "{} connection Secrets, not {}",
        by_secret.len(),
        args.objects()
    );
    let named = |logins: Vec<(String, Option<String>)>| -> HashMap<String, String> {
        logins
            .into_iter()
            .filter_map(|(name, login)| Some((name, login?)))
            .collect()
    };
    let db_login = named(logins_now(dbs).await?);
    let user_login = named(logins_now(users).await?);
    ensure!(
        db_login.len() == args.databases as usize && user_login.len() == args.users(),
        "not every status names its login ({} Databases, {} users)",
        db_login.len(),
        user_login.len()
    );
    // A sample to log in with: the first Database's Secret and its users', before.
    let sample: Vec<String> = std::iter::once(db_name(0))
        .chain((0..args.users_per_database).map(|j| user_of(0, j).0))
        .map(|o| format!("{o}-connection"))
        .collect();
    let mut old_sample = Vec::new();
    for name in &sample {
        old_sample.push(secrets.get(name).await?);
    }

    let by_secret = Arc::new(by_secret);
    let mark = bed.mark().await?;
    let t0 = mark.t0;
    let limit = args.limit();
    // Nothing is retired before keepPrevious is up: that is no stall.
    let keep = dbops_api::access::parse_duration(&args.keep_previous).unwrap_or_default();
    let retire_limit = Bound {
        total: limit.total + keep,
        stall: limit.stall + keep,
    };
    // Rotated: the Secret holds another credential; the status shows the request.
    let secrets_flipped = {
        let before = by_secret.clone();
        wait_all(
            secrets.clone(),
            args.objects(),
            t0,
            limit,
            move |s: &Secret| {
                let now = username(s).zip(password(s));
                before
                    .get(&s.name_any())
                    .is_some_and(|old| now.is_some_and(|now| &now != old))
            },
        )
    };
    let db_rotated = wait_rotated(dbs, args.databases as usize, t0, limit, &request, false);
    let user_rotated = wait_rotated(users, args.users(), t0, limit, &request, false);
    // Retired: the status names no previous login any more (the controller took its
    // LOGIN away, and ended its sessions, first); checked in pg_roles below.
    let db_retired = wait_rotated(
        dbs,
        args.databases as usize,
        t0,
        retire_limit,
        &request,
        true,
    );
    let user_retired = wait_rotated(users, args.users(), t0, retire_limit, &request, true);
    let annotate = async {
        let patch = json!({"metadata": {"annotations": {"dbops.dev/rotate": request}}});
        let names = (0..args.databases).flat_map(|i| {
            std::iter::once((true, db_name(i)))
                .chain((0..args.users_per_database).map(move |j| (false, user_of(i, j).0)))
        });
        stream::iter(names)
            .map(|(is_db, name)| {
                let (dbs, users, patch) = (dbs.clone(), users.clone(), patch.clone());
                async move {
                    let params = PatchParams::default();
                    if is_db {
                        dbs.patch(&name, &params, &Patch::Merge(&patch))
                            .await
                            .map(drop)
                    } else {
                        users
                            .patch(&name, &params, &Patch::Merge(&patch))
                            .await
                            .map(drop)
                    }
                    .with_context(|| format!("annotating {name}"))
                }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await?;
        anyhow::Ok(t0.elapsed().as_secs_f64())
    };
    let (annotated, secrets_at, db_at, user_at, db_ret, user_ret) = tokio::join!(
        annotate,
        secrets_flipped,
        db_rotated,
        user_rotated,
        db_retired,
        user_retired
    );
    let (annotated, secrets_at, db_at, user_at) = (annotated?, secrets_at?, db_at?, user_at?);
    let retired = db_ret?.max(user_ret?);
    let window = bed.window(&mark).await?;

    let mut anomalies = Vec::new();
    // One rotation per credential: a login other than before, named by both the status
    // and the Secret (an even number of rotations would end on the same login), and one
    // `VALID UNTIL <time>` (the previous login's expiry) per credential on the server.
    let now_secrets: HashMap<String, String> = secrets
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|s| Some((s.name_any(), username(s)?)))
        .collect();
    let mut same = Vec::new();
    let mut differ = Vec::new();
    let now_logins = logins_now(dbs)
        .await?
        .into_iter()
        .chain(logins_now(users).await?);
    for (name, login) in now_logins {
        let old = db_login.get(&name).or_else(|| user_login.get(&name));
        if login.as_ref() == old {
            same.push(name.clone());
        }
        if login.as_ref() != now_secrets.get(&format!("{name}-connection")) {
            differ.push(name);
        }
    }
    push_examples(
        &mut anomalies,
        &same,
        "credentials are on the same login as before the rotation (rotated an even number of times)",
        ", ",
    );
    push_examples(
        &mut anomalies,
        &differ,
        "statuses name another login than their Secret",
        ", ",
    );
    let logins = check_logins(&window.logins, args.objects());
    let expiries = logins.expiries;
    anomalies.extend(logins.anomalies);

    // In PostgreSQL: every previous login has lost LOGIN.
    let admin = bed.pg.connect_as_superuser().await?;
    // (Those on the same login as before are reported above.)
    let previous: Vec<String> = db_login
        .iter()
        .chain(user_login.iter())
        .filter(|(name, _)| !same.contains(name))
        .map(|(_, login)| login.clone())
        .collect();
    let row = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE rolcanlogin), count(*) FROM pg_roles WHERE rolname = ANY($1)",
            &[&previous],
        )
        .await?;
    let (can, found): (i64, i64) = (row.get(0), row.get(1));
    if found as usize != previous.len() || can != 0 {
        anomalies.push(format!(
            "{can} of the {} previous logins can still log in ({found} found)",
            previous.len()
        ));
    }
    // The sample: the old Secrets are refused, the new ones let in.
    for (name, old) in sample.iter().zip(&old_sample) {
        let new = secrets.get(name).await?;
        if try_login(bed.pg, old).await {
            anomalies.push(format!("{name}: the previous credential still logs in"));
        }
        if !try_login(bed.pg, &new).await {
            anomalies.push(format!("{name}: the new credential does not log in"));
        }
    }
    Ok(Rotation {
        round,
        annotated,
        secrets: secrets_at,
        db_status: db_at,
        user_status: user_at,
        rotated: secrets_at.max(db_at).max(user_at),
        retired,
        previous_checked: previous.len(),
        expiries,
        anomalies,
        window,
    })
}

/// A Database or a user, as its status names its logins.
trait Credential: ResourceExt {
    /// The login now, the previous login, and the rotation request carried out.
    fn logins(&self) -> (Option<&String>, Option<&String>, Option<&str>);

    /// The status shows `request` carried out and names a login; `retired`: and no
    /// previous login any more.
    fn rotated(&self, request: &str, retired: bool) -> bool {
        let (login, previous, done) = self.logins();
        done == Some(request) && login.is_some() && (!retired || previous.is_none())
    }
}

impl Credential for Database {
    fn logins(&self) -> (Option<&String>, Option<&String>, Option<&str>) {
        self.status.as_ref().map_or((None, None, None), |s| {
            (
                s.login.as_ref(),
                s.previous_login.as_ref(),
                s.rotation.rotate_request.as_deref(),
            )
        })
    }
}

impl Credential for DatabaseUser {
    fn logins(&self) -> (Option<&String>, Option<&String>, Option<&str>) {
        self.status.as_ref().map_or((None, None, None), |s| {
            (
                s.role.as_ref(),
                s.previous_role.as_ref(),
                s.rotation.rotate_request.as_deref(),
            )
        })
    }
}

/// Each object of `api` by name, with the login its status names now (`None`: none).
async fn logins_now<K>(api: &Api<K>) -> Result<Vec<(String, Option<String>)>>
where
    K: Credential + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|o| (o.name_any(), o.logins().0.cloned()))
        .collect())
}

/// Waits until `want` objects of `api` are [`Credential::rotated`] by `request` (see [`wait_all`]).
async fn wait_rotated<K>(
    api: &Api<K>,
    want: usize,
    t0: std::time::Instant,
    bound: Bound,
    request: &str,
    retired: bool,
) -> Result<f64>
where
    K: Credential
        + kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
    K::DynamicType: Default,
{
    wait_all(api.clone(), want, t0, bound, |o: &K| {
        o.rotated(request, retired)
    })
    .await
}

/// What the login changes of a rotation window say.
pub(crate) struct LoginCheck {
    pub(crate) expiries: usize,
    pub(crate) anomalies: Vec<String>,
}

/// One rotation of `credentials` credentials on the server is, for each: one expiry
/// (`VALID UNTIL <time>`) of the login given up, one activation of the login given out,
/// and one retirement (`NOLOGIN`) of the login given up, not before its expiry.
pub(crate) fn check_logins(changes: &[LoginChange], credentials: usize) -> LoginCheck {
    let mut expiry: HashMap<&str, Timestamp> = HashMap::new();
    let (mut expiries, mut activations, mut retirements) = (0, 0, 0);
    let mut early = Vec::new();
    let mut unannounced = Vec::new();
    for c in changes {
        match &c.change {
            Change::Expires(until) => {
                expiries += 1;
                expiry.insert(&c.role, *until);
            }
            Change::Activated => activations += 1,
            Change::Retired => {
                retirements += 1;
                match expiry.get(c.role.as_str()) {
                    // The server's clock and the controller's are the same machine's;
                    // the log's time has millisecond precision.
                    Some(until) if c.at.as_millisecond() + 1 < until.as_millisecond() => early
                        .push(format!(
                            "{} at {} ({:.1} s before its expiry {until})",
                            c.role,
                            c.at,
                            (until.as_millisecond() - c.at.as_millisecond()) as f64 / 1000.0
                        )),
                    Some(_) => {}
                    None => unannounced.push(format!("{} at {}", c.role, c.at)),
                }
            }
        }
    }
    let mut anomalies = Vec::new();
    for (what, count) in [
        ("expiries (VALID UNTIL <time>)", expiries),
        ("activations (LOGIN VALID UNTIL 'infinity')", activations),
        ("retirements (NOLOGIN)", retirements),
    ] {
        if count != credentials {
            anomalies.push(format!(
                "{count} {what} on the server for {credentials} credentials"
            ));
        }
    }
    push_examples(
        &mut anomalies,
        &early,
        "logins retired before their keepPrevious was up",
        "; ",
    );
    push_examples(
        &mut anomalies,
        &unannounced,
        "logins retired without an expiry set in the rotation",
        "; ",
    );
    LoginCheck {
        expiries,
        anomalies,
    }
}

/// Adds to `anomalies`, when there are `items`: `<how many> <what>, e.g. <the first three,
/// joined by sep>`.
fn push_examples(anomalies: &mut Vec<String>, items: &[String], what: &str, sep: &str) {
    if !items.is_empty() {
        anomalies.push(format!(
            "{} {what}, e.g. {}",
            items.len(),
            items.iter().take(3).cloned().collect::<Vec<_>>().join(sep)
        ));
    }
}

/// Whether the credential of a connection Secret logs in.
pub(crate) async fn try_login(pg: &PgServer, s: &Secret) -> bool {
    let key = |k: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .unwrap_or_default()
    };
    pg.connect(&key("username"), &key("password"), &key("dbname"))
        .await
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::users::window::{log_time, login_changes};

    #[test]
    fn login_changes_are_read_from_the_log() {
        let line =
            "2026-11-25 02:04:51.164 UTC [17828] postgres@postgres app=dbops LOG:  statement: x";
        let at = log_time(line).unwrap();
        assert_eq!(at.to_string(), "2026-11-25T02:04:51.164Z");
        let sql = "CREATE ROLE \"a_2\" LOGIN INHERIT; ALTER ROLE \"a_2\" LOGIN VALID UNTIL 'infinity'; ALTER ROLE \"a_2\" CONNECTION LIMIT -1";
        let changes = login_changes(at, sql);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].change, Change::Activated);
        let expiry = login_changes(
            at,
            "ALTER ROLE \"a_1\" VALID UNTIL '2026-11-25T02:04:59.875Z'",
        );
        let until: Timestamp = "2026-11-25T02:04:59.875Z".parse().unwrap();
        assert_eq!(expiry[0].change, Change::Expires(until));
        assert_eq!(
            login_changes(at, "ALTER ROLE \"a_1\" NOLOGIN")[0].change,
            Change::Retired
        );

        // One rotation: expiry, activation, retirement after the expiry.
        let later: Timestamp = "2026-11-25T02:05:00.100Z".parse().unwrap();
        let change = |at, role: &str, change| LoginChange {
            at,
            role: role.into(),
            change,
        };
        let good = [
            change(at, "a_1", Change::Expires(until)),
            change(at, "a_2", Change::Activated),
            change(later, "a_1", Change::Retired),
        ];
        assert!(check_logins(&good, 1).anomalies.is_empty());
        // The flip seen under load: the old login given out again, the new one retired
        // at once.
        let flipped = [
            change(at, "a_1", Change::Expires(until)),
            change(at, "a_2", Change::Activated),
            change(at, "a_1", Change::Activated),
            change(at, "a_2", Change::Retired),
            change(at, "a_2", Change::Activated),
            change(at, "a_1", Change::Retired),
        ];
        let found = check_logins(&flipped, 1).anomalies;
        assert_eq!(found.len(), 4, "{found:?}");
    }
}
