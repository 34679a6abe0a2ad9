//! What a dump saw, taken in the dump's own snapshot, and the same taken of a restored
//! copy, compared: the rows of each table, the schema's objects by kind, the extensions.
//!
//! The dump side runs in the admin's `REPEATABLE READ` transaction that exported the
//! snapshot pg_dump reads (`pg_dump --snapshot`), so the counts are of the very rows the
//! artifact holds. Only what pg_dump dumps is counted: the tenant's schemas (not
//! `pg_*`, not `information_schema`), ordinary tables and their partitions, `ONLY` each
//! (an inheritance parent's own rows), and nothing that belongs to an extension.
//!
//! No tenant code runs for it: `count(*)` calls no user function, tables only (a view or
//! a rule is never read), and `row_security = off` (as pg_dump sets it) makes a table
//! whose row-level security would apply to the reader an error instead of running its
//! policies. Identifiers are quoted by PostgreSQL's own `format('%I')`.

use std::collections::BTreeMap;

use dbops_shared::postgres::{PgError, Transaction};
use serde::{Deserialize, Serialize};

/// The rows, objects and extensions of one database at one instant.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    /// Rows per table, keyed `schema.table` as PostgreSQL quotes them.
    pub tables: BTreeMap<String, i64>,
    /// Objects per kind (`table`, `index`, `function`, `constraint`, ...) in the tenant's
    /// schemas, extension members and what hangs on them left out.
    pub objects: BTreeMap<String, i64>,
    /// The extensions installed, by name.
    pub extensions: Vec<String>,
}

/// Every counted table with its rows, in one statement (each count through
/// `query_to_xml`, in the same transaction: the same snapshot).
const TABLE_ROWS: &str = r#"
SELECT pg_catalog.format('%I.%I', n.nspname, c.relname),
       ((pg_catalog.xpath('/row/n/text()', pg_catalog.query_to_xml(
           pg_catalog.format('SELECT pg_catalog.count(*) AS n FROM ONLY %I.%I', n.nspname, c.relname),
           false, true, '')))[1])::text::bigint
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relkind = 'r'
   AND n.nspname <> 'information_schema' AND n.nspname !~ '^pg_'
   AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
                    WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                      AND d.objid = c.oid AND d.deptype = 'e')
 ORDER BY 1"#;

/// The tenant's objects by kind: relations (indexes of extension tables left out),
/// functions, types, constraints and triggers of counted tables, policies, schemas.
const OBJECTS: &str = r#"
WITH ns AS (
  SELECT oid FROM pg_catalog.pg_namespace
   WHERE nspname <> 'information_schema' AND nspname !~ '^pg_'
), ext AS (
  SELECT classid, objid FROM pg_catalog.pg_depend WHERE deptype = 'e'
), rel AS (
  SELECT c.oid, c.relkind FROM pg_catalog.pg_class c
   WHERE c.relnamespace IN (SELECT oid FROM ns)
     AND c.oid NOT IN (SELECT objid FROM ext WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
)
SELECT kind, pg_catalog.count(*)::bigint FROM (
  SELECT CASE r.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'partitioned table'
           WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' WHEN 'S' THEN 'sequence'
           WHEN 'i' THEN 'index' WHEN 'I' THEN 'partitioned index'
           WHEN 'f' THEN 'foreign table' WHEN 'c' THEN 'composite type'
           ELSE 'relation kind ' || r.relkind::text END AS kind
    FROM rel r
   WHERE r.relkind NOT IN ('i', 'I')
      OR EXISTS (SELECT 1 FROM pg_catalog.pg_index i JOIN rel t ON t.oid = i.indrelid
                  WHERE i.indexrelid = r.oid)
  UNION ALL
  SELECT 'function' FROM pg_catalog.pg_proc p
   WHERE p.pronamespace IN (SELECT oid FROM ns)
     AND p.oid NOT IN (SELECT objid FROM ext WHERE classid = 'pg_catalog.pg_proc'::pg_catalog.regclass)
  UNION ALL
  SELECT 'type' FROM pg_catalog.pg_type t
   WHERE t.typnamespace IN (SELECT oid FROM ns) AND t.typtype IN ('e', 'd', 'r')
     AND t.oid NOT IN (SELECT objid FROM ext WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
  UNION ALL
  SELECT 'constraint' FROM pg_catalog.pg_constraint co JOIN rel r ON r.oid = co.conrelid
  UNION ALL
  SELECT 'trigger' FROM pg_catalog.pg_trigger tg JOIN rel r ON r.oid = tg.tgrelid
   WHERE NOT tg.tgisinternal AND tg.tgparentid = 0
  UNION ALL
  SELECT 'policy' FROM pg_catalog.pg_policy po JOIN rel r ON r.oid = po.polrelid
  UNION ALL
  SELECT 'schema' FROM ns
   WHERE ns.oid NOT IN (SELECT objid FROM ext WHERE classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass)
) o GROUP BY kind ORDER BY kind"#;

const EXTENSIONS: &str = "SELECT extname::text FROM pg_catalog.pg_extension ORDER BY 1";

/// Makes `tx` (just begun) the snapshot to count in: `REPEATABLE READ`, read only, with
/// row security off and statements bounded by `timeout`.
pub async fn prepare(tx: &Transaction<'_>, timeout: std::time::Duration) -> Result<(), String> {
    tx.batch_execute(&format!(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; \
         SET LOCAL row_security = off; SET LOCAL statement_timeout = {}",
        timeout.as_millis().max(1)
    ))
    .await
    .map_err(|e| PgError::sql("preparing the snapshot")(e).to_string())
}

/// Exports `tx`'s snapshot for `pg_dump --snapshot`: valid while `tx` is open.
pub async fn export_snapshot(tx: &Transaction<'_>) -> Result<String, String> {
    let row = tx
        .query_one("SELECT pg_catalog.pg_export_snapshot()", &[])
        .await
        .map_err(|e| PgError::sql("exporting the snapshot")(e).to_string())?;
    Ok(row.get(0))
}

/// The inventory of the database `tx` is in, in its snapshot.
pub async fn take(tx: &Transaction<'_>) -> Result<Inventory, String> {
    let fail = |what: &str, e| PgError::sql(what)(e).to_string();
    let tables = tx
        .query(TABLE_ROWS, &[])
        .await
        .map_err(|e| fail("counting the rows of each table", e))?
        .iter()
        .map(|r| {
            (
                r.get::<_, String>(0),
                r.get::<_, Option<i64>>(1).unwrap_or(0),
            )
        })
        .collect();
    let objects = tx
        .query(OBJECTS, &[])
        .await
        .map_err(|e| fail("counting the schema's objects", e))?
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect();
    let extensions = tx
        .query(EXTENSIONS, &[])
        .await
        .map_err(|e| fail("listing the extensions", e))?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    Ok(Inventory {
        tables,
        objects,
        extensions,
    })
}

/// How a restored copy differs from what the dump saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// Tables with other row counts (`(table, dumped, restored)`), at most a few named.
    Rows(Vec<(String, i64, Option<i64>)>),
    /// Other objects or extensions: what differs, said in words.
    Objects(Vec<String>),
}

/// At most this many differences are named in a message.
const NAMED: usize = 5;

impl Inventory {
    /// Rows in all counted tables.
    pub fn rows(&self) -> i64 {
        self.tables.values().sum()
    }

    /// How `restored` differs from `self` (what the dump saw), row counts first.
    pub fn compare(&self, restored: &Inventory) -> Option<Difference> {
        let rows: Vec<_> = self
            .tables
            .iter()
            .filter(|(t, n)| restored.tables.get(*t) != Some(n))
            .map(|(t, n)| (t.clone(), *n, restored.tables.get(t).copied()))
            .collect();
        if !rows.is_empty() {
            return Some(Difference::Rows(rows));
        }
        let mut objects = Vec::new();
        for t in restored
            .tables
            .keys()
            .filter(|t| !self.tables.contains_key(*t))
        {
            objects.push(format!("table {t} was not in the dump"));
        }
        let kinds: std::collections::BTreeSet<_> =
            self.objects.keys().chain(restored.objects.keys()).collect();
        for kind in kinds {
            let (a, b) = (self.objects.get(kind), restored.objects.get(kind));
            if a != b {
                objects.push(format!(
                    "{kind}: {} in the dump, {} restored",
                    a.unwrap_or(&0),
                    b.unwrap_or(&0)
                ));
            }
        }
        if self.extensions != restored.extensions {
            objects.push(format!(
                "extensions: [{}] in the dump, [{}] restored",
                self.extensions.join(", "),
                restored.extensions.join(", ")
            ));
        }
        (!objects.is_empty()).then_some(Difference::Objects(objects))
    }
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Difference::Rows(rows) => {
                let named: Vec<String> = rows
                    .iter()
                    .take(NAMED)
                    .map(|(t, dumped, restored)| match restored {
                        Some(n) => {
                            format!("{t}: {dumped} rows in the dump's snapshot, {n} restored")
                        }
                        None => format!("{t}: {dumped} rows in the dump's snapshot, not restored"),
                    })
                    .collect();
                write!(f, "{} table(s) differ: {}", rows.len(), named.join("; "))?;
            }
            Difference::Objects(what) => {
                let named: Vec<&str> = what.iter().take(NAMED).map(String::as_str).collect();
                write!(f, "{}", named.join("; "))?;
            }
        }
        let more = match self {
            Difference::Rows(r) => r.len(),
            Difference::Objects(o) => o.len(),
        };
        if more > NAMED {
            write!(f, " (and {} more)", more - NAMED)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory(tables: &[(&str, i64)], objects: &[(&str, i64)], ext: &[&str]) -> Inventory {
        Inventory {
            tables: tables.iter().map(|(t, n)| (t.to_string(), *n)).collect(),
            objects: objects.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
            extensions: ext.iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn the_same_inventory_has_no_difference_and_counts_its_rows() {
        let a = inventory(
            &[("public.a", 3), ("public.b", 4)],
            &[("table", 2)],
            &["plpgsql"],
        );
        assert_eq!(a.compare(&a.clone()), None);
        assert_eq!(a.rows(), 7);
    }

    #[test]
    fn row_counts_are_named_first_then_objects_and_extensions() {
        let dumped = inventory(
            &[("public.a", 3), ("public.b", 4)],
            &[("table", 2)],
            &["plpgsql"],
        );
        let fewer = inventory(&[("public.a", 2)], &[("table", 1)], &["plpgsql"]);
        let diff = dumped.compare(&fewer).expect("rows differ");
        assert_eq!(
            diff,
            Difference::Rows(vec![
                ("public.a".into(), 3, Some(2)),
                ("public.b".into(), 4, None)
            ])
        );
        let said = diff.to_string();
        assert!(
            said.contains("public.a: 3 rows in the dump's snapshot, 2 restored"),
            "{said}"
        );
        assert!(
            said.contains("public.b: 4 rows in the dump's snapshot, not restored"),
            "{said}"
        );

        let other = inventory(
            &[("public.a", 3), ("public.b", 4), ("public.c", 0)],
            &[("table", 3), ("index", 1)],
            &["pgcrypto", "plpgsql"],
        );
        let Some(Difference::Objects(what)) = dumped.compare(&other) else {
            panic!("objects differ");
        };
        assert_eq!(what[0], "table public.c was not in the dump");
        assert!(
            what.contains(&"index: 0 in the dump, 1 restored".to_string()),
            "{what:?}"
        );
        assert!(
            what.contains(&"table: 2 in the dump, 3 restored".to_string()),
            "{what:?}"
        );
        assert!(
            what.iter().any(|w| w.starts_with("extensions: [plpgsql]")),
            "{what:?}"
        );
    }

    #[test]
    fn a_long_list_of_differences_is_cut_short() {
        let dumped = inventory(
            &(0..8)
                .map(|i| (["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"][i], 1))
                .collect::<Vec<_>>(),
            &[],
            &[],
        );
        let said = dumped.compare(&Inventory::default()).unwrap().to_string();
        assert!(said.starts_with("8 table(s) differ"), "{said}");
        assert!(said.ends_with("(and 3 more)"), "{said}");
    }
}
