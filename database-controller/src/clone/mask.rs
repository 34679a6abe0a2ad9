//! `cloneFrom.mask` on the way: the filter between pg_dump's plain output and psql. It
//! passes every line through but the data rows of a `COPY … FROM stdin;` block of a masked
//! table, whose masked fields it replaces, so the original values never reach the copy's
//! server, not even inside its transaction. Pure: the key is given, the lines come in.
//!
//! The rows are in COPY's text format: fields split by a tab, a tab, newline or backslash
//! inside a value escaped (`\t`, `\n`, `\\`), NULL written `\N`. A replaced field is
//! written the same way.
//!
//! `hash` is keyed (HMAC-SHA-256 with a key of the clone's own, never stored), so equal
//! values stay equal across tables and joins still match:
//! - text columns: the hex of the HMAC, cut to a `varchar(n)`'s or `char(n)`'s length;
//! - `bytea`: the HMAC's bytes;
//! - `uuid`: the HMAC's first 16 bytes as a uuid;
//! - integers: a keyed permutation (a Feistel network, HMAC its round function) that maps
//!   `smallint`'s range onto itself, the rest of `integer`'s onto itself and the rest of
//!   `bigint`'s onto itself: distinct keys stay distinct (a primary key stays unique), and
//!   a value hashes the same in a `smallint`, `integer` or `bigint` column.

use std::collections::HashMap;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

/// How a masked column's values are replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `\N`.
    Null,
    /// This value, as COPY's text format writes it.
    Fixed(String),
    /// The keyed hash, shaped for the column's type.
    Hash(Shape),
}

/// The type of a hashed column, as far as the hash cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Hex, at most this many characters (`varchar(n)`, `char(n)`).
    Text {
        max_chars: Option<usize>,
    },
    Bytea,
    Uuid,
    /// `smallint`, `integer`, `bigint`: the width in bits.
    Integer {
        bits: u32,
    },
}

/// The masked columns of each table (`schema`, `table` as PostgreSQL names them).
pub type Rules = HashMap<(String, String), Vec<(String, Action)>>;

/// Why the stream could not be masked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MaskError {
    #[error(
        "a row of {table} has {found} fields where its COPY names {expected} columns: not masked"
    )]
    Fields {
        table: String,
        expected: usize,
        found: usize,
    },
    #[error("{table}.{column} is masked but pg_dump's COPY of {table} does not name it")]
    Column { table: String, column: String },
    #[error("{table}.{column}: {value:?} is not an integer of {bits} bits")]
    NotAnInteger {
        table: String,
        column: String,
        value: String,
        bits: u32,
    },
}

/// What the filter has seen so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// COPY blocks ended (tables whose rows were copied).
    pub tables: u32,
    /// Fields replaced.
    pub masked: u64,
    /// Bytes read from pg_dump.
    pub bytes: u64,
}

/// A masked COPY block: each replaced field's index and action.
struct Block {
    table: String,
    columns: usize,
    fields: Vec<(usize, String, Action)>,
}

enum State {
    Sql,
    Copy(Option<Block>),
}

/// The filter over one dump.
pub struct Filter {
    rules: Rules,
    key: Key,
    state: State,
    /// The masked tables whose COPY has been seen.
    seen: std::collections::HashSet<(String, String)>,
    pub tally: Tally,
}

impl Filter {
    pub fn new(rules: Rules, key: Vec<u8>) -> Self {
        Self {
            rules,
            key: Key::new(&key),
            state: State::Sql,
            seen: Default::default(),
            tally: Tally::default(),
        }
    }

    /// The masked tables pg_dump's output has not copied (it copies every table, empty or
    /// not): a mask that was never applied fails the copy rather than pass it unmasked.
    pub fn unmasked(&self) -> Vec<String> {
        let mut missing: Vec<String> = self
            .rules
            .keys()
            .filter(|k| !self.seen.contains(*k))
            .map(|(schema, table)| format!("{schema}.{table}"))
            .collect();
        missing.sort();
        missing
    }

    /// One line of pg_dump's output (with its `\n`), written masked to `out`.
    pub fn line(&mut self, line: &[u8], out: &mut Vec<u8>) -> Result<(), MaskError> {
        self.tally.bytes += line.len() as u64;
        match &self.state {
            State::Sql => {
                if let Some((schema, table, columns)) = copy_header(line) {
                    let block = self.block(schema, table, &columns)?;
                    self.state = State::Copy(block);
                }
                out.extend_from_slice(line);
            }
            State::Copy(_) if line == b"\\.\n" || line == b"\\." => {
                self.state = State::Sql;
                self.tally.tables += 1;
                out.extend_from_slice(line);
            }
            State::Copy(None) => out.extend_from_slice(line),
            State::Copy(Some(block)) => {
                let masked = mask_row(block, &self.key, line, out)?;
                self.tally.masked += masked;
            }
        }
        Ok(())
    }

    /// The masked fields of a COPY of `schema.table` naming `columns`, if any.
    fn block(
        &mut self,
        schema: String,
        table: String,
        columns: &[String],
    ) -> Result<Option<Block>, MaskError> {
        let key = (schema.clone(), table.clone());
        let Some(rules) = self.rules.get(&key) else {
            return Ok(None);
        };
        self.seen.insert(key);
        let name = format!("{schema}.{table}");
        let mut fields = Vec::new();
        for (column, action) in rules {
            let index =
                columns
                    .iter()
                    .position(|c| c == column)
                    .ok_or_else(|| MaskError::Column {
                        table: name.clone(),
                        column: column.clone(),
                    })?;
            fields.push((index, column.clone(), action.clone()));
        }
        Ok(Some(Block {
            table: name,
            columns: columns.len(),
            fields,
        }))
    }
}

/// Writes the row `line` with the block's fields replaced; how many were.
fn mask_row(block: &Block, key: &Key, line: &[u8], out: &mut Vec<u8>) -> Result<u64, MaskError> {
    let body = line.strip_suffix(b"\n").unwrap_or(line);
    let mut fields: Vec<std::borrow::Cow<'_, [u8]>> = body
        .split(|b| *b == b'\t')
        .map(std::borrow::Cow::Borrowed)
        .collect();
    if fields.len() != block.columns {
        return Err(MaskError::Fields {
            table: block.table.clone(),
            expected: block.columns,
            found: fields.len(),
        });
    }
    let mut masked = 0;
    for (index, column, action) in &block.fields {
        let new = match action {
            Action::Null => b"\\N".to_vec(),
            Action::Fixed(value) => value.as_bytes().to_vec(),
            // NULL stays NULL: a hash of nothing would invent a value.
            Action::Hash(_) if fields[*index].as_ref() == b"\\N" => continue,
            Action::Hash(shape) => {
                hash(key, *shape, &fields[*index]).map_err(|bits| MaskError::NotAnInteger {
                    table: block.table.clone(),
                    column: column.clone(),
                    value: String::from_utf8_lossy(&fields[*index]).into_owned(),
                    bits,
                })?
            }
        };
        fields[*index] = std::borrow::Cow::Owned(new);
        masked += 1;
    }
    for (i, field) in fields.iter().enumerate() {
        if i > 0 {
            out.push(b'\t');
        }
        out.extend_from_slice(field);
    }
    out.push(b'\n');
    Ok(masked)
}

/// The keyed hash of one field (as COPY wrote it), as COPY is to read it for `shape`;
/// `Err(bits)` for an integer column whose field is not an integer.
fn hash(key: &Key, shape: Shape, field: &[u8]) -> Result<Vec<u8>, u32> {
    match shape {
        Shape::Integer { bits } => {
            let value: i64 = std::str::from_utf8(field)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or(bits)?;
            Ok(permute(key, value).to_string().into_bytes())
        }
        Shape::Text { max_chars } => {
            let mut hex = hex(&hmac(key, b"t", field));
            if let Some(max) = max_chars {
                hex.truncate(max.max(1));
            }
            Ok(hex.into_bytes())
        }
        // COPY's text format doubles the backslash of bytea's `\x`.
        Shape::Bytea => Ok(format!("\\\\x{}", hex(&hmac(key, b"b", field))).into_bytes()),
        Shape::Uuid => {
            let h = hex(&hmac(key, b"u", field));
            Ok(format!(
                "{}-{}-{}-{}-{}",
                &h[0..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..32]
            )
            .into_bytes())
        }
    }
}

/// The clone's key: its HMAC state with the pads computed once (each hash clones it),
/// and for the integer permutation's rounds SHA-256 keyed by a prefix (a 64-byte block
/// derived from the key, absorbed once): a round's input is 10 bytes, so each round costs
/// one compression where HMAC costs two.
#[derive(Clone)]
pub struct Key {
    mac: Hmac<Sha256>,
    rounds: Sha256,
}

impl Key {
    pub fn new(key: &[u8]) -> Self {
        // HMAC takes a key of any length.
        let mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        let mut derived = mac.clone();
        derived.update(b"feistel rounds");
        let mut block = [0u8; 64];
        block[..32].copy_from_slice(&derived.finalize().into_bytes());
        let mut rounds = Sha256::new();
        rounds.update(block);
        Self { mac, rounds }
    }

    /// SHA-256 of the round key's block and `input` (fixed-length inputs: a PRF).
    fn round(&self, input: &[u8]) -> [u8; 32] {
        let mut h = self.rounds.clone();
        h.update(input);
        h.finalize().into()
    }
}

fn hmac(key: &Key, domain: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = key.mac.clone();
    mac.update(domain);
    mac.update(data);
    mac.finalize().into_bytes().into()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The keyed permutation of the integers: `smallint`'s range onto itself, the rest of
/// `integer`'s onto itself, the rest of `bigint`'s onto itself (cycle-walking: a
/// permutation of a range, applied again until its result is back in the part of the
/// range the value came from, is a permutation of that part).
pub fn permute(key: &Key, value: i64) -> i64 {
    let in16 = |v: i64| i16::try_from(v).is_ok();
    let in32 = |v: i64| i32::try_from(v).is_ok();
    if in16(value) {
        return feistel(key, 16, value);
    }
    let (bits, inner): (u32, &dyn Fn(i64) -> bool) = if in32(value) {
        (32, &in16)
    } else {
        (64, &in32)
    };
    let mut v = value;
    loop {
        v = feistel(key, bits, v);
        if !inner(v) {
            return v;
        }
    }
}

/// A 4-round Feistel network over the `bits`-bit two's complement integers.
fn feistel(key: &Key, bits: u32, value: i64) -> i64 {
    let half = bits / 2;
    let mask = if half == 32 {
        u64::from(u32::MAX)
    } else {
        (1u64 << half) - 1
    };
    let unsigned = (value as u64)
        & if bits == 64 {
            u64::MAX
        } else {
            (1 << bits) - 1
        };
    let (mut left, mut right) = (unsigned >> half, unsigned & mask);
    for round in 0u8..4 {
        let mut input = [0u8; 10];
        input[0] = round;
        input[1] = bits as u8;
        input[2..].copy_from_slice(&right.to_be_bytes());
        let h = key.round(&input);
        let mut f = [0u8; 8];
        f.copy_from_slice(&h[..8]);
        let next = (left ^ u64::from_be_bytes(f)) & mask;
        left = right;
        right = next;
    }
    let out = (left << half) | right;
    // Back to a signed number of `bits` bits.
    let shift = 64 - bits;
    ((out << shift) as i64) >> shift
}

/// `COPY schema.table (col, ...) FROM stdin;`: the names, unquoted.
pub fn copy_header(line: &[u8]) -> Option<(String, String, Vec<String>)> {
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\n');
    let rest = line.strip_prefix("COPY ")?.strip_suffix(" FROM stdin;")?;
    let (schema, rest) = identifier(rest)?;
    let (table, rest) = identifier(rest.strip_prefix('.')?)?;
    let mut columns = Vec::new();
    let rest = rest.trim_start();
    if let Some(mut list) = rest.strip_prefix('(') {
        loop {
            let (column, after) = identifier(list.trim_start())?;
            columns.push(column);
            match after.chars().next()? {
                ',' => list = &after[1..],
                ')' => break,
                _ => return None,
            }
        }
    }
    Some((schema, table, columns))
}

/// One identifier as pg_dump writes it (quoted with `""` inside, or bare), and the rest.
fn identifier(text: &str) -> Option<(String, &str)> {
    if let Some(quoted) = text.strip_prefix('"') {
        let mut name = String::new();
        let mut chars = quoted.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            if c != '"' {
                name.push(c);
                continue;
            }
            if chars.peek().map(|(_, c)| *c) == Some('"') {
                chars.next();
                name.push('"');
                continue;
            }
            return Some((name, &quoted[i + 1..]));
        }
        return None;
    }
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
        .unwrap_or(text.len());
    (end > 0).then(|| (text[..end].to_string(), &text[end..]))
}

/// `value` as COPY's text format writes it.
pub fn copy_text(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(rules: &[(&str, &str, &str, Action)]) -> Filter {
        let mut map = Rules::new();
        for (schema, table, column, action) in rules {
            map.entry((schema.to_string(), table.to_string()))
                .or_default()
                .push((column.to_string(), action.clone()));
        }
        Filter::new(map, b"key".to_vec())
    }

    fn run(f: &mut Filter, input: &str) -> Result<String, MaskError> {
        let mut out = Vec::new();
        for line in input.split_inclusive('\n') {
            f.line(line.as_bytes(), &mut out)?;
        }
        Ok(String::from_utf8(out).unwrap_or_default())
    }

    #[test]
    fn copy_headers_are_read_with_pg_dumps_quoting() {
        assert_eq!(
            copy_header(b"COPY public.customers (id, email) FROM stdin;\n"),
            Some((
                "public".into(),
                "customers".into(),
                vec!["id".into(), "email".into()]
            ))
        );
        assert_eq!(
            copy_header(
                b"COPY \"My Schema\".\"Odd\"\"Name\" (\"Email\", \"select\") FROM stdin;\n"
            ),
            Some((
                "My Schema".into(),
                "Odd\"Name".into(),
                vec!["Email".into(), "select".into()]
            ))
        );
        assert_eq!(copy_header(b"CREATE TABLE public.x (a int);\n"), None);
    }

    #[test]
    fn only_the_masked_fields_of_the_masked_tables_change() {
        let mut f = filter(&[
            (
                "public",
                "customers",
                "email",
                Action::Hash(Shape::Text { max_chars: None }),
            ),
            ("public", "customers", "note", Action::Null),
            (
                "public",
                "customers",
                "tier",
                Action::Fixed(copy_text("a\tb")),
            ),
        ]);
        let input = "SET x = 1;\nCOPY public.customers (id, email, note, tier) FROM stdin;\n1\tann@example.com\tsecret\tgold\n2\t\\N\tx\tsilver\n\\.\nCOPY public.other (email) FROM stdin;\nann@example.com\n\\.\n";
        let out = run(&mut f, input).expect("masked");
        assert!(!out.contains("ann@example.com\tsecret"), "{out}");
        assert!(!out.contains("secret") && !out.contains("gold"), "{out}");
        assert!(out.contains("COPY public.other (email) FROM stdin;\nann@example.com\n"));
        let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("1\t")).collect();
        let fields: Vec<&str> = rows[0].split('\t').collect();
        assert_eq!(fields[2], "\\N");
        assert_eq!(fields[3], "a\\tb");
        assert_eq!(fields[1].len(), 64);
        // NULL stays NULL under hash.
        assert!(out.contains("2\t\\N\t\\N\ta\\tb\n"), "{out}");
        assert_eq!(f.tally.tables, 2);
        assert_eq!(f.tally.masked, 5);
        assert!(f.unmasked().is_empty());
        let f = filter(&[("public", "absent", "x", Action::Null)]);
        assert_eq!(f.unmasked(), ["public.absent"]);
    }

    #[test]
    fn equal_values_hash_equal_across_tables_and_widths() {
        let mut f = filter(&[
            (
                "public",
                "a",
                "k",
                Action::Hash(Shape::Integer { bits: 32 }),
            ),
            (
                "public",
                "b",
                "k",
                Action::Hash(Shape::Integer { bits: 64 }),
            ),
            (
                "public",
                "a",
                "e",
                Action::Hash(Shape::Text {
                    max_chars: Some(10),
                }),
            ),
            (
                "public",
                "b",
                "e",
                Action::Hash(Shape::Text { max_chars: None }),
            ),
        ]);
        let out = run(
            &mut f,
            "COPY public.a (k, e) FROM stdin;\n70000\tx@y\n\\.\nCOPY public.b (k, e) FROM stdin;\n70000\tx@y\n\\.\n",
        )
        .expect("masked");
        let rows: Vec<Vec<&str>> = out
            .lines()
            .filter(|l| !l.starts_with("COPY") && *l != "\\.")
            .map(|l| l.split('\t').collect())
            .collect();
        assert_eq!(rows[0][0], rows[1][0]);
        assert_ne!(rows[0][0], "70000");
        assert_eq!(rows[0][1].len(), 10);
        assert!(rows[1][1].starts_with(rows[0][1]));
    }

    #[test]
    fn the_integer_permutation_keeps_keys_distinct_and_in_range() {
        let key = &Key::new(b"k");
        let mut seen = std::collections::HashSet::new();
        for v in -40_000i64..40_000 {
            let p = permute(key, v);
            assert!(seen.insert(p), "{v} collides");
            assert_eq!(
                i16::try_from(v).is_ok(),
                i16::try_from(p).is_ok(),
                "{v} -> {p}"
            );
            assert!(i32::try_from(p).is_ok(), "{v} -> {p}");
        }
        for v in [i64::MAX, i64::MIN, 1 << 40, -(1 << 33)] {
            let p = permute(key, v);
            assert!(i32::try_from(p).is_err(), "{v} -> {p}");
        }
        assert_ne!(permute(key, 5), permute(&Key::new(b"other"), 5));
    }

    #[test]
    fn rows_that_do_not_fit_are_refused_not_passed() {
        let mut f = filter(&[("public", "t", "e", Action::Null)]);
        let e = run(&mut f, "COPY public.t (e, f) FROM stdin;\nonly-one\n\\.\n");
        assert!(matches!(
            e,
            Err(MaskError::Fields {
                expected: 2,
                found: 1,
                ..
            })
        ));
        let mut f = filter(&[("public", "t", "gone", Action::Null)]);
        let e = run(&mut f, "COPY public.t (e) FROM stdin;\n\\.\n");
        assert!(matches!(e, Err(MaskError::Column { .. })));
        let mut f = filter(&[(
            "public",
            "t",
            "k",
            Action::Hash(Shape::Integer { bits: 32 }),
        )]);
        let e = run(&mut f, "COPY public.t (k) FROM stdin;\nabc\n\\.\n");
        assert!(matches!(e, Err(MaskError::NotAnInteger { .. })));
    }

    #[test]
    fn uuid_and_bytea_hashes_are_what_copy_reads() {
        let u = hash(
            &Key::new(b"k"),
            Shape::Uuid,
            b"4f1c0000-0000-0000-0000-000000000000",
        )
        .expect("uuid");
        let u = String::from_utf8(u).unwrap_or_default();
        assert_eq!(u.len(), 36);
        assert_eq!(u.matches('-').count(), 4);
        let b = hash(&Key::new(b"k"), Shape::Bytea, b"\\\\x00ff").expect("bytea");
        assert!(b.starts_with(b"\\\\x"));
    }
}
