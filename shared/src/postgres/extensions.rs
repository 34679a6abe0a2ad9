//! Which extensions a Database may have on a DatabaseServer, and creating them safely.
//!
//! The policy (`DatabaseServer.spec.allowedExtensions`): when the list is given, exactly
//! those; when it is absent, only the extensions PostgreSQL marks `trusted` (those a
//! database owner with CREATE on its database could create on its own, PostgreSQL 13 and
//! newer). Anything else is refused before any statement that changes the server runs
//! ([`refusal`], pure).
//!
//! `CREATE EXTENSION` always names its schema: the admin session's `search_path` is
//! pinned to `pg_catalog, pg_temp` (see [`super::ADMIN_SEARCH_PATH`]), so without one the
//! extension would land in `pg_catalog`. The schema is the one the extension's control
//! file fixes, if any, else `public` (where it went before the pin).

use dbops_api::SharedReason;

use super::error::PgError;
use super::quote::quote_ident;
use super::session::Session;

/// The schema an extension goes to when its control file does not fix one.
pub const DEFAULT_SCHEMA: &str = "public";

/// What the server says of one extension (its default version).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Available {
    pub name: String,
    /// `pg_available_extension_versions.trusted`.
    pub trusted: bool,
    /// The schema its control file fixes (`schema = ...`), if any.
    pub schema: Option<String>,
}

impl Available {
    /// The schema `CREATE EXTENSION` names.
    pub fn schema(&self) -> &str {
        self.schema.as_deref().unwrap_or(DEFAULT_SCHEMA)
    }
}

/// Why an extension cannot be had on a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `ExtensionNotAllowed` or `ExtensionNotAvailable`.
    pub reason: SharedReason,
    pub message: String,
}

/// Reads what the server offers of `names` (those it does not offer are absent).
pub async fn available(s: &Session, names: &[String]) -> Result<Vec<Available>, PgError> {
    let rows = s
        .query(
            "SELECT v.name::text, v.trusted, v.schema::text \
               FROM pg_available_extension_versions v \
               JOIN pg_available_extensions a \
                 ON a.name = v.name AND a.default_version = v.version \
              WHERE v.name::text = ANY ($1::text[]) \
              ORDER BY 1",
            &[&names],
        )
        .await
        .map_err(PgError::sql("reading pg_available_extension_versions"))?;
    Ok(rows
        .iter()
        .map(|r| Available {
            name: r.get(0),
            trusted: r.get(1),
            schema: r.get(2),
        })
        .collect())
}

/// The first of `wanted` (in its order) that the server `server` may not have, and why;
/// `None` when every one is allowed and available. `allowed` is the DatabaseServer's
/// `allowedExtensions`; `offered` what [`available`] read; `superuser` whether the admin
/// is one (only a superuser creates an extension PostgreSQL does not mark trusted).
pub fn refusal(
    wanted: &[String],
    allowed: Option<&[String]>,
    offered: &[Available],
    server: &str,
    superuser: bool,
) -> Option<Refusal> {
    let mut not_allowed = Vec::new();
    let mut not_available = Vec::new();
    for name in wanted {
        let info = offered.iter().find(|a| &a.name == name);
        let ok = match allowed {
            Some(list) => list.iter().any(|a| a == name),
            None => info.is_some_and(|a| a.trusted),
        };
        if !ok {
            not_allowed.push(name.as_str());
        } else if info.is_none() {
            not_available.push(name.as_str());
        }
    }
    if !not_allowed.is_empty() {
        let why = match allowed {
            Some(list) => format!(
                "DatabaseServer {server:?} allows only the extensions of its allowedExtensions {list:?}"
            ),
            None => format!(
                "DatabaseServer {server:?} sets no allowedExtensions, so only the extensions PostgreSQL marks trusted are allowed, and {} not",
                if not_allowed.len() == 1 {
                    "this one is"
                } else {
                    "these are"
                }
            ),
        };
        return Some(Refusal {
            reason: SharedReason::ExtensionNotAllowed,
            message: format!(
                "extension{} {} not allowed: {why}; nothing was created for {}",
                if not_allowed.len() == 1 { "" } else { "s" },
                not_allowed.join(", "),
                if not_allowed.len() == 1 { "it" } else { "them" }
            ),
        });
    }
    let untrusted: Vec<&str> = wanted
        .iter()
        .filter(|name| offered.iter().any(|a| &a.name == *name && !a.trusted))
        .map(String::as_str)
        .collect();
    if !superuser && !untrusted.is_empty() {
        return Some(Refusal {
            reason: SharedReason::AdminLacksPrivilege,
            message: format!(
                "extension{} {} not trusted by PostgreSQL, and creating {} needs SUPERUSER, which the admin of DatabaseServer {server:?} lacks (status.capabilities); nothing was created",
                if untrusted.len() == 1 { "" } else { "s" },
                untrusted.join(", "),
                if untrusted.len() == 1 { "it" } else { "them" }
            ),
        });
    }
    if !not_available.is_empty() {
        return Some(Refusal {
            reason: SharedReason::ExtensionNotAvailable,
            message: format!(
                "extension{} {} not available on DatabaseServer {server:?} (not in pg_available_extensions)",
                if not_available.len() == 1 { "" } else { "s" },
                not_available.join(", ")
            ),
        });
    }
    None
}

/// Whether any of `offered` is not trusted: then [`refusal`] must know whether the admin
/// is a superuser.
pub fn any_untrusted(offered: &[Available]) -> bool {
    offered.iter().any(|a| !a.trusted)
}

/// Creates the extension, if missing, in the database the session is connected to, in
/// its schema (see the module's documentation).
pub async fn create(s: &Session, extension: &Available) -> Result<(), PgError> {
    super::ddl::execute(
        s,
        &format!(
            "CREATE EXTENSION IF NOT EXISTS {} SCHEMA {}",
            quote_ident(&extension.name),
            quote_ident(extension.schema())
        ),
        format!("creating extension {}", extension.name),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(name: &str, trusted: bool) -> Available {
        Available {
            name: name.into(),
            trusted,
            schema: None,
        }
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn without_a_list_only_trusted_extensions_are_allowed() {
        let offered = [ext("pgcrypto", true), ext("file_fdw", false)];
        assert_eq!(
            refusal(&names(&["pgcrypto"]), None, &offered, "pg", true),
            None
        );
        let r = refusal(
            &names(&["pgcrypto", "file_fdw"]),
            None,
            &offered,
            "pg",
            true,
        )
        .unwrap();
        assert_eq!(r.reason, "ExtensionNotAllowed");
        assert!(r.message.contains("file_fdw"), "{}", r.message);
        assert!(!r.message.contains("pgcrypto"), "{}", r.message);
        assert!(r.message.contains("trusted"), "{}", r.message);
    }

    #[test]
    fn a_list_allows_exactly_its_extensions_trusted_or_not() {
        let offered = [ext("pgcrypto", true), ext("file_fdw", false)];
        let list = names(&["file_fdw"]);
        assert_eq!(
            refusal(&names(&["file_fdw"]), Some(&list), &offered, "pg", true),
            None
        );
        let r = refusal(&names(&["pgcrypto"]), Some(&list), &offered, "pg", true).unwrap();
        assert_eq!(r.reason, "ExtensionNotAllowed");
        assert!(r.message.contains("pgcrypto") && r.message.contains("allowedExtensions"));
    }

    #[test]
    fn an_allowed_extension_the_server_lacks_is_reported_as_unavailable() {
        let list = names(&["postgis"]);
        let r = refusal(&names(&["postgis"]), Some(&list), &[], "pg", true).unwrap();
        assert_eq!(r.reason, "ExtensionNotAvailable");
        assert!(r.message.contains("postgis"));
        // Without a list, an unknown extension is not known to be trusted: not allowed.
        let r = refusal(&names(&["postgis"]), None, &[], "pg", true).unwrap();
        assert_eq!(r.reason, "ExtensionNotAllowed");
    }

    #[test]
    fn an_admin_that_is_not_a_superuser_is_refused_an_untrusted_extension_by_name() {
        let offered = [ext("pgcrypto", true), ext("file_fdw", false)];
        let list = names(&["pgcrypto", "file_fdw"]);
        let r = refusal(&list, Some(&list), &offered, "rds", false).unwrap();
        assert_eq!(r.reason, "AdminLacksPrivilege");
        assert!(r.message.contains("file_fdw") && r.message.contains("SUPERUSER"));
        assert!(!r.message.contains("pgcrypto"), "{}", r.message);
        assert_eq!(
            refusal(&names(&["pgcrypto"]), Some(&list), &offered, "rds", false),
            None
        );
        assert_eq!(refusal(&list, Some(&list), &offered, "rds", true), None);
    }

    #[test]
    fn an_extension_goes_to_its_fixed_schema_or_public() {
        let mut e = ext("x", true);
        assert_eq!(e.schema(), "public");
        e.schema = Some("pg_catalog".into());
        assert_eq!(e.schema(), "pg_catalog");
    }
}
