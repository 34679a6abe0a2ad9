//! Two logins taking turns: the one password rotation the Database's owner
//! (`owner_logins`) and a DatabaseUser (`user`) share. PostgreSQL has one password per
//! role, so a rotation moves to the other login of a pair (`<base>-1`/`<base>-2`):
//! 1. the login given up gets `VALID UNTIL now + keepPrevious` (the server itself refuses
//!    it after that);
//! 2. the other login gets a new password, LOGIN without expiry, its limit, settings and
//!    group;
//! 3. the caller gives it out (the connection Secret);
//! 4. a login neither in use nor still within its `VALID UNTIL` loses LOGIN, its
//!    sessions ended.
//!
//! The login given up is carried with its SCRAM verifier (computed from the password the
//! Secret held; see [`Carried`]), so that on a server where it is missing or has no
//! expiry (the Database moved there with a Migration) it is set up with the same
//! credential until the same end instead of being retired: an application that still
//! has the previous Secret keeps connecting for `keepPrevious`, wherever the Database is.
//!
//! The steps run in that order, so a crash between any two leaves it safe: the previous
//! login's expiry is set before the new one is given out, so a login the Secret no longer
//! names and without expiry is one to retire.
//!
//! [`plan`] decides (pure: what the server shows, what the Secret holds, the latest
//! status, the clock); [`apply`] runs its steps.

use std::collections::BTreeMap;
use std::time::Duration;

use dbops_api::PasswordRotation;
use dbops_api::names::annotation::ROTATE;
use dbops_shared::postgres::Session;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::error::Result;
use crate::role_sql::{self as sql, LoginSpec, RoleState};
use crate::rotation;

/// What the connection Secret holds: its login and password (when ours and intact).
#[derive(Clone)]
pub struct Kept {
    pub login: String,
    pub password: String,
}

/// A SCRAM verifier (`SCRAM-SHA-256$...`): no password, but not for the logs either.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Verifier(pub String);

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<verifier>")
    }
}

/// The previous login as the connection Secret carries it (its annotation
/// `dbops.dev/previous-login`): its name, its end and its verifier.
#[derive(Clone, Debug, PartialEq)]
pub struct Carried {
    pub login: String,
    /// Seconds since the epoch.
    pub until: f64,
    pub verifier: Verifier,
}

impl Carried {
    /// The annotation's value: `<login> <until> <verifier>`.
    pub fn to_annotation(&self) -> String {
        format!("{} {} {}", self.login, self.until as i64, self.verifier.0)
    }

    /// Reads [`Carried::to_annotation`]'s form; `None` for anything else.
    pub fn from_annotation(value: &str) -> Option<Self> {
        let mut words = value.split(' ');
        let (login, until, verifier) = (words.next()?, words.next()?, words.next()?);
        if words.next().is_some() || login.is_empty() || !verifier.starts_with("SCRAM-SHA-256$") {
            return None;
        }
        Some(Self {
            login: login.to_string(),
            until: until.parse::<i64>().ok()? as f64,
            verifier: Verifier(verifier.to_string()),
        })
    }
}

/// The logins after a reconcile.
#[derive(Clone, Default, PartialEq)]
pub struct Logins {
    /// The login the connection Secret names, and its password.
    pub login: String,
    pub password: String,
    /// The previous login while it still works, with its expiry (seconds since the epoch).
    pub previous: Option<(String, f64)>,
    /// The previous login with its verifier, when known (to carry in the Secret).
    pub carried: Option<Carried>,
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
            .field("carried", &self.carried.is_some())
            .field("last_rotation", &self.last_rotation)
            .field("rotate_request", &self.rotate_request)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

/// What every login of the pair looks like but its name: `LoginSpec` without the name.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub group: &'a str,
    pub mark: &'a str,
    pub connection_limit: i32,
    pub settings: &'a [(&'static str, String)],
}

impl<'a> Shape<'a> {
    fn of(&self, name: &'a str) -> LoginSpec<'a> {
        LoginSpec {
            name,
            group: self.group,
            mark: self.mark,
            connection_limit: self.connection_limit,
            settings: self.settings,
        }
    }
}

/// What the turn is decided on.
pub struct Inputs<'a> {
    /// The two logins, in turn order.
    pub pair: &'a [String; 2],
    /// A login outside the pair that the caller sets up itself, with its password: where
    /// the turn starts before its first rotation, retired like the others after it (the
    /// Database's owner role). `None` for a DatabaseUser: it starts on the first login.
    pub outside: Option<(&'a str, &'a str)>,
    /// What the connection Secret holds.
    pub kept: Option<&'a Kept>,
    /// The login the latest status names.
    pub status_login: Option<&'a str>,
    /// The object's annotations (`dbops.dev/rotate`) and `passwordRotation`.
    pub annotations: &'a BTreeMap<String, String>,
    pub rotation: Option<&'a PasswordRotation>,
    /// From the latest status written (see `rotation::due`).
    pub last_rotation: Option<&'a Time>,
    pub rotate_request: Option<&'a String>,
    /// Whether any new password counts as a rotation for `lastRotation` ("when the
    /// password last changed": a DatabaseUser), or only the first one (the owner: a new
    /// owner password from the plan does not restart `every`).
    pub every_new_password_counts: bool,
    /// The previous login the Secret carries (see [`Carried`]).
    pub carried: Option<&'a Carried>,
    /// The roles of the pair (and `outside`) as the server shows them.
    pub roles: &'a [RoleState],
    /// Now, in seconds since the epoch.
    pub now: f64,
}

/// One change on the server, in the order [`apply`] runs them.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// The login given up keeps working until `until` (seconds since the epoch).
    Expire { login: String, until: f64 },
    /// The login in use gets its password, LOGIN without expiry, its limit, settings and
    /// group (created when missing).
    Activate { login: String },
    /// The login in use gets its limit, settings and group back; password and LOGIN kept.
    Repair { login: String },
    /// A login whose time is up loses LOGIN; its sessions end.
    Retire { login: String },
    /// The previous login, missing here or without its expiry (the Database moved to
    /// this server), gets its verifier, LOGIN and `VALID UNTIL until` back (created when
    /// missing, with the pair's limit, settings and group; the outside login only its
    /// credential and end).
    Restore {
        login: String,
        until: f64,
        verifier: Verifier,
        outside: bool,
    },
}

/// The decision: the logins after the steps, the steps, and why a rotation happens.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub logins: Logins,
    pub steps: Vec<Step>,
    /// Why the password rotates now (`None`: it does not).
    pub rotating: Option<String>,
}

impl Plan {
    /// The logins [`Step::Retire`] retires.
    pub fn retired(&self) -> impl Iterator<Item = &str> {
        self.steps.iter().filter_map(|s| match s {
            Step::Retire { login } => Some(login.as_str()),
            _ => None,
        })
    }
}

/// The login in use and its password, and the login given up with why, before any step.
fn choose(
    i: &Inputs<'_>,
    new_password: impl FnOnce() -> String,
) -> (Kept, Option<(String, String)>) {
    let [first, second] = i.pair;
    let in_turn = |l: &str| l == first || l == second || i.outside.is_some_and(|(o, _)| o == l);
    let kept = i.kept.filter(|k| in_turn(&k.login));
    let due = || {
        rotation::due(
            i.annotations,
            i.rotation,
            i.rotate_request,
            i.last_rotation,
            i.now,
        )
    };
    match kept {
        Some(k) => match due() {
            Some(why) => {
                let next = if k.login == *first { second } else { first };
                let current = Kept {
                    login: next.clone(),
                    password: new_password(),
                };
                (current, Some((k.login.clone(), why)))
            }
            None => (k.clone(), None),
        },
        // The Secret lost or edited: the login the status names gets a new password; else
        // the turn starts (the outside login's password is the caller's).
        None => match (
            i.status_login.filter(|l| l == first || l == second),
            i.outside,
        ) {
            (Some(login), _) => (
                Kept {
                    login: login.to_string(),
                    password: new_password(),
                },
                None,
            ),
            (None, Some((login, password))) => (
                Kept {
                    login: login.to_string(),
                    password: password.to_string(),
                },
                None,
            ),
            (None, None) => (
                Kept {
                    login: first.clone(),
                    password: new_password(),
                },
                None,
            ),
        },
    }
}

/// Decides the turn (see the module's documentation). `new_password` is called when a
/// login needs one.
pub fn plan(i: &Inputs<'_>, shape: Shape<'_>, new_password: impl FnOnce() -> String) -> Plan {
    let (current, rotating) = choose(i, new_password);
    let rotated = rotating.as_ref().map(|(from, _)| from.clone());
    let fresh = i
        .kept
        .is_none_or(|k| k.login != current.login || k.password != current.password);
    let mut last_rotation = i.last_rotation.cloned();
    if rotated.is_some() || (fresh && (i.every_new_password_counts || last_rotation.is_none())) {
        last_rotation = jiff::Timestamp::from_millisecond((i.now * 1000.0) as i64)
            .ok()
            .map(Time);
    }
    let mut rotate_request = i.rotate_request.cloned();
    if rotated.is_some() || rotate_request.is_none() {
        rotate_request = i.annotations.get(ROTATE).cloned();
    }

    let mut steps = Vec::new();
    // The previous login's expiry first.
    let mut previous = None;
    let mut carried = None;
    if let Some(from) = &rotated {
        let until = i.now + rotation::keep_previous(i.rotation).as_secs_f64();
        steps.push(Step::Expire {
            login: from.clone(),
            until,
        });
        previous = Some((from.clone(), until));
        // The password given up is the one the Secret held (`choose` rotates from it).
        carried = i.kept.filter(|k| k.login == *from).map(|k| Carried {
            login: from.clone(),
            until,
            verifier: Verifier(dbops_shared::postgres::password_verifier(from, &k.password)),
        });
    }
    steps.extend(in_use(i, shape, &current.login, fresh));
    let (retire, working) = others(i, &current.login, rotated.as_deref());
    steps.extend(retire);
    if let Some((login, _)) = &working {
        carried = i.carried.filter(|c| c.login == *login).cloned();
    }
    previous = working.or(previous);
    let next = rotation::next_due(
        previous.as_ref().map(|(_, until)| *until),
        i.rotation,
        last_rotation.as_ref(),
        i.now,
    );
    Plan {
        logins: Logins {
            login: current.login,
            password: current.password,
            previous,
            carried,
            last_rotation,
            rotate_request,
            next,
        },
        steps,
        rotating: rotating.map(|(_, why)| why),
    }
}

/// The step the login in use needs, if any (the outside login is the caller's): a new
/// password, or LOGIN back, or its shape repaired.
fn in_use(i: &Inputs<'_>, shape: Shape<'_>, login: &str, fresh: bool) -> Option<Step> {
    if i.outside.is_some_and(|(o, _)| o == login) {
        return None;
    }
    let have = i.roles.iter().find(|r| r.name == login);
    if fresh || have.is_none_or(|h| !h.can_login || h.valid_until.is_some()) {
        Some(Step::Activate {
            login: login.to_string(),
        })
    } else if have.is_some_and(|h| sql::login_drifted(&shape.of(login), h)) {
        Some(Step::Repair {
            login: login.to_string(),
        })
    } else {
        None
    }
}

/// The logins neither in use nor just given up: the ones whose time is up (and those
/// without expiry) to retire, and the one still working until its expiry.
fn others(
    i: &Inputs<'_>,
    current: &str,
    rotated: Option<&str>,
) -> (Vec<Step>, Option<(String, f64)>) {
    let mut retire = Vec::new();
    let mut working = None;
    let candidates = i
        .outside
        .map(|(o, _)| o)
        .into_iter()
        .chain(i.pair.iter().map(String::as_str));
    for other in candidates {
        if other == current || rotated == Some(other) {
            continue;
        }
        let role = i.roles.iter().find(|r| r.name == other);
        let here = role.and_then(|o| o.valid_until.filter(|_| o.can_login));
        if let Some(c) = i.carried.filter(|c| c.login == other && c.until > i.now)
            && here.is_none_or(|until| until <= i.now)
        {
            // Still working by the Secret's record, but not here: the Database moved.
            retire.push(Step::Restore {
                login: other.to_string(),
                until: c.until,
                verifier: c.verifier.clone(),
                outside: i.outside.is_some_and(|(o, _)| o == other),
            });
            working = Some((other.to_string(), c.until));
            continue;
        }
        match role {
            Some(o) if o.can_login => match o.valid_until {
                Some(until) if until > i.now => working = Some((other.to_string(), until)),
                _ => retire.push(Step::Retire {
                    login: other.to_string(),
                }),
            },
            _ => {}
        }
    }
    (retire, working)
}

/// Runs the plan's steps in order on the admin's session; `roles` as [`plan`] read them.
/// `confirm` runs before each change on the server.
pub async fn apply<F, Fut>(
    session: &mut Session,
    plan: &Plan,
    roles: &[RoleState],
    shape: Shape<'_>,
    confirm: F,
) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let role = |name: &str| roles.iter().find(|r| r.name == name);
    if let Some(why) = &plan.rotating {
        let previous = plan
            .logins
            .previous
            .as_ref()
            .map(|(login, _)| login.as_str());
        tracing::info!(login = %plan.logins.login, previous, why, "rotating the password");
    }
    for step in &plan.steps {
        confirm().await?;
        match step {
            Step::Expire { login, until } => {
                sql::keep_until(session, login, &rotation::rfc3339(*until)).await?
            }
            Step::Activate { login } => {
                let want = shape.of(login);
                sql::activate(session, &want, role(login), &plan.logins.password).await?
            }
            Step::Repair { login } => {
                if let Some(have) = role(login) {
                    sql::repair(session, &shape.of(login), have).await?
                }
            }
            Step::Retire { login } => {
                sql::retire(session, login).await?;
                tracing::info!(login, "the previous login retired");
            }
            Step::Restore {
                login,
                until,
                verifier,
                outside,
            } => {
                let want = (!outside).then(|| shape.of(login));
                let until = rotation::rfc3339(*until);
                sql::restore(
                    session,
                    login,
                    want.as_ref(),
                    role(login),
                    &verifier.0,
                    &until,
                )
                .await?;
                tracing::info!(login, until, "the previous login set up here until its end");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: f64 = 2_000_000_000.0;

    fn pair() -> [String; 2] {
        ["u_1".to_string(), "u_2".to_string()]
    }

    fn login(name: &str, can_login: bool, valid_until: Option<f64>) -> RoleState {
        RoleState {
            name: name.into(),
            comment: Some("m".into()),
            can_login,
            connection_limit: 5,
            valid_until,
            settings: Vec::new(),
            in_group: true,
        }
    }

    const SHAPE: Shape<'static> = Shape {
        group: "u",
        mark: "m",
        connection_limit: 5,
        settings: &[],
    };

    struct Case {
        pair: [String; 2],
        outside: Option<(&'static str, &'static str)>,
        kept: Option<Kept>,
        status_login: Option<&'static str>,
        annotations: BTreeMap<String, String>,
        rotation: Option<PasswordRotation>,
        last_rotation: Option<Time>,
        rotate_request: Option<String>,
        every_new_password_counts: bool,
        carried: Option<Carried>,
        roles: Vec<RoleState>,
    }

    impl Case {
        fn user() -> Self {
            Case {
                pair: pair(),
                outside: None,
                kept: None,
                status_login: None,
                annotations: BTreeMap::new(),
                rotation: None,
                last_rotation: None,
                rotate_request: None,
                every_new_password_counts: true,
                carried: None,
                roles: Vec::new(),
            }
        }

        fn kept(mut self, login: &str) -> Self {
            self.kept = Some(Kept {
                login: login.into(),
                password: "kept".into(),
            });
            self
        }

        fn plan(&self) -> Plan {
            plan(
                &Inputs {
                    pair: &self.pair,
                    outside: self.outside,
                    kept: self.kept.as_ref(),
                    status_login: self.status_login,
                    annotations: &self.annotations,
                    rotation: self.rotation.as_ref(),
                    last_rotation: self.last_rotation.as_ref(),
                    rotate_request: self.rotate_request.as_ref(),
                    every_new_password_counts: self.every_new_password_counts,
                    carried: self.carried.as_ref(),
                    roles: &self.roles,
                    now: NOW,
                },
                SHAPE,
                || "new".to_string(),
            )
        }
    }

    fn asked(value: &str) -> BTreeMap<String, String> {
        [(ROTATE.to_string(), value.to_string())].into()
    }

    #[test]
    fn a_new_user_starts_on_its_first_login() {
        let p = Case::user().plan();
        assert_eq!(p.logins.login, "u_1");
        assert_eq!(p.logins.password, "new");
        assert_eq!(
            p.steps,
            [Step::Activate {
                login: "u_1".into()
            }]
        );
        assert!(
            p.logins.last_rotation.is_some(),
            "a new password is a change"
        );
        assert_eq!(p.rotating, None);
    }

    #[test]
    fn a_kept_login_in_order_needs_nothing() {
        let mut c = Case::user().kept("u_2");
        c.roles = vec![login("u_2", true, None), login("u_1", false, None)];
        let p = c.plan();
        assert_eq!(
            (p.logins.login.as_str(), p.logins.password.as_str()),
            ("u_2", "kept")
        );
        assert!(p.steps.is_empty(), "{:?}", p.steps);
        assert_eq!(p.logins.last_rotation, None);
        assert_eq!(p.logins.next, None);
    }

    #[test]
    fn a_drifted_login_is_repaired_and_an_expiring_one_activated() {
        let mut c = Case::user().kept("u_1");
        let mut drifted = login("u_1", true, None);
        drifted.connection_limit = 9;
        c.roles = vec![drifted];
        assert_eq!(
            c.plan().steps,
            [Step::Repair {
                login: "u_1".into()
            }]
        );
        c.roles = vec![login("u_1", true, Some(NOW + 60.0))];
        assert_eq!(
            c.plan().steps,
            [Step::Activate {
                login: "u_1".into()
            }]
        );
    }

    #[test]
    fn a_rotation_expires_the_previous_login_before_activating_the_other() {
        let mut c = Case::user().kept("u_1");
        c.annotations = asked("1");
        c.rotation = Some(PasswordRotation {
            every: None,
            keep_previous: "10s".into(),
        });
        c.roles = vec![
            login("u_1", true, None),
            login("u_2", false, Some(NOW - 5.0)),
        ];
        let p = c.plan();
        assert!(p.rotating.is_some());
        assert_eq!(
            (p.logins.login.as_str(), p.logins.password.as_str()),
            ("u_2", "new")
        );
        assert_eq!(
            p.steps,
            [
                Step::Expire {
                    login: "u_1".into(),
                    until: NOW + 10.0
                },
                Step::Activate {
                    login: "u_2".into()
                },
            ]
        );
        assert_eq!(p.logins.previous, Some(("u_1".into(), NOW + 10.0)));
        assert_eq!(p.logins.rotate_request.as_deref(), Some("1"));
        assert!(p.logins.last_rotation.is_some());
        assert_eq!(p.logins.next, Some(Duration::from_secs(11)));
        // Acted on: the same annotation value does not rotate again.
        c.rotate_request = Some("1".into());
        assert!(c.plan().rotating.is_none());
    }

    #[test]
    fn the_previous_login_works_until_its_expiry_then_retires() {
        let mut c = Case::user().kept("u_2");
        c.rotate_request = Some("1".into());
        c.annotations = asked("1");
        c.roles = vec![
            login("u_2", true, None),
            login("u_1", true, Some(NOW + 30.0)),
        ];
        let p = c.plan();
        assert!(p.steps.is_empty());
        assert_eq!(p.logins.previous, Some(("u_1".into(), NOW + 30.0)));
        assert_eq!(p.logins.next, Some(Duration::from_secs(31)));
        c.roles[1].valid_until = Some(NOW - 1.0);
        let p = c.plan();
        assert_eq!(
            p.steps,
            [Step::Retire {
                login: "u_1".into()
            }]
        );
        assert_eq!(p.retired().collect::<Vec<_>>(), ["u_1"]);
        assert_eq!(p.logins.previous, None);
        // Without expiry and not in use (a crash after the Secret moved): retired too.
        c.roles[1].valid_until = None;
        assert_eq!(
            c.plan().steps,
            [Step::Retire {
                login: "u_1".into()
            }]
        );
    }

    fn carried(login: &str, until: f64) -> Carried {
        Carried {
            login: login.into(),
            until,
            verifier: Verifier(dbops_shared::postgres::password_verifier(login, "kept")),
        }
    }

    /// A rotation carries the login given up with the verifier of the password the
    /// Secret held, and its end.
    #[test]
    fn a_rotation_carries_the_verifier_of_the_login_given_up() {
        let mut c = Case::user().kept("u_1");
        c.annotations = asked("1");
        c.roles = vec![login("u_1", true, None)];
        let p = c.plan();
        assert_eq!(p.logins.login, "u_2");
        assert_eq!(p.logins.carried, Some(carried("u_1", NOW + 3600.0)));
        // Later checks keep what the Secret carries while the login works here.
        let mut later = Case::user().kept("u_2");
        later.rotate_request = Some("1".into());
        later.annotations = asked("1");
        later.carried = Some(carried("u_1", NOW + 30.0));
        later.roles = vec![
            login("u_2", true, None),
            login("u_1", true, Some(NOW + 30.0)),
        ];
        let p = later.plan();
        assert!(p.steps.is_empty());
        assert_eq!(p.logins.carried, later.carried);
    }

    /// Where the Database moved (a Migration), the previous login is missing, or (the owner
    /// role, which the Migration made) there without its expiry: it is set up with its
    /// verifier until its end, not retired. Once its end has passed it is not.
    #[test]
    fn the_carried_previous_login_is_set_up_where_the_database_moved() {
        let mut c = Case::user().kept("u_2");
        c.rotate_request = Some("1".into());
        c.annotations = asked("1");
        c.carried = Some(carried("u_1", NOW + 30.0));
        c.roles = vec![login("u_2", true, None)];
        let p = c.plan();
        assert_eq!(
            p.steps,
            [Step::Restore {
                login: "u_1".into(),
                until: NOW + 30.0,
                verifier: carried("u_1", 0.0).verifier,
                outside: false,
            }]
        );
        assert_eq!(p.logins.previous, Some(("u_1".into(), NOW + 30.0)));
        assert_eq!(p.logins.carried, c.carried);
        // The owner outside the pair: there, without expiry.
        let mut o = Case::user();
        o.pair = ["o_1".to_string(), "o_2".to_string()];
        o.outside = Some(("o", "owner-password"));
        o.every_new_password_counts = false;
        o.kept = Some(Kept {
            login: "o_1".into(),
            password: "kept".into(),
        });
        o.rotate_request = Some("1".into());
        o.annotations = asked("1");
        o.carried = Some(carried("o", NOW + 30.0));
        o.roles = vec![login("o", true, None), login("o_1", true, None)];
        let steps = o.plan().steps;
        assert!(
            matches!(&steps[..], [Step::Restore { login, outside: true, .. }] if login == "o"),
            "{steps:?}"
        );
        // Its end passed: nothing to set up; a login there without expiry is retired.
        c.carried = Some(carried("u_1", NOW - 1.0));
        assert!(c.plan().steps.is_empty());
        c.roles.push(login("u_1", true, None));
        assert_eq!(
            c.plan().steps,
            [Step::Retire {
                login: "u_1".into()
            }]
        );
    }

    #[test]
    fn the_carried_login_reads_back_from_its_annotation() {
        let c = carried("orders-1", 2_000_000_000.0);
        assert_eq!(
            Carried::from_annotation(&c.to_annotation()),
            Some(c.clone())
        );
        assert!(!format!("{c:?}").contains("SCRAM"), "{c:?}");
        for bad in [
            "",
            "orders-1 x SCRAM-SHA-256$a",
            "orders-1 1 plain",
            "a 1 SCRAM-SHA-256$x y",
        ] {
            assert_eq!(Carried::from_annotation(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_lost_secret_gives_the_login_the_status_names_a_new_password() {
        let mut c = Case::user();
        c.status_login = Some("u_2");
        c.last_rotation = Some(Time(jiff::Timestamp::from_second(1).unwrap()));
        c.roles = vec![login("u_2", true, None)];
        let p = c.plan();
        assert_eq!(
            (p.logins.login.as_str(), p.logins.password.as_str()),
            ("u_2", "new")
        );
        assert_eq!(
            p.steps,
            [Step::Activate {
                login: "u_2".into()
            }]
        );
        assert_ne!(
            p.logins.last_rotation, c.last_rotation,
            "a user's new password counts"
        );
        // A Secret naming a login outside the turn is not kept.
        c.kept = Some(Kept {
            login: "someone".into(),
            password: "x".into(),
        });
        assert_eq!(c.plan().logins.login, "u_2");
    }

    #[test]
    fn the_owner_starts_outside_the_pair_and_retires_it_after_the_first_rotation() {
        let mut c = Case::user();
        c.pair = ["o_1".to_string(), "o_2".to_string()];
        c.outside = Some(("o", "owner-password"));
        c.every_new_password_counts = false;
        c.roles = vec![login("o", true, None)];
        // Never rotated: the owner itself, its password the caller's; nothing to do here.
        let p = c.plan();
        assert_eq!(
            (p.logins.login.as_str(), p.logins.password.as_str()),
            ("o", "owner-password")
        );
        assert!(p.steps.is_empty());
        assert!(
            p.logins.last_rotation.is_some(),
            "the first password counts"
        );
        // A later new owner password does not restart `every`.
        let last = Time(jiff::Timestamp::from_second(1).unwrap());
        c.last_rotation = Some(last.clone());
        assert_eq!(c.plan().logins.last_rotation, Some(last));
        // The first rotation: from the owner to its first login.
        c.kept = Some(Kept {
            login: "o".into(),
            password: "owner-password".into(),
        });
        c.annotations = asked("1");
        let p = c.plan();
        assert_eq!(p.logins.login, "o_1");
        assert_eq!(
            p.steps,
            [
                Step::Expire {
                    login: "o".into(),
                    until: NOW + 3600.0
                },
                Step::Activate {
                    login: "o_1".into()
                },
            ]
        );
        // Its time up, the owner's own login retires.
        c = Case {
            kept: Some(Kept {
                login: "o_1".into(),
                password: "p".into(),
            }),
            rotate_request: Some("1".into()),
            roles: vec![login("o", true, Some(NOW - 1.0)), login("o_1", true, None)],
            ..c
        };
        let p = c.plan();
        assert_eq!(p.steps, [Step::Retire { login: "o".into() }]);
    }
}
