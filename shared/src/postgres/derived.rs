//! The names dbops derives for roles a tenant did not name itself: a Database owner's two
//! rotation logins, a DatabaseUser's group role and its two logins. No field a tenant
//! controls can produce one of them, so no tenant can take a name another needs (say, by
//! naming its Database's owner after another tenant's next rotation login).
//!
//! A name a tenant gives (`spec.owner`, `spec.databaseName`) is `^[a-z_][a-z0-9_]{0,62}$`
//! (the CRD's rule). A derived name always holds a character those cannot, and each kind
//! its own pattern:
//!
//! | kind | name | holds |
//! |---|---|---|
//! | owner's logins | `<owner>-1`, `<owner>-2` | one `-`, no `.` |
//! | DatabaseUser's group | `<database>.<user>` | one `.`, no `-` |
//! | DatabaseUser's logins | `<database>.<user>-1`, `-2` | one `.`, one `-` |
//!
//! `<user>` is the DatabaseUser's `metadata.name` with every character but `a-z0-9_` read
//! as `_` (so it has neither `-` nor `.`). A database name has no `.`, so the first `.`
//! of a group splits the database from the user: two databases' groups never meet, and
//! a database is one tenant's on its server. A base longer than PostgreSQL allows (63
//! bytes, less 2 for `-1`) keeps its first [`KEPT`] bytes and gets `~` and 20 hex digits
//! (80 bits) of its SHA-256: a name without `~` is never shortened, and two shortened
//! ones meet only if their whole bases do, or on a collision of the hash nobody can
//! find on purpose.

use crate::checksum::sha256_hex;

/// The longest base: a login adds `-1` or `-2` to it, and PostgreSQL keeps 63 bytes.
pub const MAX_BASE: usize = 61;
/// The bytes of a base kept before `~` when it is shortened.
pub const KEPT: usize = MAX_BASE - 1 - HASH_HEX;
/// Hex digits of the hash of a shortened base.
const HASH_HEX: usize = 20;

/// `base` if it fits in [`MAX_BASE`] bytes, else shortened (see the module's doc).
fn fit(base: &str) -> String {
    if base.len() <= MAX_BASE {
        return base.to_string();
    }
    let mut cut = KEPT;
    while !base.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}~{}",
        &base[..cut],
        &sha256_hex(base.as_bytes())[..HASH_HEX]
    )
}

/// The two logins of a base, in turn order.
fn pair(base: &str) -> [String; 2] {
    [format!("{base}-1"), format!("{base}-2")]
}

/// A Database owner's two rotation logins.
pub fn owner_logins(owner: &str) -> [String; 2] {
    pair(&fit(owner))
}

/// The group role of the DatabaseUser `user` (its `metadata.name`) of `database`.
pub fn user_group(database: &str, user: &str) -> String {
    let user: String = user
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '_' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '_',
        })
        .collect();
    fit(&format!("{database}.{user}"))
}

/// A DatabaseUser's two logins, of its group.
pub fn user_logins(group: &str) -> [String; 2] {
    pair(group)
}

/// Whether a tenant could give this name to a role (`spec.owner`, or a database name that
/// becomes its owner's): the CRD's pattern.
pub fn tenant_can_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_derived_name_is_one_a_tenant_can_give() {
        let owners = ["sq9452", "orders_owner", "a", &"o".repeat(63)];
        for owner in owners {
            for login in owner_logins(owner) {
                assert!(!tenant_can_name(&login), "{login}");
                assert!(login.len() <= 63, "{login}");
            }
        }
        for (db, user) in [
            ("sq9452", "dash"),
            ("orders", "orders-dashboard"),
            ("d", "x.y"),
        ] {
            let group = user_group(db, user);
            assert!(!tenant_can_name(&group), "{group}");
            for login in user_logins(&group) {
                assert!(!tenant_can_name(&login), "{login}");
            }
        }
        // The case: tenant B names a Database sq9452_1 (owner sq9452_1); tenant A's
        // first rotation login is no longer that name.
        assert!(tenant_can_name("sq9452_1"));
        assert_eq!(owner_logins("sq9452"), ["sq9452-1", "sq9452-2"]);
    }

    #[test]
    fn the_three_kinds_never_meet() {
        // A group of database `a` and user `b_1` against owner `a`'s login, and against the
        // logins of database `a`'s user `b`.
        assert_ne!(user_group("a", "1"), owner_logins("a")[0]);
        assert_eq!(user_group("a", "b-1"), "a.b_1");
        assert_eq!(user_logins(&user_group("a", "b"))[0], "a.b-1");
        assert_ne!(
            user_group("a", "b-1"),
            user_logins(&user_group("a", "b"))[0]
        );
        // Databases a_b (user c) and a (user b_c): the first `.` splits them.
        assert_ne!(user_group("a_b", "c"), user_group("a", "b_c"));
    }

    #[test]
    fn a_long_base_is_shortened_with_a_hash_and_stays_apart() {
        let long_a = format!("{}a", "x".repeat(62));
        let long_b = format!("{}b", "x".repeat(62));
        let [a1, _] = owner_logins(&long_a);
        let [b1, _] = owner_logins(&long_b);
        assert_eq!(a1.len(), 63);
        assert!(a1.contains('~') && a1.ends_with("-1"), "{a1}");
        assert_ne!(a1, b1);
        let group = user_group(&"d".repeat(63), "reader");
        assert_eq!(group.len(), MAX_BASE);
        assert!(group.contains('~'));
        // A base that fits is kept whole.
        assert_eq!(
            owner_logins(&"o".repeat(61))[1],
            format!("{}-2", "o".repeat(61))
        );
    }
}
