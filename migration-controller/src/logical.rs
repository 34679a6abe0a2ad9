//! The Logical mode's Preflight: whether the source server and database can be moved by
//! logical replication, and which mode `Auto` picks (called by the Preflight step).
//!
//! Checked on the source, with an admin session connected to the source database:
//!
//! | reason | refused when |
//! |---|---|
//! | `LogicalUnsafeBefore16` | the target runs PostgreSQL older than 16 (checked on the target) |
//! | `WalLevelNotLogical` | `wal_level` is not `logical` |
//! | `NoFreeReplicationSlot` | `max_replication_slots` minus the slots in `pg_replication_slots` is 0 |
//! | `NoFreeWalSender` | `max_wal_senders` minus the running `walsender` backends is 0 |
//! | `TablesWithoutReplicaIdentity` | an ordinary table outside the system schemas, not an extension's, has no usable replica identity (listed, schema-qualified) |
//! | `LargeObjectsPresent` | `pg_largeobject_metadata` is not empty (logical replication does not copy large objects) |
//! | `AdminLacksPrivilege` | the source's admin may not replicate (no `REPLICATION`), or the target's may not `CREATE SUBSCRIPTION` (neither a superuser nor, on 16+, a member of `pg_create_subscription`) |
//!
//! A table's replica identity is usable when it is `FULL`, `DEFAULT` with a primary key,
//! or `USING INDEX` with its index still there; `NOTHING` is not, primary key or not
//! (its UPDATEs and DELETEs would fail on the source once published).
//!
//! Every check runs and every failure is reported ([`unmet`]): the user fixes all of them
//! at once. The reading ([`observe`]) is separate from the verdict ([`unmet`], pure), so
//! the verdict is tested without a server.
//!
//! This file is also compiled into the e2e test binary (`#[path]` in
//! `e2e/tests/e2e/migration/preflight.rs`, the controller having no library target): it
//! uses nothing of this crate, only `dbops_api` and `dbops_shared`.

use std::fmt;

use dbops_api::MigrationReason;
use dbops_shared::postgres::ddl::{Capability, Has};
use dbops_shared::postgres::{PgError, Session};

/// Table names a message lists before it says "and N more" (a condition message must stay
/// readable; [`Unmet::TablesWithoutReplicaIdentity`] keeps them all).
const LISTED_TABLES: usize = 20;

/// What the checks read on the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFacts {
    pub wal_level: String,
    pub max_replication_slots: i64,
    /// Rows of `pg_replication_slots` (physical and logical, active or not: each holds one).
    pub replication_slots: i64,
    pub max_wal_senders: i64,
    /// Backends of type `walsender` now (streaming replicas, base backups, subscribers).
    pub wal_senders: i64,
    /// The ordinary tables of the database, sorted by schema and name.
    pub tables: Vec<TableIdentity>,
    /// Rows of `pg_largeobject_metadata`.
    pub large_objects: i64,
    /// What the two admins may do that the Logical mode needs.
    pub admins: AdminRights,
}

/// The rights of the admins the Logical mode needs besides creating roles and databases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdminRights {
    /// The source's admin may replicate (`REPLICATION`, or a superuser): the subscription
    /// logs in as a replication role it makes, or as itself.
    pub source_replication: bool,
    /// The target's admin may `CREATE SUBSCRIPTION` (a superuser, or from PostgreSQL 16 a
    /// member of `pg_create_subscription`).
    pub target_subscription: bool,
}

/// One table and what its replica identity rests on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableIdentity {
    /// Schema-qualified, each part quoted only where SQL needs it (`format('%I.%I')`).
    pub name: String,
    /// `pg_class.relreplident`: `d` (default: the primary key), `n` (nothing), `f` (full),
    /// `i` (the index marked `indisreplident`).
    pub replica_identity: char,
    pub has_primary_key: bool,
    /// An index of the table is marked as its replica identity (`USING INDEX`).
    pub has_identity_index: bool,
}

impl TableIdentity {
    /// Whether its UPDATEs and DELETEs can be published.
    pub fn replicable(&self) -> bool {
        match self.replica_identity {
            'f' => true,
            'd' => self.has_primary_key,
            // A dropped identity index leaves `i` behind, which then acts as NOTHING.
            'i' => self.has_identity_index,
            _ => false,
        }
    }
}

/// The oldest target (`server_version_num`) a subscription is made on: 16, the first
/// major whose logical replication applies changes as each table's owner
/// (`run_as_owner = false`). Before it, the apply and the initial copy run as the
/// subscription's owner, which must be a superuser (15 refuses any other owner), so a
/// tenant's trigger, index expression, check constraint or column default would run with
/// the admin's privileges on the target.
pub const MIN_SAFE_TARGET: i32 = 160000;

/// A prerequisite of the Logical mode the source or target does not meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unmet {
    /// The target is older than 16 ([`MIN_SAFE_TARGET`]).
    LogicalUnsafeBefore16 {
        target_version: String,
    },
    WalLevelNotLogical {
        wal_level: String,
    },
    NoFreeReplicationSlot {
        max: i64,
        in_use: i64,
    },
    NoFreeWalSender {
        max: i64,
        active: i64,
    },
    /// Every such table, schema-qualified, sorted.
    TablesWithoutReplicaIdentity {
        tables: Vec<String>,
    },
    LargeObjectsPresent {
        count: i64,
    },
    /// An admin lacks a right (on `server`, "source" or "target"): `needs` says which.
    AdminLacksPrivilege {
        server: &'static str,
        needs: &'static str,
    },
}

impl Unmet {
    /// The condition reason, one per check.
    pub fn reason(&self) -> MigrationReason {
        match self {
            Unmet::LogicalUnsafeBefore16 { .. } => MigrationReason::LogicalUnsafeBefore16,
            Unmet::WalLevelNotLogical { .. } => MigrationReason::WalLevelNotLogical,
            Unmet::NoFreeReplicationSlot { .. } => MigrationReason::NoFreeReplicationSlot,
            Unmet::NoFreeWalSender { .. } => MigrationReason::NoFreeWalSender,
            Unmet::TablesWithoutReplicaIdentity { .. } => {
                MigrationReason::TablesWithoutReplicaIdentity
            }
            Unmet::LargeObjectsPresent { .. } => MigrationReason::LargeObjectsPresent,
            Unmet::AdminLacksPrivilege { .. } => MigrationReason::AdminLacksPrivilege,
        }
    }

    /// What is wrong and what to change on the source.
    pub fn message(&self) -> String {
        match self {
            Unmet::LogicalUnsafeBefore16 { target_version } => format!(
                "the target server runs PostgreSQL {target_version}: before 16, logical \
                 replication applies every change as the subscription's owner, a superuser, \
                 so the database's triggers, index expressions, check constraints and \
                 defaults would run with the admin's privileges there; migrate with mode \
                 Dump (restored as the database's owner) or to a server of PostgreSQL 16 or \
                 newer (which applies as each table's owner)"
            ),
            Unmet::WalLevelNotLogical { wal_level } => format!(
                "wal_level is {wal_level} on the source server, logical replication needs \
                 logical: run ALTER SYSTEM SET wal_level = logical and restart the server"
            ),
            Unmet::NoFreeReplicationSlot { max, in_use } => format!(
                "no free replication slot on the source server ({in_use} in use of \
                 max_replication_slots = {max}): drop an unused one with \
                 pg_drop_replication_slot, or run ALTER SYSTEM SET max_replication_slots = \
                 {} and restart the server",
                (*max).max(*in_use) + 1
            ),
            Unmet::NoFreeWalSender { max, active } => format!(
                "no free WAL sender on the source server ({active} active of \
                 max_wal_senders = {max}): end a replication client, or run ALTER SYSTEM \
                 SET max_wal_senders = {} and restart the server",
                (*max).max(*active) + 1
            ),
            Unmet::TablesWithoutReplicaIdentity { tables } => {
                let mut listed = tables
                    .iter()
                    .take(LISTED_TABLES)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ");
                if tables.len() > LISTED_TABLES {
                    listed.push_str(&format!(" and {} more", tables.len() - LISTED_TABLES));
                }
                format!(
                    "{} without a primary key or a usable replica identity, whose UPDATEs \
                     and DELETEs cannot be replicated: {listed}; add a primary key, or run \
                     ALTER TABLE <table> REPLICA IDENTITY FULL (or USING INDEX <a unique \
                     index on NOT NULL columns>)",
                    plural(tables.len() as i64, "table", "tables")
                )
            }
            Unmet::LargeObjectsPresent { count } => format!(
                "the source database holds {}, which logical replication does not copy: \
                 store them in bytea columns and remove them with lo_unlink, or migrate \
                 with mode Dump",
                plural(*count, "large object", "large objects")
            ),
            Unmet::AdminLacksPrivilege { server, needs } => format!(
                "the {server} server's admin (its DatabaseServer's adminSecretRef) lacks \
                 {needs}, which logical replication needs there (status.capabilities of the \
                 DatabaseServer says what it has): grant it (docs/operations.md, Managed \
                 PostgreSQL), or migrate with mode Dump"
            ),
        }
    }
}

impl fmt::Display for Unmet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason(), self.message())
    }
}

fn plural(n: i64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The target's prerequisite ([`MIN_SAFE_TARGET`]), unmet by a server older than 16.
pub fn unsafe_target(target_version_num: i32, target_version: &str) -> Option<Unmet> {
    (target_version_num < MIN_SAFE_TARGET).then(|| Unmet::LogicalUnsafeBefore16 {
        target_version: target_version.to_string(),
    })
}

/// Every prerequisite the source (`facts`) and the target (`target_version_num`,
/// `target_version`) do not meet, in the order of the table above; empty when the Logical
/// mode can run.
pub fn unmet(facts: &SourceFacts, target_version_num: i32, target_version: &str) -> Vec<Unmet> {
    let mut unmet = Vec::new();
    unmet.extend(unsafe_target(target_version_num, target_version));
    if facts.wal_level != "logical" {
        unmet.push(Unmet::WalLevelNotLogical {
            wal_level: facts.wal_level.clone(),
        });
    }
    if facts.max_replication_slots - facts.replication_slots <= 0 {
        unmet.push(Unmet::NoFreeReplicationSlot {
            max: facts.max_replication_slots,
            in_use: facts.replication_slots,
        });
    }
    if facts.max_wal_senders - facts.wal_senders <= 0 {
        unmet.push(Unmet::NoFreeWalSender {
            max: facts.max_wal_senders,
            active: facts.wal_senders,
        });
    }
    let tables: Vec<String> = facts
        .tables
        .iter()
        .filter(|t| !t.replicable())
        .map(|t| t.name.clone())
        .collect();
    if !tables.is_empty() {
        unmet.push(Unmet::TablesWithoutReplicaIdentity { tables });
    }
    if facts.large_objects > 0 {
        unmet.push(Unmet::LargeObjectsPresent {
            count: facts.large_objects,
        });
    }
    if !facts.admins.source_replication {
        unmet.push(Unmet::AdminLacksPrivilege {
            server: "source",
            needs: Capability::Replication.grant(),
        });
    }
    if !facts.admins.target_subscription {
        unmet.push(Unmet::AdminLacksPrivilege {
            server: "target",
            needs: Capability::CreateSubscription.grant(),
        });
    }
    unmet
}

/// One condition for all of them: the first reason, and every reason with its message.
/// `None` when nothing is unmet.
pub fn condition(unmet: &[Unmet]) -> Option<(MigrationReason, String)> {
    let first = unmet.first()?;
    let message = unmet
        .iter()
        .map(Unmet::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    Some((first.reason(), message))
}

/// The mode a Migration with `mode: Auto` runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Logical,
    /// Dump and restore, because of these.
    Dump {
        because: Vec<Unmet>,
    },
}

/// `Auto`: Logical when every prerequisite is met, else Dump with the reasons.
pub fn auto_mode(unmet: Vec<Unmet>) -> Mode {
    if unmet.is_empty() {
        Mode::Logical
    } else {
        Mode::Dump { because: unmet }
    }
}

/// Reads the facts from an admin session connected to the source database (no writes);
/// `target_subscription` is what the target's admin may do.
pub async fn observe(s: &Session, target_subscription: bool) -> Result<SourceFacts, PgError> {
    let source = dbops_shared::postgres::ddl::capabilities(s).await?;
    let row = s
        .query_one(
            "SELECT current_setting('wal_level'), \
                    current_setting('max_replication_slots')::bigint, \
                    (SELECT count(*) FROM pg_replication_slots), \
                    current_setting('max_wal_senders')::bigint, \
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'), \
                    (SELECT count(*) FROM pg_largeobject_metadata)",
            &[],
        )
        .await
        .map_err(PgError::sql(
            "reading the replication settings of the source",
        ))?;
    let rows = s
        .query(
            &format!(
                "SELECT format('%I.%I', n.nspname, c.relname), c.relreplident::text, \
                        EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), \
                        EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident) \
                   {} ORDER BY n.nspname, c.relname",
                dbops_shared::postgres::ddl::USER_TABLES
            ),
            &[],
        )
        .await
        .map_err(PgError::sql(
            "reading the replica identities of the source tables",
        ))?;
    let tables = rows
        .iter()
        .map(|r| TableIdentity {
            name: r.get(0),
            replica_identity: r.get::<_, String>(1).chars().next().unwrap_or('n'),
            has_primary_key: r.get(2),
            has_identity_index: r.get(3),
        })
        .collect();
    Ok(SourceFacts {
        wal_level: row.get(0),
        max_replication_slots: row.get(1),
        replication_slots: row.get(2),
        max_wal_senders: row.get(3),
        wal_senders: row.get(4),
        tables,
        large_objects: row.get(5),
        admins: AdminRights {
            source_replication: source.has(Capability::Replication),
            target_subscription,
        },
    })
}

/// [`observe`], then [`unmet`]; `target_subscription`: the target's admin may `CREATE
/// SUBSCRIPTION`.
pub async fn preflight(
    s: &Session,
    target_version_num: i32,
    target_version: &str,
    target_subscription: bool,
) -> Result<Vec<Unmet>, PgError> {
    Ok(unmet(
        &observe(s, target_subscription).await?,
        target_version_num,
        target_version,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str, replica_identity: char, pk: bool, index: bool) -> TableIdentity {
        TableIdentity {
            name: name.into(),
            replica_identity,
            has_primary_key: pk,
            has_identity_index: index,
        }
    }

    fn ready() -> SourceFacts {
        SourceFacts {
            wal_level: "logical".into(),
            max_replication_slots: 10,
            replication_slots: 9,
            max_wal_senders: 10,
            wal_senders: 9,
            tables: vec![table("public.t", 'd', true, false)],
            large_objects: 0,
            admins: AdminRights {
                source_replication: true,
                target_subscription: true,
            },
        }
    }

    #[test]
    fn a_target_before_16_is_unsafe_for_logical_replication_whatever_the_source() {
        let unmet = unmet(&ready(), 150018, "15.18");
        assert_eq!(unmet.len(), 1, "{unmet:?}");
        assert_eq!(unmet[0].reason(), "LogicalUnsafeBefore16");
        assert!(
            unmet[0].message().contains("15.18"),
            "{}",
            unmet[0].message()
        );
        assert!(matches!(auto_mode(unmet), Mode::Dump { .. }));
        assert_eq!(super::unmet(&ready(), 160000, "16.0"), []);
    }

    #[test]
    fn a_ready_source_meets_everything_and_auto_picks_logical() {
        assert_eq!(unmet(&ready(), 170000, "17.0"), []);
        assert_eq!(condition(&[]), None);
        assert_eq!(auto_mode(unmet(&ready(), 170000, "17.0")), Mode::Logical);
    }

    #[test]
    fn an_admin_without_replication_or_subscription_rights_is_named_and_auto_dumps() {
        let mut facts = ready();
        facts.admins.source_replication = false;
        let unmet = unmet(&facts, 170000, "17.0");
        assert_eq!(unmet.len(), 1, "{unmet:?}");
        assert_eq!(unmet[0].reason(), MigrationReason::AdminLacksPrivilege);
        let said = unmet[0].message();
        assert!(
            said.contains("source") && said.contains("REPLICATION"),
            "{said}"
        );
        facts.admins = AdminRights {
            source_replication: true,
            target_subscription: false,
        };
        let unmet = super::unmet(&facts, 170000, "17.0");
        let said = unmet[0].message();
        assert!(
            said.contains("target") && said.contains("pg_create_subscription"),
            "{said}"
        );
        assert!(matches!(auto_mode(unmet), Mode::Dump { .. }));
    }

    #[test]
    fn replica_identities_that_can_be_published() {
        // DEFAULT rests on the primary key; FULL on nothing; USING INDEX on its index.
        assert!(table("a", 'd', true, false).replicable());
        assert!(!table("a", 'd', false, false).replicable());
        assert!(table("a", 'f', false, false).replicable());
        assert!(table("a", 'i', false, true).replicable());
        assert!(!table("a", 'i', true, false).replicable(), "index dropped");
        assert!(!table("a", 'n', true, false).replicable(), "NOTHING");
    }

    #[test]
    fn every_failed_check_is_reported_with_its_own_reason() {
        let facts = SourceFacts {
            wal_level: "replica".into(),
            max_replication_slots: 1,
            replication_slots: 1,
            max_wal_senders: 2,
            wal_senders: 2,
            tables: vec![
                table("public.keyed", 'd', true, false),
                table("public.no_pk", 'd', false, false),
                table("public.full", 'f', false, false),
                table("\"Odd\".nothing", 'n', true, false),
            ],
            large_objects: 3,
            admins: AdminRights {
                source_replication: true,
                target_subscription: true,
            },
        };
        let unmet = unmet(&facts, 170000, "17.0");
        let reasons: Vec<_> = unmet.iter().map(Unmet::reason).collect();
        assert_eq!(
            reasons,
            [
                "WalLevelNotLogical",
                "NoFreeReplicationSlot",
                "NoFreeWalSender",
                "TablesWithoutReplicaIdentity",
                "LargeObjectsPresent"
            ]
        );
        assert_eq!(
            unmet[3],
            Unmet::TablesWithoutReplicaIdentity {
                tables: vec!["public.no_pk".into(), "\"Odd\".nothing".into()]
            }
        );
        let messages: Vec<_> = unmet.iter().map(Unmet::message).collect();
        assert!(messages[0].contains("ALTER SYSTEM SET wal_level = logical and restart"));
        assert!(messages[1].contains("max_replication_slots = 2 and restart"));
        assert!(messages[2].contains("max_wal_senders = 3 and restart"));
        assert!(messages[3].starts_with("2 tables without a primary key"));
        assert!(messages[3].contains(": public.no_pk, \"Odd\".nothing; add a primary key"));
        assert!(messages[4].contains("holds 3 large objects"));

        let (reason, message) = condition(&unmet).unwrap();
        assert_eq!(reason, "WalLevelNotLogical");
        for (r, m) in reasons.iter().zip(&messages) {
            assert!(message.contains(&format!("{r}: {m}")), "{message}");
        }
        assert_eq!(auto_mode(unmet.clone()), Mode::Dump { because: unmet });
    }

    #[test]
    fn slots_and_senders_count_only_when_none_is_free() {
        let mut facts = ready();
        facts.replication_slots = 10;
        assert_eq!(
            unmet(&facts, 170000, "17.0"),
            [Unmet::NoFreeReplicationSlot {
                max: 10,
                in_use: 10
            }]
        );
        let mut facts = ready();
        facts.max_wal_senders = 0;
        facts.wal_senders = 0;
        assert_eq!(
            unmet(&facts, 170000, "17.0"),
            [Unmet::NoFreeWalSender { max: 0, active: 0 }]
        );
        assert!(
            unmet(&facts, 170000, "17.0")[0]
                .message()
                .contains("max_wal_senders = 1 and")
        );
    }

    #[test]
    fn a_long_list_of_tables_is_cut_in_the_message_only() {
        let mut facts = ready();
        facts.tables = (0..25)
            .map(|i| table(&format!("public.t{i:02}"), 'd', false, false))
            .collect();
        let unmet = unmet(&facts, 170000, "17.0");
        let Unmet::TablesWithoutReplicaIdentity { tables } = &unmet[0] else {
            panic!("{unmet:?}");
        };
        assert_eq!(tables.len(), 25);
        let message = unmet[0].message();
        assert!(message.contains("public.t19 and 5 more;"), "{message}");
        assert!(!message.contains("public.t20"), "{message}");
        let one = Unmet::LargeObjectsPresent { count: 1 }.message();
        assert!(one.contains("holds 1 large object,"), "{one}");
    }
}
