//! Row counts without counting in the freeze: the arithmetic and the baselines kept for
//! Verify (pure, nothing of this crate; the SQL is in
//! `replication::baseline`). A table's rows at a point of the source's commit order are its count in a
//! snapshot, plus the inserts minus the deletes of the transactions that snapshot did not
//! see and that committed by that point, minus those of the transactions it saw that
//! committed after it. The transactions come from a logical slot (`test_decoding`) that
//! was created before the snapshot was taken, so every transaction the snapshot did not
//! see is in the slot.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// A WAL position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `16/B374D848`, as PostgreSQL writes a `pg_lsn`.
    pub fn parse(s: &str) -> Option<Lsn> {
        let (hi, lo) = s.trim().split_once('/')?;
        let hi = u64::from_str_radix(hi, 16).ok()?;
        let lo = u64::from_str_radix(lo, 16).ok()?;
        (hi <= u64::from(u32::MAX) && lo <= u64::from(u32::MAX)).then_some(Lsn(hi << 32 | lo))
    }
}

impl std::fmt::Display for Lsn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// A `pg_snapshot` (`pg_current_snapshot()`): which transactions it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u64,
    xmax: u64,
    xip: Vec<u64>,
}

impl Snapshot {
    /// `xmin:xmax:xip,...`, as PostgreSQL writes a `pg_snapshot`.
    pub fn parse(s: &str) -> Option<Snapshot> {
        let mut parts = s.trim().split(':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        (parts.next().is_none() && xmin <= xmax).then_some(Snapshot { xmin, xmax, xip })
    }

    /// Whether the snapshot sees the committed transaction `xid` (a 32-bit transaction ID,
    /// as a slot reports it): the full ID is the one of those low bits nearest `xmin`, which
    /// is right for every transaction within 2^31 of the snapshot.
    pub fn sees(&self, xid: u32) -> bool {
        let full = self.widen(xid);
        full < self.xmin || (full < self.xmax && !self.xip.contains(&full))
    }

    fn widen(&self, xid: u32) -> u64 {
        let epoch = self.xmin >> 32;
        [epoch.saturating_sub(1), epoch, epoch + 1]
            .into_iter()
            .map(|e| e << 32 | u64::from(xid))
            .min_by_key(|full| full.abs_diff(self.xmin))
            .unwrap_or(u64::from(xid))
    }
}

/// The rows of every table, the same on both servers at the source's position `at`.
#[derive(Debug, Clone)]
pub struct Baseline {
    pub at: Lsn,
    /// (schema, table), as `sql::tables` orders them.
    pub tables: Vec<(String, String)>,
    /// The tables as `test_decoding` names them.
    pub names: Vec<String>,
    pub rows: Vec<i64>,
    /// The target's snapshot the rows were counted in.
    pub target_snapshot: Snapshot,
}

/// The baselines of this process, by Migration UID (`State::baselines`; taken by
/// `baseline::take`, used by Verify).
#[derive(Debug, Default)]
pub struct Baselines(Mutex<HashMap<String, Baseline>>);

impl Baselines {
    pub fn put(&self, uid: &str, b: Baseline) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid.to_string(), b);
    }

    /// The Migration's baseline, taken out.
    pub fn take(&self, uid: &str) -> Option<Baseline> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(uid)
    }
}

/// One committed transaction, as a slot decoded it: where its commit ends and its inserts
/// minus deletes per table (by index into the tables counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Txn {
    pub xid: u32,
    pub end: Lsn,
    pub delta: BTreeMap<usize, i64>,
}

/// What a slot held: its committed transactions, or why the changes cannot be added up.
pub type Decoded = Result<Vec<Txn>, String>;

/// The rows of each table once every transaction that committed by `at` is applied and
/// none after it, from `counted` (in `snapshot`) and the slot's transactions.
pub fn at(counted: &[i64], snapshot: &Snapshot, txns: &[Txn], at: Lsn) -> Vec<i64> {
    let mut rows = counted.to_vec();
    for txn in txns {
        let sign = match (snapshot.sees(txn.xid), txn.end <= at) {
            (false, true) => 1,
            (true, false) => -1,
            _ => continue,
        };
        add(&mut rows, txn, sign);
    }
    rows
}

/// The rows of each table now, from `counted` (in `snapshot`) and every transaction of the
/// slot the snapshot did not see.
pub fn now(counted: &[i64], snapshot: &Snapshot, txns: &[Txn]) -> Vec<i64> {
    let mut rows = counted.to_vec();
    for txn in txns.iter().filter(|t| !snapshot.sees(t.xid)) {
        add(&mut rows, txn, 1);
    }
    rows
}

/// The rows of each table now, from `rows` as they were at `at` and every transaction of
/// the slot that committed after it.
pub fn after(rows: &[i64], txns: &[Txn], at: Lsn) -> Vec<i64> {
    let mut rows = rows.to_vec();
    for txn in txns.iter().filter(|t| t.end > at) {
        add(&mut rows, txn, 1);
    }
    rows
}

fn add(rows: &mut [i64], txn: &Txn, sign: i64) {
    for (&table, &d) in &txn.delta {
        if let Some(r) = rows.get_mut(table) {
            *r += sign * d;
        }
    }
}

/// One row of the decoding query: a transaction, the table (as `test_decoding` names it,
/// empty for none), the kind of change (`INSERT`, `UPDATE`, `DELETE`, `TRUNCATE`, `COMMIT`
/// or `OTHER`: a BEGIN, a message), how many and the last position.
#[derive(Debug, Clone)]
pub struct Change {
    pub xid: u32,
    pub table: String,
    pub op: String,
    pub count: i64,
    pub lsn: Lsn,
}

/// The slot's changes made transactions over `tables` (each named as `test_decoding`
/// does: `schema.table`, quoted where needed). A TRUNCATE, or a change to a table not in
/// `tables`, makes them something that cannot be added up.
pub fn transactions(changes: &[Change], tables: &[String]) -> Decoded {
    let index: BTreeMap<&str, usize> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut txns: BTreeMap<u32, (Option<Lsn>, BTreeMap<usize, i64>)> = BTreeMap::new();
    for c in changes {
        let entry = txns.entry(c.xid).or_default();
        let sign = match c.op.as_str() {
            "COMMIT" => {
                entry.0 = Some(c.lsn);
                continue;
            }
            "OTHER" => continue,
            "INSERT" => 1,
            "DELETE" => -1,
            "UPDATE" => 0,
            op => return Err(format!("a {op} of {} was replicated", c.table)),
        };
        let Some(&table) = index.get(c.table.as_str()) else {
            return Err(format!("{} changed, a table not counted", c.table));
        };
        *entry.1.entry(table).or_default() += sign * c.count;
    }
    txns.into_iter()
        .map(|(xid, (end, delta))| {
            let end = end.ok_or_else(|| format!("transaction {xid} has no commit"))?;
            Ok(Txn { xid, end, delta })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn txn(xid: u32, end: u64, delta: &[(usize, i64)]) -> Txn {
        Txn {
            xid,
            end: Lsn(end),
            delta: delta.iter().copied().collect(),
        }
    }

    #[test]
    fn positions_and_snapshots_read_as_postgres_writes_them() {
        assert_eq!(Lsn::parse("16/B374D848"), Some(Lsn(0x16_B374_D848)));
        assert_eq!(Lsn::parse("0/0"), Some(Lsn(0)));
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn::parse("16"), None);
        assert_eq!(Lsn::parse("x/1"), None);
        let s = Snapshot::parse("732:740:733,735").unwrap();
        assert!(s.sees(700) && s.sees(731) && s.sees(734) && s.sees(739));
        assert!(!s.sees(733) && !s.sees(735) && !s.sees(740) && !s.sees(800));
        assert!(Snapshot::parse("732:732:").unwrap().sees(731));
        assert_eq!(Snapshot::parse("740:732:"), None);
        assert_eq!(Snapshot::parse("1:2:x"), None);
        assert_eq!(Snapshot::parse("1:2"), None);
    }

    #[test]
    fn transaction_ids_widen_across_an_epoch() {
        // xmin just past the first wraparound: xid 0xFFFF_FFF0 is the epoch before.
        let s = Snapshot::parse(&format!("{}:{}:", (1u64 << 32) + 5, (1u64 << 32) + 9)).unwrap();
        assert!(s.sees(0xFFFF_FFF0));
        assert!(s.sees(6));
        assert!(!s.sees(9) && !s.sees(20));
        // xmin just before it: xid 3 is the next epoch, not seen.
        let s = Snapshot::parse(&format!("{}:{}:", (1u64 << 32) - 5, (1u64 << 32) - 1)).unwrap();
        assert!(!s.sees(3));
        assert!(s.sees(0xFFFF_FFF0));
    }

    #[test]
    fn rows_at_a_position_add_what_the_snapshot_missed_and_take_off_what_came_after() {
        // The snapshot saw 100 (committed at 10) and 102 (at 30), not 101 (at 20, in
        // progress then) nor 103 (at 40, after it).
        let snapshot = Snapshot::parse("101:103:101").unwrap();
        let txns = [
            txn(100, 10, &[(0, 5)]),
            txn(101, 20, &[(0, 2), (1, -1)]),
            txn(102, 30, &[(1, 4)]),
            txn(103, 40, &[(0, 1)]),
        ];
        let counted = [50, 60]; // includes 100's and 102's changes
        // At 20: 100 and 101 applied, 102 not.
        assert_eq!(at(&counted, &snapshot, &txns, Lsn(20)), vec![52, 55]);
        // At 30: and 102.
        assert_eq!(at(&counted, &snapshot, &txns, Lsn(30)), vec![52, 59]);
        // At 5: none of them (100 and 102 taken off).
        assert_eq!(at(&counted, &snapshot, &txns, Lsn(5)), vec![45, 56]);
        // Now: all of them.
        assert_eq!(now(&counted, &snapshot, &txns), vec![53, 59]);
        assert_eq!(after(&[52, 55], &txns, Lsn(20)), vec![53, 59]);
    }

    #[test]
    fn changes_make_transactions_or_say_why_they_cannot() {
        let tables = vec!["public.a".to_string(), "public.\"b: INSERT\"".to_string()];
        let change = |xid, table: &str, op: &str, count, lsn| Change {
            xid,
            table: table.into(),
            op: op.into(),
            count,
            lsn: Lsn(lsn),
        };
        let changes = [
            change(7, "public.a", "INSERT", 3, 10),
            change(7, "public.\"b: INSERT\"", "DELETE", 2, 11),
            change(7, "public.a", "UPDATE", 9, 12),
            change(7, "", "OTHER", 1, 9),
            change(7, "", "COMMIT", 1, 13),
            change(8, "public.a", "DELETE", 1, 14),
            change(8, "", "COMMIT", 1, 15),
        ];
        assert_eq!(
            transactions(&changes, &tables),
            Ok(vec![txn(7, 13, &[(0, 3), (1, -2)]), txn(8, 15, &[(0, -1)])])
        );
        let truncate = [change(9, "public.a", "TRUNCATE", 1, 16)];
        assert!(transactions(&truncate, &tables).is_err());
        let unknown = [change(9, "public.c", "INSERT", 1, 16)];
        assert!(transactions(&unknown, &tables).is_err());
        let open = [change(9, "public.a", "INSERT", 1, 16)];
        assert!(transactions(&open, &tables).is_err());
    }
}
