//! The privileges of a DatabaseUser's group in its Database's database: observed as one
//! query, granted in one transaction by the Database's owner (`SET LOCAL ROLE <owner>`),
//! on what the owner owns now and, through `ALTER DEFAULT PRIVILEGES FOR ROLE <owner>`,
//! on what it creates later (schemas included when the user covers every schema).

use dbops_api::Access;
use dbops_api::names::comment::GRANT_LOCK_PREFIX;
use dbops_shared::postgres::{PgError, Session, quote_ident, quote_literal};

use crate::role_sql::in_transaction;

/// The privileges of `access` on tables (and views) and on sequences, sorted as
/// `aclexplode` names them.
pub fn privileges(access: Access) -> (&'static [&'static str], &'static [&'static str]) {
    match access {
        Access::ReadOnly => (&["SELECT"], &["SELECT"]),
        Access::ReadWrite => (
            &["DELETE", "INSERT", "SELECT", "UPDATE"],
            &["SELECT", "UPDATE", "USAGE"],
        ),
    }
}

/// The schemas a user covers: the listed ones (those that exist), or every schema but
/// PostgreSQL's own; of them, only those the owner owns (or `public`) get grants, since
/// only those are the owner's to give.
const SCOPE: &str = "\
    WITH o AS (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $1), \
         g AS (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $2), \
         s AS (SELECT n.oid, n.nspname::text AS name FROM pg_catalog.pg_namespace n, o \
                WHERE n.nspname !~ '^pg_' AND n.nspname <> 'information_schema' \
                  AND (pg_catalog.cardinality($3::text[]) = 0 OR n.nspname = ANY($3::text[])) \
                  AND (n.nspowner = o.oid OR n.nspname = 'public'))";

/// Whether the user's privileges in the database are exactly those of `access` over its
/// schemas, now and by default; `missing` lists schemas the spec names that do not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grants {
    pub converged: bool,
    pub missing_schemas: Vec<String>,
    /// The schemas in scope (for the grants).
    pub schemas: Vec<String>,
    /// Default ACL entries for the group: `(schema or "", object type)`.
    pub defaults: Vec<(String, String)>,
    /// Everyone may create in schema `public` (PostgreSQL before 15): a ReadWrite user
    /// could make tables there, so CREATE goes to the owner alone. Only when the admin may
    /// change `public`'s privileges (a superuser, or a member of its owner): before 15 it
    /// belongs to the bootstrap superuser, whom a managed service's admin is not.
    pub public_create: bool,
}

/// The query of [`observe_grants`]: `$1` owner, `$2` group, `$3` schemas, `$4`/`$5` the
/// privileges wanted on tables and sequences, `$6` the database.
fn grants_query() -> String {
    format!(
        "{SCOPE}, \
         rel AS (SELECT c.relkind, COALESCE((SELECT pg_catalog.array_agg(a.privilege_type::text ORDER BY a.privilege_type) \
                         FROM pg_catalog.aclexplode(c.relacl) a, g WHERE a.grantee = g.oid), '{{}}') AS privs \
                   FROM pg_catalog.pg_class c JOIN s ON c.relnamespace = s.oid, o \
                  WHERE c.relowner = o.oid AND c.relkind IN ('r','p','v','m','f','S')), \
         def AS (SELECT COALESCE(n.nspname::text, '') AS schema, d.defaclobjtype::text AS kind, \
                        (SELECT pg_catalog.array_agg(a.privilege_type::text ORDER BY a.privilege_type) \
                           FROM pg_catalog.aclexplode(d.defaclacl) a, g WHERE a.grantee = g.oid) AS privs \
                   FROM pg_catalog.pg_default_acl d JOIN o ON d.defaclrole = o.oid \
                   LEFT JOIN pg_catalog.pg_namespace n ON n.oid = d.defaclnamespace) \
         SELECT \
           (SELECT count(*) FROM rel WHERE relkind <> 'S' AND privs <> $4::text[])::int, \
           (SELECT count(*) FROM rel WHERE relkind = 'S' AND privs <> $5::text[])::int, \
           (SELECT count(*) FROM s, g WHERE NOT pg_catalog.has_schema_privilege(g.oid, s.oid, 'USAGE'))::int, \
           (SELECT pg_catalog.has_database_privilege(g.oid, $6, 'CONNECT') FROM g), \
           ARRAY(SELECT name FROM s ORDER BY name), \
           ARRAY(SELECT u FROM pg_catalog.unnest($3::text[]) u \
                  WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace n WHERE n.nspname = u) ORDER BY u), \
           ARRAY(SELECT schema || ':' || kind || ':' || pg_catalog.array_to_string(privs, ',') \
                   FROM def WHERE privs IS NOT NULL ORDER BY 1), \
           EXISTS (SELECT 1 FROM pg_catalog.pg_namespace n, pg_catalog.aclexplode(n.nspacl) a \
                    WHERE n.nspname = 'public' AND a.grantee = 0 AND a.privilege_type = 'CREATE' \
                      AND pg_catalog.pg_has_role(CURRENT_USER, n.nspowner, 'USAGE'))"
    )
}

/// The default ACL entries the group should have, as the query of [`observe_grants`]
/// lists them (`schema:kind:privileges`, sorted): everywhere, or in each schema in scope.
fn defaults_wanted(
    everywhere: bool,
    in_scope: &[String],
    tables: &[&str],
    sequences: &[&str],
) -> Vec<String> {
    let mut wanted: Vec<String> = if everywhere {
        vec![
            format!(":S:{}", sequences.join(",")),
            ":n:USAGE".to_string(),
            format!(":r:{}", tables.join(",")),
        ]
    } else {
        in_scope
            .iter()
            .flat_map(|n| {
                [
                    format!("{n}:S:{}", sequences.join(",")),
                    format!("{n}:r:{}", tables.join(",")),
                ]
            })
            .collect()
    };
    wanted.sort();
    wanted
}

/// Whose privileges, where, and which: the group's in the Database's database, given
/// by its owner, over `schemas` (none: every schema).
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    pub owner: &'a str,
    pub group: &'a str,
    pub database: &'a str,
    pub schemas: &'a [String],
    pub access: Access,
}

/// Observes the group's privileges (a session on the Database's own database).
pub async fn observe_grants(s: &Session, scope: Scope<'_>) -> Result<Grants, PgError> {
    let Scope {
        owner,
        group,
        database,
        schemas,
        access,
    } = scope;
    let (tables, sequences) = privileges(access);
    let tables: Vec<&str> = tables.to_vec();
    let sequences: Vec<&str> = sequences.to_vec();
    let row = s
        .query_one(
            &grants_query(),
            &[&owner, &group, &schemas, &tables, &sequences, &database],
        )
        .await
        .map_err(PgError::sql("reading the user's privileges"))?;
    let wrong_tables: i32 = row.get(0);
    let wrong_sequences: i32 = row.get(1);
    let schemas_without_usage: i32 = row.get(2);
    let connect: Option<bool> = row.get(3);
    let in_scope: Vec<String> = row.get(4);
    let missing: Vec<String> = row.get(5);
    let defaults_found: Vec<String> = row.get(6);
    let public_create: bool = row.get(7);
    let defaults_wanted = defaults_wanted(schemas.is_empty(), &in_scope, &tables, &sequences);
    let defaults = defaults_found
        .iter()
        .filter_map(|d| {
            let mut parts = d.splitn(3, ':');
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    Ok(Grants {
        converged: wrong_tables == 0
            && !public_create
            && wrong_sequences == 0
            && schemas_without_usage == 0
            && connect == Some(true)
            && defaults_found == defaults_wanted,
        missing_schemas: missing,
        schemas: in_scope,
        defaults,
        public_create,
    })
}

/// Grants `access` to the group, as the owner, in one transaction: CONNECT, USAGE on the
/// schemas in scope, exactly the privileges of `access` on the owner's tables and
/// sequences there, and the same by default for what the owner creates later; default
/// privileges of the group that no longer apply are revoked.
pub async fn grant(s: &mut Session, scope: Scope<'_>, found: &Grants) -> Result<(), PgError> {
    let doing = format!("granting {} to {}", scope.access.as_str(), scope.group);
    in_transaction(s, &grant_statements(scope, found), doing).await
}

/// The statements of [`grant`].
fn grant_statements(scope: Scope<'_>, found: &Grants) -> Vec<String> {
    let Scope {
        owner,
        group,
        database,
        access,
        ..
    } = scope;
    let (o, g) = (quote_ident(owner), quote_ident(group));
    // One grant at a time per database: two users of one Database granting at once
    // would meet "tuple concurrently updated" on the database's and schemas' ACLs.
    let mut statements = vec![format!(
        "SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext({}))",
        quote_literal(&format!("{GRANT_LOCK_PREFIX}{database}"))
    )];
    if found.public_create {
        // As the admin (public belongs to the bootstrap superuser before 15): CREATE in
        // public for the owner only, as PostgreSQL 15 has it.
        statements.push(format!("GRANT CREATE ON SCHEMA public TO {o}"));
        statements.push("REVOKE CREATE ON SCHEMA public FROM PUBLIC".to_string());
    }
    statements.extend([
        format!("SET LOCAL ROLE {o}"),
        format!("GRANT CONNECT ON DATABASE {} TO {g}", quote_ident(database)),
    ]);
    let (tables, sequences) = privileges(access);
    for schema in &found.schemas {
        let n = quote_ident(schema);
        statements.extend([
            format!("GRANT USAGE ON SCHEMA {n} TO {g}"),
            format!("REVOKE ALL ON ALL TABLES IN SCHEMA {n} FROM {g}"),
            format!(
                "GRANT {} ON ALL TABLES IN SCHEMA {n} TO {g}",
                tables.join(", ")
            ),
            format!("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {n} FROM {g}"),
            format!(
                "GRANT {} ON ALL SEQUENCES IN SCHEMA {n} TO {g}",
                sequences.join(", ")
            ),
        ]);
    }
    let everywhere = scope.schemas.is_empty();
    statements.extend(default_statements(&o, &g, everywhere, found, access));
    statements
}

/// Default privileges: what no longer applies goes, then what applies is set anew (`o`,
/// `g`: the owner and the group, quoted).
fn default_statements(
    o: &str,
    g: &str,
    everywhere: bool,
    found: &Grants,
    access: Access,
) -> Vec<String> {
    let mut statements = Vec::new();
    for (schema, kind) in &found.defaults {
        let on = match kind.as_str() {
            "r" => "TABLES",
            "S" => "SEQUENCES",
            "n" => "SCHEMAS",
            "f" => "FUNCTIONS",
            "T" => "TYPES",
            _ => continue,
        };
        let in_schema = if schema.is_empty() {
            String::new()
        } else {
            format!(" IN SCHEMA {}", quote_ident(schema))
        };
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o}{in_schema} REVOKE ALL ON {on} FROM {g}"
        ));
    }
    let targets: Vec<String> = if everywhere {
        vec![String::new()]
    } else {
        found
            .schemas
            .iter()
            .map(|n| format!(" IN SCHEMA {}", quote_ident(n)))
            .collect()
    };
    let (tables, sequences) = privileges(access);
    for in_schema in &targets {
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o}{in_schema} GRANT {} ON TABLES TO {g}",
            tables.join(", ")
        ));
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o}{in_schema} GRANT {} ON SEQUENCES TO {g}",
            sequences.join(", ")
        ));
    }
    if everywhere {
        statements.push(format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {o} GRANT USAGE ON SCHEMAS TO {g}"
        ));
    }
    statements
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_wanted_cover_every_schema_or_each_one_named() {
        let (t, s) = privileges(Access::ReadOnly);
        assert_eq!(
            defaults_wanted(true, &["public".into()], t, s),
            [":S:SELECT", ":n:USAGE", ":r:SELECT"]
        );
        assert_eq!(
            defaults_wanted(false, &["b".into(), "a".into()], t, s),
            ["a:S:SELECT", "a:r:SELECT", "b:S:SELECT", "b:r:SELECT"]
        );
    }

    #[test]
    fn a_grant_replaces_what_no_longer_applies_as_the_owner() {
        let found = Grants {
            converged: false,
            missing_schemas: Vec::new(),
            schemas: vec!["app".into()],
            defaults: vec![(String::new(), "n".into()), ("x".into(), "?".into())],
            public_create: false,
        };
        let scope = Scope {
            owner: "own",
            group: "grp",
            database: "db",
            schemas: &["app".to_string()],
            access: Access::ReadWrite,
        };
        let st = grant_statements(scope, &found);
        assert!(st[0].starts_with("SELECT pg_catalog.pg_advisory_xact_lock"));
        assert_eq!(st[1], r#"SET LOCAL ROLE "own""#);
        assert!(
            st.contains(
                &r#"GRANT DELETE, INSERT, SELECT, UPDATE ON ALL TABLES IN SCHEMA "app" TO "grp""#
                    .to_string()
            )
        );
        assert!(
            st.contains(
                &r#"ALTER DEFAULT PRIVILEGES FOR ROLE "own" REVOKE ALL ON SCHEMAS FROM "grp""#
                    .to_string()
            )
        );
        assert!(
            !st.iter().any(|s| s.contains("GRANT USAGE ON SCHEMAS")),
            "not every schema"
        );
        assert_eq!(
            st.last().map(String::as_str),
            Some(
                r#"ALTER DEFAULT PRIVILEGES FOR ROLE "own" IN SCHEMA "app" GRANT SELECT, UPDATE, USAGE ON SEQUENCES TO "grp""#
            )
        );
    }
}
