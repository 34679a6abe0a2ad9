//! Where a password could leak on a PostgreSQL server, and a search for the ones known:
//! the passwords of Secrets (every key naming a password, and the one inside a
//! `postgresql://user:password@...` URI), those inside a subscription's connection string
//! (`pg_subscription.subconninfo`), looked for in every line of a log and every
//! `pg_stat_statements` query text; SCRAM verifiers (`SCRAM-SHA-256$4096:...`) are looked
//! for too, as dbops never lets one be logged either. A [`Finding`] says which secret and
//! where, never the secret itself.
//!
//! Also [`weak_authentication`]: whether a server keeps any password other than as a
//! SCRAM-SHA-256 verifier.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Secret;
use tokio_postgres::Client;

use crate::postgres::try_scalar;

/// What every SCRAM-SHA-256 verifier dbops sends starts with (4096 iterations).
pub const VERIFIER_PREFIX: &str = "SCRAM-SHA-256$4096:";

/// Shorter values are not looked for (they would match by chance).
const MIN_LEN: usize = 8;

/// The secrets looked for, each with where it was seen first.
#[derive(Default)]
pub struct Known {
    secrets: BTreeMap<String, String>,
}

impl fmt::Debug for Known {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.secrets.values()).finish()
    }
}

impl Known {
    /// `value`, seen in `origin` (for example `Secret default/orders-connection key
    /// password`); values shorter than 8 characters are left out.
    pub fn add(&mut self, origin: impl Into<String>, value: &str) {
        if value.len() >= MIN_LEN {
            self.secrets
                .entry(value.to_string())
                .or_insert_with(|| origin.into());
        }
    }

    /// The passwords of a Secret: each key whose name says password, and the password of
    /// each URI `scheme://user:password@host...` among its values.
    pub fn add_secret(&mut self, secret: &Secret) {
        let name = format!(
            "Secret {}/{}",
            secret.metadata.namespace.as_deref().unwrap_or_default(),
            secret.metadata.name.as_deref().unwrap_or_default()
        );
        let data = secret.data.iter().flatten().map(|(k, v)| (k, v.0.clone()));
        let string_data = secret
            .string_data
            .iter()
            .flatten()
            .map(|(k, v)| (k, v.clone().into_bytes()));
        for (key, value) in data.chain(string_data) {
            let Ok(value) = String::from_utf8(value) else {
                continue;
            };
            if key.to_ascii_lowercase().contains("password") {
                self.add(format!("{name} key {key}"), &value);
            }
            if let Some(password) = uri_password(&value) {
                self.add(format!("{name} key {key} (its password)"), &password);
            }
            // The backups' age secret keys (`--backup-identities-secret`).
            for line in value.lines().map(str::trim) {
                if line.starts_with("AGE-SECRET-KEY-") {
                    self.add(format!("{name} key {key} (an age secret key)"), line);
                }
            }
        }
    }

    /// The password in a libpq connection string (`password='...'`), as a subscription
    /// keeps it.
    pub fn add_conninfo(&mut self, origin: &str, conninfo: &str) {
        if let Some(password) = conninfo_password(conninfo) {
            self.add(origin, &password);
        }
    }

    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// Where each secret came from (never the secret).
    pub fn origins(&self) -> Vec<&str> {
        self.secrets.values().map(String::as_str).collect()
    }

    /// Every known secret, and any SCRAM verifier, in `text`, line by line; `place` names
    /// the text (a file, a view).
    pub fn search(&self, place: &str, text: &str) -> Vec<Finding> {
        let mut found = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let at = format!("{place} line {}", number + 1);
            for (secret, origin) in &self.secrets {
                if line.contains(secret.as_str()) {
                    found.push(Finding {
                        what: format!("the password of {origin}"),
                        place: at.clone(),
                    });
                }
            }
            if line.contains(VERIFIER_PREFIX) {
                found.push(Finding {
                    what: "a SCRAM verifier".to_string(),
                    place: at,
                });
            }
        }
        found
    }

    /// [`Known::search`] of a file (read lossily: a log may hold any byte).
    pub fn search_file(&self, path: &Path) -> Result<Vec<Finding>> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Ok(self.search(
            &path.display().to_string(),
            &String::from_utf8_lossy(&bytes),
        ))
    }
}

/// A secret found where it must not be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Which secret (by origin, never its value).
    pub what: String,
    /// Where: a file and line, or a view and row.
    pub place: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in {}", self.what, self.place)
    }
}

/// The password of `scheme://user:password@host...`, percent-decoded.
fn uri_password(value: &str) -> Option<String> {
    let (_, rest) = value.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let (userinfo, _) = authority.rsplit_once('@')?;
    let (_, password) = userinfo.split_once(':')?;
    Some(percent_decode(password))
}

fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of `password` in a libpq connection string: `password=word` or
/// `password='quoted \' value'`.
fn conninfo_password(conninfo: &str) -> Option<String> {
    let mut rest = conninfo;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return None;
        }
        let (key, after) = rest.split_once('=')?;
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('\'') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '\'' => {
                        end = i + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            (value, &quoted[end.min(quoted.len())..])
        } else {
            let end = after.find(char::is_whitespace).unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        if key.trim() == "password" {
            return Some(value);
        }
        rest = next;
    }
}

/// The query texts `pg_stat_statements` keeps (every database's), `None` when the view
/// is not there (the extension not created in the connected database).
pub async fn pg_stat_statements_texts(client: &Client) -> Result<Option<Vec<String>>> {
    let exists: bool = try_scalar(
        client,
        "SELECT pg_catalog.to_regclass('pg_stat_statements') IS NOT NULL",
    )
    .await?;
    if !exists {
        return Ok(None);
    }
    let rows = client
        .query("SELECT query FROM pg_stat_statements", &[])
        .await
        .context("reading pg_stat_statements")?;
    Ok(Some(
        rows.iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect(),
    ))
}

/// The connection strings of the server's subscriptions (`pg_subscription.subconninfo`,
/// which only a superuser may read), with each subscription's name.
pub async fn subscription_conninfos(client: &Client) -> Result<Vec<(String, String)>> {
    let rows = client
        .query(
            "SELECT subname::text, subconninfo FROM pg_catalog.pg_subscription",
            &[],
        )
        .await
        .context("reading pg_subscription")?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// What keeps the server from holding SCRAM-SHA-256 verifiers only: `password_encryption`
/// other than `scram-sha-256`, and each role whose password is kept otherwise (MD5 or in
/// clear text). Empty when all is well.
pub async fn weak_authentication(client: &Client) -> Result<Vec<String>> {
    let mut weak = Vec::new();
    let encryption: String = try_scalar(
        client,
        "SELECT pg_catalog.current_setting('password_encryption')",
    )
    .await?;
    if encryption != "scram-sha-256" {
        weak.push(format!("password_encryption is {encryption}"));
    }
    let rows = client
        .query(
            "SELECT rolname::text FROM pg_catalog.pg_authid \
              WHERE rolpassword IS NOT NULL AND NOT pg_catalog.starts_with(rolpassword, $1) \
              ORDER BY 1",
            &[&"SCRAM-SHA-256$"],
        )
        .await
        .context("reading pg_authid")?;
    weak.extend(rows.iter().map(|r| {
        format!(
            "role {} has a password that is no SCRAM verifier",
            r.get::<_, String>(0)
        )
    }));
    Ok(weak)
}

/// The methods of the `connection authenticated` lines of a server log
/// (`log_connections=on`, PostgreSQL 14+), with how many lines said each.
pub fn authentication_methods(log: &str) -> BTreeMap<String, usize> {
    let mut methods = BTreeMap::new();
    for line in log.lines() {
        let Some((_, rest)) = line.split_once("connection authenticated: ") else {
            continue;
        };
        if let Some((_, method)) = rest.split_once("method=") {
            let method = method.split_whitespace().next().unwrap_or_default();
            *methods.entry(method.to_string()).or_default() += 1;
        }
    }
    methods
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    #[test]
    fn passwords_are_read_from_secrets_uris_and_connection_strings() {
        let mut secret = Secret::default();
        secret.metadata.namespace = Some("team".into());
        secret.metadata.name = Some("app-connection".into());
        secret.data = Some(
            [
                ("password", "Pw0rd-of-32-characters"),
                ("PGPASSWORD", "Pw0rd-of-32-characters"),
                (
                    "uri",
                    "postgresql://app:p%40ss-in-uri@db:5432/app?sslmode=verify-full",
                ),
                ("username", "not-a-secret-at-all"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
            .collect(),
        );
        let mut known = Known::default();
        known.add_secret(&secret);
        known.add_conninfo(
            "subscription s",
            "host='h' port='5432' user='r' password='it\\'s-a-s\\\\ecret' sslmode='require'",
        );
        known.add("too short", "abc");
        assert_eq!(known.len(), 3, "{known:?}");

        let log = "LOG:  statement: SELECT 1\n\
                   LOG:  statement: ALTER ROLE x PASSWORD 'Pw0rd-of-32-characters'\n\
                   ERROR: bad p@ss-in-uri and it's-a-s\\ecret\n\
                   LOG:  statement: CREATE ROLE y PASSWORD 'SCRAM-SHA-256$4096:abc'\n";
        let found: Vec<String> = known
            .search("server.log", log)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            found,
            [
                "the password of Secret team/app-connection key PGPASSWORD in server.log line 2",
                "the password of subscription s in server.log line 3",
                "the password of Secret team/app-connection key uri (its password) in server.log line 3",
                "a SCRAM verifier in server.log line 4",
            ]
        );
        assert!(found.iter().all(|f| !f.contains("Pw0rd")), "{found:?}");
        assert!(known.search("clean", "LOG: statement: SELECT 1").is_empty());
    }

    #[test]
    fn authentication_methods_are_counted() {
        let log = "2026 [1] LOG:  connection authenticated: identity=\"postgres\" method=scram-sha-256 (/x/pg_hba.conf:118)\n\
                   2026 [2] LOG:  connection authenticated: user=\"postgres\" method=trust (/x/pg_hba.conf:117)\n\
                   2026 [3] LOG:  connection authenticated: identity=\"app\" method=scram-sha-256 (/x/pg_hba.conf:118)\n";
        let methods = authentication_methods(log);
        assert_eq!(methods.get("scram-sha-256"), Some(&2));
        assert_eq!(methods.get("trust"), Some(&1));
    }
}
