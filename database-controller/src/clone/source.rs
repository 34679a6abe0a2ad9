//! What a clone reads of its source, in the admin's snapshot transaction there: the
//! snapshot pg_dump is to read and its instant, the server's major, the tables to copy,
//! and `cloneFrom.mask` checked against the catalog and turned into the filter's rules.
//! Catalog reads only: nothing of the tenant's runs as the admin here.

use std::collections::HashMap;

use dbops_api::reasons::DatabaseReason;
use dbops_api::{MaskRule, MaskWith};
use dbops_shared::postgres::{PgError, Transaction};

use super::mask::{Action, Rules, Shape, copy_text};
use crate::error::{Error, Result};

/// The source as the snapshot shows it.
pub struct Snapshot {
    /// For `pg_dump --snapshot`, valid while the transaction is open.
    pub id: String,
    /// When the snapshot was taken (the server's clock).
    pub at: k8s_openapi::jiff::Timestamp,
    pub server_version_num: i32,
    /// Tables pg_dump copies rows of (the tenant's, not an extension's).
    pub tables: i32,
}

const SNAPSHOT: &str = "SELECT pg_catalog.pg_export_snapshot(), \
       pg_catalog.to_char(pg_catalog.clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
       pg_catalog.current_setting('server_version_num')::int, \
       (SELECT count(*)::int FROM pg_catalog.pg_class c \
          JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relkind = 'r' \
           AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
           AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp\\_%' \
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend d \
                            WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass \
                              AND d.objid = c.oid AND d.deptype = 'e'))";

/// Makes `tx` a read-only snapshot and exports it.
pub async fn snapshot(tx: &Transaction<'_>) -> Result<Snapshot> {
    tx.batch_execute(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; SET LOCAL row_security = off",
    )
    .await
    .map_err(PgError::sql("preparing the clone's snapshot"))?;
    let row = tx
        .query_one(SNAPSHOT, &[])
        .await
        .map_err(PgError::sql("exporting the clone's snapshot"))?;
    let at: String = row.get(1);
    Ok(Snapshot {
        id: row.get(0),
        at: at
            .parse()
            .map_err(|e| Error::Internal(format!("the server's clock {at:?}: {e}")))?,
        server_version_num: row.get(2),
        tables: row.get(3),
    })
}

/// A masked column as the catalog has it.
struct Column {
    table_oid: u32,
    attnum: i16,
    not_null: bool,
    generated: bool,
    /// `format_type` of its type.
    type_name: String,
    /// The name of its base type (a domain's), and whether the column's type is a
    /// built-in one (of pg_catalog, not a domain).
    base: String,
    builtin: bool,
    /// `varchar(n)`/`char(n)`: n.
    max_chars: Option<usize>,
    in_unique_key: bool,
}

const TABLE: &str = "SELECT c.oid FROM pg_catalog.pg_class c \
     JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')";

const COLUMN: &str = "SELECT a.attnum, a.attnotnull, a.attgenerated <> '', \
       pg_catalog.format_type(a.atttypid, a.atttypmod), b.typname::text, \
       bn.nspname = 'pg_catalog' AND t.typtype <> 'd', \
       CASE WHEN a.atttypmod > 4 THEN a.atttypmod - 4 \
            WHEN t.typtypmod > 4 THEN t.typtypmod - 4 END, \
       EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = a.attrelid \
                  AND i.indisunique AND a.attnum = ANY (i.indkey)) \
     FROM pg_catalog.pg_attribute a \
     JOIN pg_catalog.pg_type t ON t.oid = a.atttypid \
     JOIN pg_catalog.pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END \
     JOIN pg_catalog.pg_namespace bn ON bn.oid = b.typnamespace \
     WHERE a.attrelid = $1 AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped";

/// The table (unless partitioned) and its leaf partitions, as (schema, name): the
/// tables pg_dump copies rows of.
const LEAVES: &str = "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
     JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.relkind = 'r' AND (c.oid = $1 OR c.oid IN ( \
       SELECT p.relid FROM pg_catalog.pg_partition_tree($1::pg_catalog.oid::pg_catalog.regclass) p \
        WHERE p.isleaf))";

/// Every foreign key's column pairs: (referencing table oid, attnum), (referenced ...).
const FOREIGN_KEYS: &str = "SELECT k.conrelid, p.ra, k.confrelid, p.fa, k.conname::text \
     FROM pg_catalog.pg_constraint k, \
          ROWS FROM (pg_catalog.unnest(k.conkey), pg_catalog.unnest(k.confkey)) AS p(ra, fa) \
     WHERE k.contype = 'f' AND k.conparentid = 0";

fn invalid(index: usize, field: &str, why: String) -> Error {
    Error::Reported {
        reason: DatabaseReason::MaskInvalid.into(),
        message: format!("spec.cloneFrom.mask[{index}].{field}: {why}; nothing was copied"),
    }
}

/// `mask` checked against the source's catalog (each table and column there, each
/// replacement one the column can take, a foreign key's two ends hashed alike) and
/// turned into the filter's rules, partitions included.
pub async fn rules(tx: &Transaction<'_>, mask: &[MaskRule], source: &str) -> Result<Rules> {
    let mut rules = Rules::new();
    let mut masked: HashMap<(u32, i16), (usize, MaskWith)> = HashMap::new();
    for (index, rule) in mask.iter().enumerate() {
        let column = column(tx, index, rule, source).await?;
        let action = action(index, rule, &column, tx).await?;
        masked.insert((column.table_oid, column.attnum), (index, rule.with));
        let leaves = tx
            .query(LEAVES, &[&column.table_oid])
            .await
            .map_err(PgError::sql("listing a masked table's partitions"))?;
        for leaf in leaves {
            rules
                .entry((leaf.get(0), leaf.get(1)))
                .or_default()
                .push((rule.column.clone(), action.clone()));
        }
    }
    check_foreign_keys(tx, &masked).await?;
    Ok(rules)
}

async fn column(
    tx: &Transaction<'_>,
    index: usize,
    rule: &MaskRule,
    source: &str,
) -> Result<Column> {
    let (schema, table) = rule.table.split_once('.').unwrap_or(("", &rule.table));
    let table_oid: u32 = tx
        .query_opt(TABLE, &[&schema, &table])
        .await
        .map_err(PgError::sql("finding a masked table"))?
        .ok_or_else(|| {
            invalid(
                index,
                "table",
                format!("{source} has no table {}", rule.table),
            )
        })?
        .get(0);
    let row = tx
        .query_opt(COLUMN, &[&table_oid, &rule.column])
        .await
        .map_err(PgError::sql("finding a masked column"))?
        .ok_or_else(|| {
            invalid(
                index,
                "column",
                format!("{} has no column {:?}", rule.table, rule.column),
            )
        })?;
    Ok(Column {
        table_oid,
        attnum: row.get(0),
        not_null: row.get(1),
        generated: row.get(2),
        type_name: row.get(3),
        base: row.get(4),
        builtin: row.get(5),
        max_chars: row
            .get::<_, Option<i32>>(6)
            .and_then(|n| usize::try_from(n).ok()),
        in_unique_key: row.get(7),
    })
}

/// The replacement `rule` asks for, if the column can take it.
async fn action(index: usize, rule: &MaskRule, c: &Column, tx: &Transaction<'_>) -> Result<Action> {
    let name = format!("{}.{}", rule.table, rule.column);
    if c.generated {
        return Err(invalid(
            index,
            "column",
            format!(
                "{name} is generated: it is computed in the copy from the columns it reads, mask those"
            ),
        ));
    }
    match rule.with {
        MaskWith::Nullify if c.not_null => Err(invalid(
            index,
            "with",
            format!("{name} is NOT NULL: nullify cannot mask it; use hash or fixed"),
        )),
        MaskWith::Nullify => Ok(Action::Null),
        MaskWith::Fixed if c.in_unique_key => Err(invalid(
            index,
            "with",
            format!(
                "{name} is in a unique key: one fixed value in every row would break it; use hash"
            ),
        )),
        MaskWith::Fixed => {
            let value = rule.value.clone().unwrap_or_default();
            if c.builtin {
                fits(tx, &value, &c.type_name).await.map_err(|why| {
                    invalid(
                        index,
                        "value",
                        format!("{value:?} is not a {}: {why}", c.type_name),
                    )
                })?;
            }
            Ok(Action::Fixed(copy_text(&value)))
        }
        MaskWith::Hash => {
            let shape = shape(c).ok_or_else(|| invalid(index, "with", format!("hash keeps text, bytea, uuid and integer columns; {name} is {}: use nullify or fixed", c.type_name)))?;
            if short_on_unique(shape, c.in_unique_key) {
                return Err(invalid(
                    index,
                    "with",
                    format!(
                        "{name} is in a unique key and is {}: a hash cut to fewer than {UNIQUE_HEX} hex characters may give two rows one value; widen the column or mask it otherwise",
                        c.type_name
                    ),
                ));
            }
            Ok(Action::Hash(shape))
        }
    }
}

/// The fewest hex characters (64 bits) a hash cut to a column's length keeps in a unique
/// key: fewer could give two rows one value, and the copy's unique index would fail on
/// every attempt.
pub const UNIQUE_HEX: usize = 16;

/// Whether hashing a column of `shape` in a unique key could break the key.
pub fn short_on_unique(shape: Shape, in_unique_key: bool) -> bool {
    in_unique_key && matches!(shape, Shape::Text { max_chars: Some(n) } if n < UNIQUE_HEX)
}

/// Whether `value` reads as a value of the built-in `type_name`: its input function, a
/// system one (a domain's or a tenant type's is never run as the admin: those are
/// checked when the copy loads them, as the owner).
async fn fits(tx: &Transaction<'_>, value: &str, type_name: &str) -> Result<(), String> {
    let savepoint = "SAVEPOINT dbops_mask_value";
    tx.batch_execute(savepoint)
        .await
        .map_err(|e| e.to_string())?;
    let checked = tx
        .query_one(
            &format!("SELECT CAST($1::text AS {type_name})::text"),
            &[&value],
        )
        .await;
    let _ = tx
        .batch_execute("ROLLBACK TO SAVEPOINT dbops_mask_value")
        .await;
    checked.map(|_| ()).map_err(|e| {
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_string())
    })
}

fn shape(c: &Column) -> Option<Shape> {
    Some(match c.base.as_str() {
        "text" | "varchar" | "bpchar" | "citext" | "name" => Shape::Text {
            max_chars: c.max_chars,
        },
        "bytea" => Shape::Bytea,
        "uuid" => Shape::Uuid,
        "int2" => Shape::Integer { bits: 16 },
        "int4" => Shape::Integer { bits: 32 },
        "int8" => Shape::Integer { bits: 64 },
        _ => return None,
    })
}

/// A foreign key between a hashed column and one that is not hashed would not hold in
/// the copy: refused before anything is copied.
async fn check_foreign_keys(
    tx: &Transaction<'_>,
    masked: &HashMap<(u32, i16), (usize, MaskWith)>,
) -> Result<()> {
    if masked.is_empty() {
        return Ok(());
    }
    let pairs = tx
        .query(FOREIGN_KEYS, &[])
        .await
        .map_err(PgError::sql("reading the foreign keys"))?;
    for pair in pairs {
        let child = (pair.get::<_, u32>(0), pair.get::<_, i16>(1));
        let parent = (pair.get::<_, u32>(2), pair.get::<_, i16>(3));
        let (child, parent) = (masked.get(&child), masked.get(&parent));
        if let Some(why) = foreign_key_refusal(child.map(|(_, w)| w), parent.map(|(_, w)| w)) {
            let index = child.or(parent).map_or(0, |(i, _)| *i);
            let name: String = pair.get(4);
            return Err(invalid(index, "with", format!("foreign key {name}: {why}")));
        }
    }
    Ok(())
}

/// Why masking a foreign key's referencing column as `child` and its referenced column as
/// `parent` breaks the key, if it does.
pub fn foreign_key_refusal(
    child: Option<&MaskWith>,
    parent: Option<&MaskWith>,
) -> Option<&'static str> {
    match (child, parent) {
        (None, None) | (Some(MaskWith::Hash), Some(MaskWith::Hash)) => None,
        // NULL never violates a foreign key.
        (Some(MaskWith::Nullify), _) => None,
        (_, Some(_)) => Some(
            "a masked column is referenced by a foreign key whose referencing column is not hashed with it: hash both ends, or neither",
        ),
        (Some(_), None) => Some(
            "a masked column references, through a foreign key, a column that is not hashed with it: hash both ends, or nullify the referencing one",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_cut_short_is_refused_only_in_a_unique_key() {
        let short = Shape::Text { max_chars: Some(8) };
        assert!(short_on_unique(short, true));
        assert!(!short_on_unique(short, false));
        assert!(!short_on_unique(
            Shape::Text {
                max_chars: Some(16)
            },
            true
        ));
        assert!(!short_on_unique(Shape::Text { max_chars: None }, true));
        assert!(!short_on_unique(Shape::Integer { bits: 32 }, true));
    }

    #[test]
    fn foreign_keys_hold_when_both_ends_hash_or_the_child_is_null() {
        let h = Some(&MaskWith::Hash);
        let n = Some(&MaskWith::Nullify);
        let f = Some(&MaskWith::Fixed);
        assert_eq!(foreign_key_refusal(h, h), None);
        assert_eq!(foreign_key_refusal(None, None), None);
        assert_eq!(foreign_key_refusal(n, None), None);
        assert!(foreign_key_refusal(h, None).is_some());
        assert!(foreign_key_refusal(None, h).is_some());
        assert!(foreign_key_refusal(f, h).is_some());
        assert!(foreign_key_refusal(None, n).is_some());
    }
}
