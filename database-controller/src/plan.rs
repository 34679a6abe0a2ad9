//! What provisioning does in PostgreSQL, decided without doing it: a pure function from
//! the Database and what was observed (its role and database on the server, the password
//! its connection Secret still holds) to the changes that bring the server to the spec,
//! or the reason nothing may be done. `provision::provision_in_postgres` observes, asks
//! [`plan`], applies the changes in order, then writes the Secret; the status follows from
//! the outcome (`status`).
//!
//! The rules, each a test below:
//! - a role or database of that name not marked as this Database's is a `NameConflict`,
//!   and nothing is done; a database created `OWNER` the marked role whose own mark a
//!   crash prevented is ours, and is marked now;
//! - a database once provisioned (`status.providerId`) and now gone is `DatabaseMissing`:
//!   never created again;
//! - the role is created with a new password, or given one when the Secret no longer
//!   holds the password written (or it arrives on a server by a Migration's switch);
//! - owner and connection limit are repaired (a Migration's freeze of the limit is not
//!   drift);
//! - a database for `spec.restoreFrom` carries "restore pending" until it is filled, and
//!   one found pending (or unmarked) is filled again from an empty database.

use dbops_api::reasons::DatabaseReason;
use dbops_shared::postgres::ddl::Observed;

use crate::error::Error;
use crate::sql;

/// What the plan needs besides the observation.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub uid: &'a str,
    pub role: &'a str,
    pub database: &'a str,
    /// `host:port`, for messages.
    pub server: &'a str,
    pub connection_limit: i32,
    pub restore_from: bool,
    /// The status records a provisioning on this server (`providerId`).
    pub provisioned_before: bool,
    /// A Migration's switch just moved the Database here.
    pub arriving: bool,
    pub migration_active: bool,
    /// The Secret still holds the password this controller wrote.
    pub password_kept: bool,
}

/// One change on the server, in the order of [`Plan::changes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Create the role, marked, with the password.
    CreateRole,
    /// Give the existing role the password.
    SetPassword,
    /// Create the database owned by the role, closed to PUBLIC, with this mark and
    /// connection limit.
    CreateDatabase {
        mark: String,
        connection_limit: i32,
    },
    /// Mark a database created before a crash (and close it to PUBLIC).
    MarkDatabase {
        mark: String,
    },
    SetOwner,
    SetConnectionLimit(i32),
    /// Fill the database from `spec.restoreFrom`; `fresh` when it was just created.
    Restore {
        fresh: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub changes: Vec<Change>,
    /// A new password is needed (the Secret does not hold the one written).
    pub new_password: bool,
}

/// The changes that bring the server to the spec, or why none may be taken.
pub fn plan(i: &Inputs<'_>, observed: &Observed) -> Result<Plan, Error> {
    if observed.role.is_some() && !observed.role_is_ours(i.uid) {
        return Err(conflict("role", i.role, i.server));
    }
    // Ours also when created OWNER our marked role and a crash came before its own mark.
    if observed.database.is_some() && !observed.database_is_ours(i.uid, i.role) {
        return Err(conflict("database", i.database, i.server));
    }
    if observed.database.is_none() && i.provisioned_before {
        return Err(Error::Reported {
            reason: DatabaseReason::DatabaseMissing.into(),
            message: format!(
                "database {:?} was created on {} but no longer exists; it is not re-created: restore it or delete this Database",
                i.database, i.server
            ),
        });
    }

    let mut changes = Vec::new();
    if observed.role.is_none() {
        changes.push(Change::CreateRole);
    } else if !i.password_kept || i.arriving {
        // Arriving on a server (a Migration's switch) the role exists with a password
        // nobody knows: it gets the Secret's, once.
        changes.push(Change::SetPassword);
    }

    let mark = if i.restore_from {
        sql::restore_pending_mark(i.uid)
    } else {
        sql::mark(i.uid)
    };
    match &observed.database {
        None => changes.push(Change::CreateDatabase {
            mark,
            connection_limit: i.connection_limit,
        }),
        Some(found) => {
            if found.comment.is_none() {
                changes.push(Change::MarkDatabase { mark });
            }
            if found.owner != i.role {
                changes.push(Change::SetOwner);
            }
            // A Migration freezes the source with its own connection limit: not drift.
            if found.connection_limit != i.connection_limit && !i.migration_active {
                changes.push(Change::SetConnectionLimit(i.connection_limit));
            }
        }
    }
    let restore_pending = i.restore_from
        && observed
            .database
            .as_ref()
            .is_none_or(|d| d.comment.is_none() || sql::is_restore_pending(d.comment.as_deref()));
    if restore_pending {
        changes.push(Change::Restore {
            fresh: observed.database.is_none(),
        });
    }
    Ok(Plan {
        changes,
        new_password: !i.password_kept,
    })
}

/// The extensions of the spec not installed yet, in the spec's order.
pub fn missing_extensions<'a>(wanted: &'a [String], installed: &[String]) -> Vec<&'a String> {
    wanted.iter().filter(|e| !installed.contains(e)).collect()
}

fn conflict(what: &str, name: &str, server: &str) -> Error {
    Error::Reported {
        reason: DatabaseReason::NameConflict.into(),
        message: format!(
            "{what} {name:?} already exists on {server} and was not created by this Database; nothing was changed"
        ),
    }
}

#[cfg(test)]
mod tests {
    use dbops_shared::postgres::ddl::{DatabaseInfo, RoleInfo};

    use super::*;

    const UID: &str = "uid-1";

    fn inputs() -> Inputs<'static> {
        Inputs {
            uid: UID,
            role: "orders_owner",
            database: "orders",
            server: "pg:5432",
            connection_limit: -1,
            restore_from: false,
            provisioned_before: false,
            arriving: false,
            migration_active: false,
            password_kept: true,
        }
    }

    fn observed(role: Option<Option<String>>, database: Option<DatabaseInfo>) -> Observed {
        Observed {
            server_version: "15".into(),
            role: role.map(|comment| RoleInfo { comment }),
            database,
        }
    }

    fn ours() -> Option<Option<String>> {
        Some(Some(sql::mark(UID)))
    }

    fn database(comment: Option<String>) -> DatabaseInfo {
        DatabaseInfo {
            oid: 16384,
            owner: "orders_owner".into(),
            connection_limit: -1,
            comment,
        }
    }

    fn reason(r: Result<Plan, Error>) -> &'static str {
        match r {
            Err(Error::Reported { reason, .. }) => reason.as_str(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_new_database_gets_a_role_a_database_and_a_password() {
        let p = plan(
            &Inputs {
                password_kept: false,
                ..inputs()
            },
            &observed(None, None),
        )
        .unwrap();
        assert_eq!(
            p.changes,
            [
                Change::CreateRole,
                Change::CreateDatabase {
                    mark: sql::mark(UID),
                    connection_limit: -1,
                }
            ]
        );
        assert!(p.new_password);
    }

    #[test]
    fn a_converged_database_needs_nothing() {
        let p = plan(
            &inputs(),
            &observed(ours(), Some(database(Some(sql::mark(UID))))),
        )
        .unwrap();
        assert_eq!(p.changes, []);
        assert!(!p.new_password);
    }

    #[test]
    fn what_another_made_is_never_touched() {
        let theirs = Some(Some("someone else's".to_string()));
        assert_eq!(
            reason(plan(&inputs(), &observed(theirs, None))),
            "NameConflict"
        );
        assert_eq!(
            reason(plan(&inputs(), &observed(Some(None), None))),
            "NameConflict"
        );
        // A database owned by someone else, unmarked: not ours either.
        let mut other = database(None);
        other.owner = "app".into();
        assert_eq!(
            reason(plan(&inputs(), &observed(ours(), Some(other)))),
            "NameConflict"
        );
    }

    #[test]
    fn a_crash_before_the_mark_is_finished_not_refused() {
        let p = plan(&inputs(), &observed(ours(), Some(database(None)))).unwrap();
        assert_eq!(
            p.changes,
            [Change::MarkDatabase {
                mark: sql::mark(UID)
            }]
        );
    }

    #[test]
    fn a_vanished_database_is_reported_not_recreated() {
        let i = Inputs {
            provisioned_before: true,
            ..inputs()
        };
        assert_eq!(reason(plan(&i, &observed(ours(), None))), "DatabaseMissing");
    }

    #[test]
    fn a_lost_password_or_an_arrival_sets_the_password() {
        let there = observed(ours(), Some(database(Some(sql::mark(UID)))));
        for i in [
            Inputs {
                password_kept: false,
                ..inputs()
            },
            Inputs {
                arriving: true,
                ..inputs()
            },
        ] {
            assert_eq!(plan(&i, &there).unwrap().changes, [Change::SetPassword]);
        }
    }

    #[test]
    fn drift_is_repaired_but_a_migrations_freeze_is_not_drift() {
        let mut drifted = database(Some(sql::mark(UID)));
        drifted.owner = "postgres".into();
        drifted.connection_limit = 0;
        let p = plan(&inputs(), &observed(ours(), Some(drifted.clone()))).unwrap();
        assert_eq!(
            p.changes,
            [Change::SetOwner, Change::SetConnectionLimit(-1)]
        );
        let frozen = Inputs {
            migration_active: true,
            ..inputs()
        };
        let p = plan(&frozen, &observed(ours(), Some(drifted))).unwrap();
        assert_eq!(p.changes, [Change::SetOwner]);
    }

    #[test]
    fn a_restore_fills_a_new_or_pending_database_once() {
        let i = Inputs {
            restore_from: true,
            ..inputs()
        };
        let pending = sql::restore_pending_mark(UID);
        let p = plan(&i, &observed(None, None)).unwrap();
        assert_eq!(
            p.changes,
            [
                Change::CreateRole,
                Change::CreateDatabase {
                    mark: pending.clone(),
                    connection_limit: -1,
                },
                Change::Restore { fresh: true }
            ]
        );
        let half = plan(&i, &observed(ours(), Some(database(Some(pending))))).unwrap();
        assert_eq!(half.changes, [Change::Restore { fresh: false }]);
        let done = plan(&i, &observed(ours(), Some(database(Some(sql::mark(UID)))))).unwrap();
        assert_eq!(done.changes, []);
    }

    #[test]
    fn only_missing_extensions_are_created() {
        let wanted = vec!["pgcrypto".to_string(), "citext".to_string()];
        assert_eq!(
            missing_extensions(&wanted, &["citext".to_string()]),
            [&"pgcrypto".to_string()]
        );
    }
}
